"""Rollout transport over Arrow Flight, on real loopback sockets.

Why real sockets: authentication, backpressure and error propagation all live in
gRPC's call handling; a mocked transport would test none of them.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.transport.rollouts import (
    RolloutFlightClient,
    RolloutFlightServer,
    create_run_secret,
    read_run_secret,
    secret_path,
)

TOKEN = "a" * 64


def make_batch(tag: int, rows: int = 3) -> RolloutBatch:
    """A small batch whose contents are determined by `tag` (for checksums)."""
    rng = np.random.default_rng(tag)
    responses = [rng.integers(0, 1000, size=int(rng.integers(1, 6))).tolist() for _ in range(rows)]
    return RolloutBatch.from_generation(
        prompt_ids=[[tag, i] for i in range(rows)], response_ids=responses,
        rollout_logprobs=[[-0.5] * len(r) for r in responses], group_ids=[tag] * rows,
        prompt_index=[tag * 100 + i for i in range(rows)], ground_truth=[str(tag)] * rows, policy_version=1)


def checksum(batches: list[RolloutBatch]) -> int:
    return sum(int(b.column("response_ids").flatten().to_numpy().astype(np.int64).sum()) for b in batches)


@pytest.fixture
def server() -> Iterator[RolloutFlightServer]:
    with RolloutFlightServer(token=TOKEN, capacity=8) as srv:
        yield srv


def client_for(srv: RolloutFlightServer, token: str | None = TOKEN, producer: str = "w0",
               **kwargs: object) -> RolloutFlightClient:
    return RolloutFlightClient(f"grpc://127.0.0.1:{srv.port}", token or "", producer, **kwargs)


def test_puts_arrive_in_order_and_equal(server: RolloutFlightServer) -> None:
    sent = [make_batch(i) for i in range(5)]
    with client_for(server) as client:
        assert client.ping() >= 0
        for batch in sent:
            client.put(batch)
        assert client.next_sequence_no == 5
    got = [server.get(timeout=5) for _ in sent]
    for want, have in zip(sent, got, strict=True):
        assert have.record_batch.equals(want.record_batch)
    assert server.qsize() == 0
    assert server.stats()["received"] == 5


@pytest.mark.parametrize("token", ["b" * 64, None], ids=["wrong-token", "no-token"])
def test_unauthenticated_clients_are_refused(server: RolloutFlightServer, token: str | None) -> None:
    if token is None:  # a client that sends no authorization header at all
        raw = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(raw.do_action("ping"))
        # the refusal surfaces at do_put, write_batch or close, depending on timing
        with pytest.raises(flight.FlightUnauthenticatedError):
            writer, _ = raw.do_put(flight.FlightDescriptor.for_path(b"rollouts", b"x", b"0"),
                                   make_batch(0).record_batch.schema)
            writer.write_batch(make_batch(0).record_batch)
            writer.close()
        raw.close()
    with client_for(server, token=token) as client:
        with pytest.raises(flight.FlightUnauthenticatedError):
            client.ping()
        with pytest.raises(flight.FlightUnauthenticatedError):
            client.put(make_batch(1))
        with pytest.raises(flight.FlightUnauthenticatedError):
            client.stats()
    assert server.qsize() == 0
    assert server.stats()["received"] == 0


def test_backpressure_blocks_producer_without_loss() -> None:
    sent = [make_batch(i) for i in range(5)]
    with RolloutFlightServer(token=TOKEN, capacity=2) as srv, client_for(srv) as client:
        done: list[int] = []
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                for i, batch in enumerate(sent):
                    client.put(batch)
                    done.append(i)
            except BaseException as exc:  # surfaced in the main thread below
                errors.append(exc)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        deadline = time.monotonic() + 5
        while srv.stats()["waiting_puts"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # give a non-blocking implementation every chance to run ahead
        assert srv.qsize() == 2 and srv.stats()["waiting_puts"] == 1
        assert producer.is_alive() and len(done) == 2
        got = [srv.get(timeout=5) for _ in sent]
        producer.join(timeout=5)
        assert not producer.is_alive() and not errors and done == list(range(5))
        assert srv.qsize() == 0
    assert len(got) == 5 and checksum(got) == checksum(sent)
    assert [b.record_batch.equals(s.record_batch) for b, s in zip(got, sent, strict=True)] == [True] * 5


def test_duplicate_sequence_number_is_acknowledged_once(server: RolloutFlightServer) -> None:
    batch = make_batch(7)
    with client_for(server) as client:
        assert client.put_with_sequence(batch, 0) == "queued"
        assert client.put_with_sequence(batch, 0) == "duplicate"
        assert client.put_with_sequence(make_batch(8), 1) == "queued"
        stats = client.stats()
    assert server.qsize() == 2
    assert stats["received"] == 2 and stats["duplicates"] == 1 and stats["queued"] == 2


def test_retry_after_lost_ack_keeps_sequence_number(server: RolloutFlightServer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The put lands but the ack is 'lost': the retry reuses the number and is deduplicated."""
    client = client_for(server, backoff_s=0.01)
    real_put_once = client._put_once
    seqs: list[int] = []

    def flaky(batch: RolloutBatch, seq: int) -> str:
        seqs.append(seq)
        status = real_put_once(batch, seq)
        if len(seqs) == 1:
            raise flight.FlightUnavailableError("simulated connection drop after delivery")
        return status

    monkeypatch.setattr(client, "_put_once", flaky)
    client.put(make_batch(1))
    client.close()
    assert seqs == [0, 0]
    assert server.qsize() == 1 and server.stats()["duplicates"] == 1


def test_client_retries_until_a_late_server_comes_up() -> None:
    """Real FlightUnavailableError (nothing listening yet), same sequence number on retry."""
    with socket.socket() as probe:  # pick a free port, then free it for the server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = RolloutFlightClient(f"grpc://127.0.0.1:{port}", TOKEN, "late", retries=8, backoff_s=0.05)
    started: list[RolloutFlightServer] = []
    timer = threading.Timer(0.4, lambda: started.append(
        RolloutFlightServer(f"grpc://127.0.0.1:{port}", token=TOKEN, capacity=2)))
    timer.start()
    try:
        client.put(make_batch(5))
        timer.join()
        assert started[0].qsize() == 1 and started[0].stats()["received"] == 1
        assert client.next_sequence_no == 1
    finally:
        timer.join()
        client.close()
        for srv in started:
            srv.shutdown()


def test_put_timeout_under_backpressure_frees_the_server_handler() -> None:
    with RolloutFlightServer(token=TOKEN, capacity=1) as srv, \
            client_for(srv, put_timeout=0.5) as client:
        client.put(make_batch(0))
        with pytest.raises(flight.FlightTimedOutError):
            client.put(make_batch(1))
        deadline = time.monotonic() + 5  # the blocked handler notices the cancellation
        while srv.stats()["waiting_puts"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.stats()["waiting_puts"] == 0
        assert srv.get(timeout=1).record_batch.equals(make_batch(0).record_batch)
        client.put_with_sequence(make_batch(1), 1)  # the caller's retry after the timeout
        assert srv.get(timeout=1).record_batch.equals(make_batch(1).record_batch)
        assert srv.stats()["received"] == 2 and srv.qsize() == 0


def test_wrong_schema_is_rejected_naming_the_column(server: RolloutFlightServer) -> None:
    good = make_batch(3).record_batch
    bad = good.drop_columns(["response_ids"])
    with client_for(server) as client:
        with pytest.raises(flight.FlightServerError, match="response_ids"):
            client.put(RolloutBatch(bad, check=False))
        mistyped = good.set_column(good.schema.get_field_index("score"), "score",
                                   pa.array([1, 2, 3], pa.int64()))
        with pytest.raises(flight.FlightServerError, match="score"):
            client.put(RolloutBatch(mistyped, check=False))
    assert server.qsize() == 0
    assert server.stats()["rejected"] == 2


def test_shutdown_releases_blocked_producer_and_is_idempotent() -> None:
    srv = RolloutFlightServer(token=TOKEN, capacity=1)
    client = client_for(srv, retries=0)
    client.put(make_batch(0))
    errors: list[BaseException] = []
    producer = threading.Thread(target=lambda: _capture(errors, client.put, make_batch(1)), daemon=True)
    producer.start()
    while srv.stats()["waiting_puts"] < 1:
        time.sleep(0.02)
    srv.shutdown()
    srv.shutdown()
    producer.join(timeout=5)
    assert not producer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], flight.FlightUnavailableError)
    assert len(srv.get(timeout=1)) == 3  # what was queued before shutdown is still readable
    with pytest.raises(RuntimeError, match="shut down"):
        srv.get(timeout=1)
    client.close()


def _capture(errors: list[BaseException], fn: object, *args: object) -> None:
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as exc:
        errors.append(exc)


def test_get_timeout_names_wait_and_producers(server: RolloutFlightServer) -> None:
    with pytest.raises(TimeoutError, match=r"0\.2 s.*none"):
        server.get(timeout=0.2)
    with client_for(server, producer="rank3") as client:
        client.put(make_batch(0))
    server.get(timeout=1)
    with pytest.raises(TimeoutError, match="rank3"):
        server.get(timeout=0.1)


def test_concurrent_producers_arrive_exactly_once() -> None:
    producers, per_producer = 8, 10
    sent = {(p, i): make_batch(p * 1000 + i, rows=2) for p in range(producers) for i in range(per_producer)}
    with RolloutFlightServer(token=TOKEN, capacity=4) as srv:
        errors: list[BaseException] = []

        def produce(p: int) -> None:
            with client_for(srv, producer=f"worker-{p}") as client:
                for i in range(per_producer):
                    _capture(errors, client.put, sent[(p, i)])

        threads = [threading.Thread(target=produce, args=(p,), daemon=True) for p in range(producers)]
        for t in threads:
            t.start()
        got = [srv.get(timeout=10) for _ in range(len(sent))]
        for t in threads:
            t.join(timeout=5)
        assert not errors and srv.qsize() == 0
        assert srv.stats()["duplicates"] == 0 and srv.stats()["received"] == len(sent)
    arrival = [int(b.column("group_id")[0].as_py()) for b in got]
    assert sorted(arrival) == sorted(p * 1000 + i for p, i in sent)
    for p in range(producers):  # each producer's own batches keep their order
        mine = [tag % 1000 for tag in arrival if tag // 1000 == p]
        assert mine == list(range(per_producer))
    assert checksum(got) == checksum(list(sent.values()))


def test_secret_file_and_directory_modes(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # even a permissive umask must not widen the modes
    try:
        token = create_run_secret(tmp_path / "run")
    finally:
        os.umask(old_umask)
    path = secret_path(tmp_path / "run")
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert create_run_secret(tmp_path / "run") == token  # reused, not regenerated
    assert read_run_secret(tmp_path / "run") == token


def test_secret_with_loose_mode_is_refused(tmp_path: Path) -> None:
    create_run_secret(tmp_path)
    os.chmod(secret_path(tmp_path), 0o644)
    with pytest.raises(PermissionError, match="0644"):
        create_run_secret(tmp_path)
    with pytest.raises(PermissionError, match="0600"):
        read_run_secret(tmp_path)


def test_missing_secret_explains_itself(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="create_run_secret"):
        read_run_secret(tmp_path)


def test_a_batch_cut_into_chunks_arrives_whole_and_equal(server: RolloutFlightServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Large puts travel as several record batches (bench/transport.py); the trainer gets one, unchanged."""
    from verl_hpc.transport.rollouts import wire

    monkeypatch.setattr(wire, "PUT_CHUNK_BYTES", 256)
    sent = make_batch(7, rows=40)
    assert len(wire.chunks(sent.record_batch, 256)) > 1
    with client_for(server) as client:
        client.put(sent)
    got = server.get(timeout=10)
    assert got.record_batch.equals(sent.record_batch)
    assert server.stats()["received"] == 1

