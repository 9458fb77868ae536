"""The rollout stream (one `do_exchange` call per producer), on real loopback sockets.

What the stream must keep from one call per put: a broken stream is replaced and the
re-sent batch deduplicated, an idle one never holds the trainer's shutdown, malformed
messages are refused by name, and a batch received in pieces reads like a whole one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from tests.transport.test_flight import TOKEN, client_for, make_batch
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.transport.rollouts import RolloutFlightClient, RolloutFlightServer


@pytest.fixture
def server() -> Iterator[RolloutFlightServer]:
    with RolloutFlightServer(token=TOKEN, capacity=8) as srv:
        yield srv


def _wait_for(condition: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)
    return bool(condition())  # type: ignore[operator]


def test_puts_share_one_stream_until_the_client_closes(server: RolloutFlightServer) -> None:
    """The per-put gRPC call is gone: five puts, one do_exchange call, ended by close()."""
    with client_for(server, idle_close_s=0) as client:
        for i in range(5):
            client.put(make_batch(i))
        assert server.stats()["streams_opened"] == 1 and server.stats()["open_streams"] == 1
    assert _wait_for(lambda: server.stats()["open_streams"] == 0)
    assert [server.get(timeout=5).record_batch.equals(make_batch(i).record_batch) for i in range(5)] == [True] * 5


def test_idle_stream_closes_so_shutdown_does_not_wait_for_the_producer() -> None:
    """pyarrow's shutdown waits for open calls: an idle producer must not hold the trainer."""
    srv = RolloutFlightServer(token=TOKEN, capacity=4)
    client = client_for(srv, idle_close_s=0.2)
    try:
        client.put(make_batch(0))
        assert _wait_for(lambda: srv.stats()["open_streams"] == 0)
        client.put(make_batch(1))  # the same client simply opens a new stream
        assert srv.stats()["streams_opened"] == 2 and srv.qsize() == 2
        assert _wait_for(lambda: srv.stats()["open_streams"] == 0)
        stopper = threading.Thread(target=srv.shutdown, daemon=True)
        stopper.start()
        stopper.join(timeout=10)
        assert not stopper.is_alive()  # returned although the client was never closed
    finally:
        client.close()
        srv.shutdown()


def test_broken_stream_reconnects_and_the_resent_batch_is_deduplicated(
        server: RolloutFlightServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch lands, then the server fails the stream before acknowledging it."""
    from verl_hpc.transport.rollouts import wire

    real_encode_ack = wire.encode_ack
    acks: list[tuple[int, str]] = []

    def breaks_once(seq: int, status: str) -> pa.Buffer:
        acks.append((seq, status))
        if len(acks) == 1:
            raise flight.FlightUnavailableError("simulated: stream broke after the batch was buffered")
        return real_encode_ack(seq, status)

    monkeypatch.setattr(wire, "encode_ack", breaks_once)
    with client_for(server, backoff_s=0.01, idle_close_s=0) as client:
        client.put(make_batch(1))
        client.put(make_batch(2))
        assert client.next_sequence_no == 2
    assert acks == [(0, "queued"), (0, "duplicate"), (1, "queued")]
    stats = server.stats()
    assert stats["streams_opened"] == 2 and stats["duplicates"] == 1 and stats["received"] == 2
    got = [server.get(timeout=5) for _ in range(2)]
    assert [g.record_batch.equals(make_batch(t).record_batch) for g, t in zip(got, (1, 2), strict=True)] == [True] * 2


def test_open_stream_survives_a_trainer_restart_on_the_same_port() -> None:
    """The trainer stops while the producer's stream is open; the put retries onto the new server."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    first = RolloutFlightServer(f"grpc://127.0.0.1:{port}", token=TOKEN, capacity=4)
    client = RolloutFlightClient(f"grpc://127.0.0.1:{port}", TOKEN, "w0", retries=10, backoff_s=0.05,
                                 idle_close_s=0)
    restarted: list[RolloutFlightServer] = []

    def restart() -> None:
        first.shutdown()  # returns once the client has dropped its stream
        restarted.append(RolloutFlightServer(f"grpc://127.0.0.1:{port}", token=TOKEN, capacity=4))

    restarter = threading.Thread(target=restart, daemon=True)
    try:
        client.put(make_batch(0))
        assert first.stats()["open_streams"] == 1
        restarter.start()
        assert _wait_for(lambda: first.stats()["closed"])  # the put below must meet the stopping server
        client.put(make_batch(1))  # refused by the stopping server, then lands on the new one
        restarter.join(timeout=10)
        assert restarted and restarted[0].qsize() == 1
        assert restarted[0].get(timeout=5).record_batch.equals(make_batch(1).record_batch)
        assert first.get(timeout=1).record_batch.equals(make_batch(0).record_batch)
        assert client.next_sequence_no == 2
    finally:
        client.close()
        restarter.join(timeout=10)
        for srv in [first, *restarted]:
            srv.shutdown()


def test_stream_message_without_sequence_metadata_is_rejected(server: RolloutFlightServer) -> None:
    raw = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    writer, reader = raw.do_exchange(flight.FlightDescriptor.for_path(b"rollouts", b"w9"), options)
    batch = make_batch(0).record_batch
    writer.begin(batch.schema)
    writer.write_batch(batch)  # no app_metadata: no sequence number to deduplicate by
    with pytest.raises(flight.FlightServerError, match="app_metadata"):
        reader.read_chunk()
    with pytest.raises(flight.FlightServerError):
        writer.close()
    raw.close()
    assert server.qsize() == 0 and server.stats()["rejected"] == 1


def test_single_do_put_from_any_flight_client_is_still_accepted(server: RolloutFlightServer) -> None:
    """The one-call-per-batch form stays (non-Python producers); same dedup, JSON ack."""
    raw = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    batch = make_batch(4).record_batch
    acks = []
    for _ in range(2):
        writer, reader = raw.do_put(flight.FlightDescriptor.for_path(b"rollouts", b"java-0", b"0"),
                                    batch.schema, options)
        writer.write_batch(batch)
        writer.done_writing()
        acks.append(reader.read().to_pybytes())
        writer.close()
    raw.close()
    assert [b'"queued"' in a for a in acks] == [True, False] and b'"duplicate"' in acks[1]
    assert server.qsize() == 1 and server.get(timeout=5).record_batch.equals(batch)


def test_a_chunked_batch_reads_like_a_whole_one(server: RolloutFlightServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Received pieces stay pieces (no copy on receipt) but length, columns and concat are exact."""
    from verl_hpc.transport.rollouts import wire

    monkeypatch.setattr(wire, "PUT_CHUNK_BYTES", 256)
    sent = [make_batch(11, rows=30), make_batch(12, rows=25)]
    with client_for(server) as client:
        for batch in sent:
            client.put(batch)
    got = [server.get(timeout=10) for _ in sent]
    for want, have in zip(sent, got, strict=True):
        assert len(have) == len(want)
        assert have.column("response_ids").equals(want.column("response_ids"))
        assert np.array_equal(have.response_lengths(), want.response_lengths())
    joined = RolloutBatch.concat(got)
    assert joined.record_batch.equals(RolloutBatch.concat(sent).record_batch)
    assert RolloutBatch.from_ipc(got[0].to_ipc()).record_batch.equals(sent[0].record_batch)
