"""The same-node route (transport/rollouts/local.py): Unix socket bytes, Flight's contract.

Every guarantee the Flight tests check holds here too, on a real socket between threads:
authentication with the run's secret, the schema check, dedup by (producer, number),
back-pressure with `put_timeout`, reconnecting under the same number, and falling back
to Flight whenever the socket is not reachable.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.transport.rollouts import socket_dir
from verl_hpc.transport.rollouts.flight import RolloutFlightClient, RolloutFlightServer
from verl_hpc.transport.rollouts.local import DISABLE_ENV, local_location, reachable_path

TOKEN = "local-secret"


def _batch(rows: int, response_len: int = 8, step: int = 0) -> RolloutBatch:
    return RolloutBatch.from_generation([[1, 2, 3]] * rows, [[4 + r % 5] * response_len for r in range(rows)],
                                        [[-0.5] * response_len] * rows, group_ids=list(range(rows)),
                                        prompt_index=list(range(rows)), ground_truth=["7"] * rows,
                                        policy_version=3, step=step)


@pytest.fixture
def server():
    with RolloutFlightServer(token=TOKEN, capacity=4, local=True) as srv:
        yield srv


def _client(srv: RolloutFlightServer, token: str = TOKEN, producer: str = "p0", **kwargs) -> RolloutFlightClient:
    return RolloutFlightClient(srv.location, token, producer, local_location=srv.local_location, **kwargs)


@pytest.mark.parametrize("rows,response_len", [(3, 8), (600, 512)], ids=["copied-small", "zero-copy-large"])
def test_batches_arrive_equal_over_the_socket_and_not_over_flight(server, rows: int, response_len: int) -> None:
    sent = [_batch(rows, response_len, step=s) for s in range(3)]
    with _client(server) as client:
        assert client.same_node
        for batch in sent:
            client.put(batch)
        got = [server.get(timeout=5) for _ in sent]
    assert all(g.record_batch.equals(s.record_batch) for g, s in zip(got, sent, strict=True))
    stats = server.stats()
    assert stats["local_batches"] == 3 and stats["received"] == 3
    assert stats["streams_opened"] == 0  # nothing went through gRPC


def test_socket_lives_in_a_private_directory_removed_at_shutdown() -> None:
    srv = RolloutFlightServer(token=TOKEN, local=True)
    path = reachable_path(srv.local_location)
    assert path is not None and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    srv.shutdown()
    assert not os.path.exists(os.path.dirname(path))


def _dead_socket_dir(base: str, name: str, age_s: float) -> str:
    """A socket directory as a kill -9'd trainer leaves it: the socket file, no listener."""
    path = os.path.join(base, socket_dir.PREFIX + name)
    os.mkdir(path, 0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.path.join(path, socket_dir.SOCKET_NAME))
    sock.close()  # closed without unlinking: connect() is now refused
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def test_a_new_server_sweeps_directories_of_killed_trainers_and_keeps_live_and_young_ones(tmp_path) -> None:
    base = str(tmp_path)
    killed = _dead_socket_dir(base, "killed", age_s=3600)
    empty = os.path.join(base, socket_dir.PREFIX + "empty")
    os.mkdir(empty)
    os.utime(empty, (time.time() - 3600,) * 2)
    starting = _dead_socket_dir(base, "starting", age_s=1)  # may be a server between mkdtemp and bind
    other = os.path.join(base, "someone-elses")
    os.mkdir(other)
    os.utime(other, (time.time() - 3600,) * 2)
    with RolloutFlightServer(token=TOKEN, local=True) as live:
        live_dir = os.path.dirname(reachable_path(live.local_location) or "")
        os.utime(live_dir, (time.time() - 3600,) * 2)
        assert sorted(socket_dir.sweep_stale(base)) == sorted([killed, empty])
        assert live_dir not in socket_dir.sweep_stale(os.path.dirname(live_dir))  # a listener: kept, however old
        with _client(live) as client:
            client.put(_batch(1))
        assert len(live.get(timeout=5)) == 1
    assert not os.path.exists(killed) and not os.path.exists(empty)
    assert os.path.exists(starting) and os.path.exists(other)


def test_the_server_sweeps_its_socket_base_when_it_starts(monkeypatch, tmp_path) -> None:
    killed = _dead_socket_dir(str(tmp_path), "killed", age_s=3600)
    monkeypatch.setattr(socket_dir, "base_dir", lambda: str(tmp_path))
    with RolloutFlightServer(token=TOKEN, local=True) as srv:
        assert reachable_path(srv.local_location).startswith(str(tmp_path))
    assert not os.path.exists(killed)


def test_a_wrong_token_is_refused_and_nothing_is_enqueued(server) -> None:
    with _client(server, token="not-the-secret", retries=0) as client, \
            pytest.raises(flight.FlightUnauthenticatedError, match="flight_token"):
        client.put(_batch(2))
    assert server.stats()["rejected"] == 1 and server.qsize() == 0


def test_a_resent_number_is_acknowledged_as_duplicate_and_enqueued_once(server) -> None:
    with _client(server) as client:
        assert client.put_with_sequence(_batch(2), 0) == "queued"
        assert client.put_with_sequence(_batch(2), 0) == "duplicate"
    assert server.qsize() == 1 and server.stats()["duplicates"] == 1


def test_a_batch_with_the_wrong_columns_is_refused_naming_the_column(server) -> None:
    bad = RolloutBatch(_batch(2).record_batch.drop_columns(["ground_truth"]), check=False)
    with _client(server, retries=0) as client, pytest.raises(flight.FlightServerError, match="ground_truth"):
        client.put(bad)
    assert server.qsize() == 0 and server.stats()["rejected"] == 1


def test_a_batch_failing_the_row_checks_is_dropped_when_taken_and_the_next_one_returned(server, caplog) -> None:
    """Rows are checked when the trainer takes a batch (wire.EncodedBatch), not on the put's path:
    a bad one (only a sender bypassing RolloutBatch's own check can make it) is acknowledged,
    then dropped at `get`, counted and logged with its producer and number, and the trainer
    gets the next batch."""
    good = _batch(2, step=1)
    columns = good.record_batch.to_pydict()
    columns["rollout_logprobs"] = [[-0.5] * 3, [-0.5] * 8]  # row 0: 3 logprobs for 8 response tokens
    bad = RolloutBatch(pa.RecordBatch.from_pydict(columns, schema=good.record_batch.schema), check=False)
    with _client(server, retries=0) as client:
        assert client.put_with_sequence(bad, 0) == "queued"
        client.put_with_sequence(good, 1)
    with caplog.at_level(logging.ERROR, logger="verl_hpc.transport.rollouts.buffer"):
        got = server.get(timeout=5)
    assert got.record_batch.equals(good.record_batch)
    assert server.stats()["rejected"] == 1 and server.qsize() == 0
    assert "'p0' #0 rejected" in caplog.text and "rollout_logprobs" in caplog.text


def test_a_garbled_message_is_dropped_when_taken_not_decoded_on_arrival(server) -> None:
    from verl_hpc.transport.rollouts.wire import EncodedBatch

    schema = _batch(1).record_batch.schema
    with pytest.raises(flight.FlightServerError, match="#9 rejected: not a record batch message"):
        EncodedBatch(np.frombuffer(b"\xff" * 64, dtype=np.uint8), schema, "rollout put from 'p' #9").decode()
    buffer = server._buffer
    buffer.offer(("p", 9), EncodedBatch(np.zeros(16, dtype=np.uint8), schema, "rollout put from 'p' #9"), lambda: False)
    with pytest.raises(TimeoutError):
        server.get(timeout=0.3)
    assert server.stats()["rejected"] == 1


def test_full_buffer_blocks_then_put_timeout_and_the_retry_lands_once() -> None:
    with RolloutFlightServer(token=TOKEN, capacity=1, local=True) as srv, \
            _client(srv, put_timeout=0.5) as client:
        client.put(_batch(1, step=0))
        start = time.monotonic()
        with pytest.raises(flight.FlightTimedOutError, match="put_timeout"):
            client.put_with_sequence(_batch(1, step=1), 1)
        assert time.monotonic() - start >= 0.5
        assert srv.get(timeout=5).column("step")[0].as_py() == 0
        # The timed-out put may still have landed once room appeared; a retry never lands twice.
        status = client.put_with_sequence(_batch(1, step=1), 1)
        assert srv.get(timeout=5).column("step")[0].as_py() == 1
        assert status in ("queued", "duplicate") and srv.qsize() == 0


def test_a_put_blocked_on_a_full_buffer_proceeds_when_the_trainer_takes_one() -> None:
    with RolloutFlightServer(token=TOKEN, capacity=1, local=True) as srv, _client(srv) as client:
        client.put(_batch(1, step=0))
        done = threading.Event()
        worker = threading.Thread(target=lambda: (client.put(_batch(1, step=1)), done.set()))
        worker.start()
        assert not done.wait(0.3)  # blocked: the buffer is full
        assert srv.get(timeout=5).column("step")[0].as_py() == 0
        assert done.wait(5)
        worker.join()
        assert srv.get(timeout=5).column("step")[0].as_py() == 1


def test_a_broken_connection_reconnects_and_the_resent_batch_is_deduplicated(server) -> None:
    with _client(server, backoff_s=0.01) as client:
        client.put(_batch(1, step=0))
        for conn in list(server._local._conns):  # the trainer side drops the connection
            conn.shutdown(socket.SHUT_RDWR)
        client.put(_batch(1, step=1))  # the dead connection is noticed, a new one carries it
        assert client.put_with_sequence(_batch(1, step=1), 1) == "duplicate"
    assert [server.get(timeout=5).column("step")[0].as_py() for _ in range(2)] == [0, 1]
    assert server.stats()["local_connections"] == 2 and server.qsize() == 0


def test_a_vanished_socket_falls_back_to_flight(server) -> None:
    with _client(server, backoff_s=0.01) as client:
        os.unlink(reachable_path(server.local_location))  # type: ignore[arg-type]
        client.put(_batch(2))
        assert not client.same_node
    assert len(server.get(timeout=5)) == 2
    assert server.stats()["streams_opened"] == 1


def test_another_host_or_the_switch_off_means_flight(server, monkeypatch) -> None:
    elsewhere = server.local_location.replace(socket.gethostname(), "some-other-node")
    assert reachable_path(elsewhere) is None
    assert reachable_path(local_location("/no/such/socket")) is None
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert reachable_path(server.local_location) is None
    with _client(server) as client:
        assert not client.same_node
        client.put(_batch(1))
    assert server.stats()["streams_opened"] == 1 and len(server.get(timeout=5)) == 1


def test_many_producers_share_the_socket_with_every_batch_counted_once(server) -> None:
    producers, per = 6, 15

    def produce(p: int) -> None:
        with _client(server, producer=f"p{p}") as client:
            for i in range(per):
                client.put(_batch(1, step=p * 100 + i))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    steps = [server.get(timeout=10).column("step")[0].as_py() for _ in range(producers * per)]
    for t in threads:
        t.join()
    assert sorted(steps) == sorted(p * 100 + i for p in range(producers) for i in range(per))
    assert server.stats()["duplicates"] == 0 and server.qsize() == 0

