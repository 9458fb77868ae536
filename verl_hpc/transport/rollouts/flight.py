"""Rollout transport over Arrow Flight: workers push record batches, the trainer pulls.

Why Flight: rollouts already are Arrow record batches (SCHEMA), and Flight moves them
over gRPC as Arrow IPC — no pickling, no per-row framing, and the trainer receives
buffers it can hand to numpy/torch directly. Why push rather than pull: the trainer
does not need to know where workers run; workers only need one address and the run's
token (see `secret.py`). The client keeps one `do_exchange` stream per producer open
while it is busy (`stream.py`); the server also takes single `do_put`s (`wire.py`).

Delivery contract (what makes retries and restarts safe):
- every batch carries (producer_id, sequence_no): in a put's descriptor, or in the
  app_metadata of its messages on a stream;
- the server keeps the set of (producer_id, sequence_no) it has enqueued and answers a
  repeat with an acknowledgement but no second enqueue — at-most-once into the buffer,
  at-least-once on the wire, i.e. exactly-once overall as long as a producer retries
  (on a new stream, if the old one broke);
- the acknowledgement is sent only once the batch is in the buffer; the buffer is
  bounded: when it holds `capacity` batches a put blocks until the trainer takes one,
  so fast generation cannot exhaust trainer memory.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.flight as flight

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.transport.rollouts import wire
from verl_hpc.transport.rollouts.base import RolloutReceiver, RolloutSender
from verl_hpc.transport.rollouts.buffer import RolloutBuffer
from verl_hpc.transport.rollouts.local import LocalRolloutServer, LocalRoute, enabled, reachable_path
from verl_hpc.transport.rollouts.stream import IdleCloser, ProducerStream

log = logging.getLogger(__name__)


class RolloutFlightServer(flight.FlightServerBase, RolloutReceiver):
    """Trainer-side Flight endpoint plus the in-process consumer API (`get`, `qsize`).

    Lifecycle: pyarrow starts listening (on gRPC's own threads) as soon as the object
    exists, so there is no serve thread to manage; `shutdown()` — idempotent, also
    run by the context manager — first releases producers blocked on a full buffer
    (they would otherwise keep gRPC's shutdown waiting forever), then stops gRPC, which
    waits for open producer streams: clients close theirs after `idle_close_s` without
    puts, so an idle producer delays a shutdown by at most about that long.
    """

    def __init__(self, location: str = "grpc://127.0.0.1:0", *, token: str, capacity: int = 8,
                 local: bool = False) -> None:
        if not token:
            raise ValueError("RolloutFlightServer needs a non-empty token (see create_run_secret)")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._buffer = RolloutBuffer(capacity)
        self._host = urlparse(location).hostname or "127.0.0.1"
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._stream_lock = threading.Lock()
        self._streams = {"opened": 0, "open": 0}
        super().__init__(location, middleware={"auth": wire.BearerTokenMiddlewareFactory(token)})
        # Same-node producers skip gRPC (local.py); same buffer, so the same contract.
        self._local = LocalRolloutServer(self._buffer, token) if local and enabled() else None
        log.info("rollout Flight server listening on %s (capacity %d)", self.location, capacity)

    @property
    def location(self) -> str:
        """The address workers should connect to (wildcard binds -> this host's name)."""
        host = socket.gethostname() if self._host in ("0.0.0.0", "::") else self._host
        return f"grpc://[{host}]:{self.port}" if ":" in host else f"grpc://{host}:{self.port}"

    @property
    def local_location(self) -> str | None:
        """`unix://host/path` for producers on this node (`local=True`), else None."""
        return self._local.location if self._local is not None else None

    def do_put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader, writer: flight.FlightMetadataWriter) -> None:
        """One batch per call: validate, enqueue (blocking while full), JSON ack queued/duplicate."""
        try:
            producer, seq = wire.parse_put_descriptor(descriptor)
            where = f"rollout put from {producer!r} #{seq}"
            wire.check_schema(reader.schema, where)  # before reading: no point receiving a batch we reject
            batch = wire.assemble(reader.read_all().to_batches(), where)
        except flight.FlightServerError:
            self._buffer.reject()
            raise
        status = self._buffer.offer((producer, seq), batch, context.is_cancelled)
        writer.write(pa.py_buffer(json.dumps({"status": status, "sequence_no": seq}).encode()))

    def do_exchange(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
                    reader: flight.MetadataRecordBatchReader, writer: flight.MetadataRecordBatchWriter) -> None:
        """A producer's stream: batches in, one ack each once buffered, until the producer ends it.

        Any rejection fails the whole call (the client then opens a new stream), so a
        half-received batch can never be mistaken for the start of the next one.
        """
        with self._stream_lock:
            self._streams["opened"] += 1
            self._streams["open"] += 1
        try:
            try:
                producer = wire.parse_stream_descriptor(descriptor)
                wire.check_schema(reader.schema, f"rollout stream from {producer!r}")
            except flight.FlightServerError:
                self._buffer.reject()
                raise
            while (received := self._receive_batch(reader, producer)) is not None:
                seq, batch = received
                status = self._buffer.offer((producer, seq), batch, context.is_cancelled)
                writer.write_metadata(wire.encode_ack(seq, status))
        finally:
            with self._stream_lock:
                self._streams["open"] -= 1

    def _receive_batch(self, reader: flight.MetadataRecordBatchReader,
                       producer: str) -> tuple[int, RolloutBatch] | None:
        """Read messages up to one batch's last chunk; None when the producer closed the stream."""
        pending: list[pa.RecordBatch] = []
        pending_seq = -1
        try:
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:  # closed between batches (idle, or done); mid-batch: dropped
                    return None
                where = f"rollout put from {producer!r}"
                seq, last = wire.decode_chunk_meta(chunk.app_metadata, where)
                where = f"{where} #{seq}"
                if chunk.data is None:
                    raise flight.FlightServerError(f"{where}: a message without a record batch")
                if pending and seq != pending_seq:
                    raise flight.FlightServerError(f"{where}: started before #{pending_seq} was complete")
                pending.append(chunk.data)
                pending_seq = seq
                if last:
                    return seq, wire.assemble(pending, where)
        except flight.FlightServerError:
            self._buffer.reject()
            raise

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterable[bytes]:
        """Health and counters for workers and operators, behind the same token as puts."""
        if action.type == "ping":
            return [b"pong"]
        if action.type == "stats":
            return [json.dumps(self.stats()).encode()]
        raise flight.FlightServerError(f"unknown action {action.type!r}; known: ping, stats")

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return [("ping", "liveness check; returns b'pong'"),
                ("stats", "JSON counters: received, duplicates, queued, consumed, rejected, streams")]

    def get(self, timeout: float | None = None) -> RolloutBatch:
        """Next batch in arrival order; TimeoutError after `timeout` s (None: wait forever)."""
        return self._buffer.get(timeout)

    def qsize(self) -> int:
        return self._buffer.qsize()

    def stats(self) -> dict[str, Any]:
        with self._stream_lock:
            streams = {"streams_opened": self._streams["opened"], "open_streams": self._streams["open"]}
        local = self._local.stats() if self._local is not None else {}
        return {**self._buffer.stats(), **streams, **local}

    def shutdown(self) -> None:
        """Stop accepting puts, unblock waiting producers, stop gRPC. Safe to call twice.

        Batches already queued stay readable through `get` until the buffer is empty.
        """
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._buffer.close()
        if self._local is not None:
            self._local.shutdown()
        super().shutdown()

    def __enter__(self) -> RolloutFlightServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


class RolloutFlightClient(RolloutSender):
    """Worker-side pusher: numbered, authenticated, retried puts to one trainer.

    Why the client numbers puts: the server's dedup key is (producer_id, sequence_no),
    so a put retried after a lost acknowledgement lands once. A producer_id must be
    unique per live producer (e.g. f"{job_id}-rank{rank}"); a restarted producer that
    reuses its id must continue its numbering, or its first puts count as duplicates.

    Batches travel on one `do_exchange` stream (`stream.py`), opened on the first put and
    closed after `idle_close_s` without puts (0: only by `close()`); a broken stream is
    replaced by a new one on the next attempt. Given the server's `local_location` and on
    its node, batches take the Unix socket instead (`local.py`), with the same retries.
    """

    def __init__(self, location: str, token: str, producer_id: str, *, put_timeout: float | None = None,
                 rpc_timeout: float = 10.0, retries: int = 4, backoff_s: float = 0.25,
                 idle_close_s: float = 0.5, local_location: str | None = None) -> None:
        if not producer_id:
            raise ValueError("producer_id must be non-empty")
        if idle_close_s < 0:
            raise ValueError(f"idle_close_s must be >= 0, got {idle_close_s}")
        self.producer_id = producer_id
        self.next_sequence_no = 0
        self._client = flight.FlightClient(location)
        self._auth = [(wire.AUTH_HEADER.encode(), f"Bearer {token}".encode())]
        self._put_timeout, self._rpc_timeout = put_timeout, rpc_timeout
        self._retries, self._backoff_s = retries, backoff_s
        self._lock = threading.Lock()  # one put at a time keeps this producer's order
        self._closed = False
        self._stream: ProducerStream | None = None
        self._last_used = 0.0
        self._idle_close_s = idle_close_s
        self._idle_closer: IdleCloser | None = None
        path = reachable_path(local_location)
        self._local = LocalRoute(path, token, producer_id) if path else None

    @property
    def same_node(self) -> bool:
        """Whether puts take the Unix socket (the trainer is on this node)."""
        return self._local is not None and self._local.path is not None

    def _options(self, timeout: float | None) -> flight.FlightCallOptions:
        return flight.FlightCallOptions(headers=self._auth, timeout=timeout)

    def put(self, batch: RolloutBatch) -> None:
        """Send `batch` with the next sequence number; blocks while the trainer's buffer is full.

        Retries only FlightUnavailableError (trainer not up yet, restarting, connection
        dropped). A FlightTimedOutError (`put_timeout` passed while the buffer stayed
        full) is raised to the caller: waiting longer is a policy decision, not a fault.

        The number is consumed even if the put finally fails: the batch may have landed
        before the error, and reusing the number for a different batch would then drop
        that batch as a "duplicate". To retry the same batch use `put_with_sequence`.
        """
        with self._lock:
            seq = self.next_sequence_no
            self.next_sequence_no += 1
            self._put_with_retries(batch, seq)

    def put_with_sequence(self, batch: RolloutBatch, sequence_no: int) -> str:
        """Send under an explicit number; returns the ack ("queued" or "duplicate")."""
        with self._lock:
            return self._put_with_retries(batch, sequence_no)

    def _put_with_retries(self, batch: RolloutBatch, seq: int) -> str:
        if self._closed:
            raise RuntimeError(f"rollout client {self.producer_id!r} is closed")
        for attempt in range(self._retries + 1):
            try:
                return self._put_once(batch, seq)
            except flight.FlightUnavailableError as exc:
                if attempt == self._retries:
                    raise
                delay = self._backoff_s * 2 ** attempt
                log.warning("rollout put %s #%d: trainer unavailable (%s); retry in %.2f s",
                            self.producer_id, seq, str(exc).split(". gRPC client debug")[0], delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _put_once(self, batch: RolloutBatch, seq: int) -> str:
        """One attempt on the open stream (opened here if needed); any failure drops the stream."""
        record_batch = batch.record_batch
        if self.same_node:
            return self._local.put(record_batch, seq, self._put_timeout)  # type: ignore[union-attr]
        stream = self._open_stream(record_batch.schema)
        timer = None
        if self._put_timeout is not None:  # a stream has no per-message deadline: cancel it instead
            timer = threading.Timer(self._put_timeout, stream.cancel)
            timer.daemon = True
            timer.start()
        try:
            status = stream.send(record_batch, seq)
        except (flight.FlightError, OSError, pa.ArrowException):
            self._drop_stream()
            if stream.cancelled:
                raise flight.FlightTimedOutError(
                    f"rollout put {self.producer_id} #{seq}: not acknowledged within put_timeout="
                    f"{self._put_timeout:g} s (the trainer's buffer stayed full)") from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if stream.cancelled:  # the timer fired right after the ack: the stream is spent
            self._drop_stream()
        self._last_used = time.monotonic()
        return status

    def _open_stream(self, schema: pa.Schema) -> ProducerStream:
        if self._stream is not None and not (self._stream.schema is schema or self._stream.schema.equals(schema)):
            self._drop_stream()
        if self._stream is None:
            self._stream = ProducerStream(self._client, self.producer_id, schema, self._options(None))
            self._last_used = time.monotonic()
            if self._idle_closer is None and self._idle_close_s > 0:
                self._idle_closer = IdleCloser(self._idle_close_s, self._close_if_idle,
                                               f"rollout-stream-idle-{self.producer_id}")
        return self._stream

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _close_if_idle(self, idle_s: float) -> None:
        """Called by the idle closer; a put in progress (lock held) is never interrupted.

        The stream is detached under the lock but closed outside it, so a slow close (a
        dead connection) cannot hold up the next put, which simply opens a new stream.
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            idle = self._stream is not None and time.monotonic() - self._last_used >= idle_s
            stream, self._stream = (self._stream, None) if idle else (None, self._stream)
        finally:
            self._lock.release()
        if stream is not None:
            stream.close()

    def ping(self) -> float:
        """Round-trip seconds of an authenticated no-op; raises if refused or unreachable."""
        start = time.monotonic()
        results = [r.body.to_pybytes() for r in self._client.do_action("ping", self._options(self._rpc_timeout))]
        if results != [b"pong"]:
            raise flight.FlightServerError(f"unexpected ping reply {results!r}")
        return time.monotonic() - start

    def stats(self) -> dict[str, Any]:
        """The server's counters (see RolloutFlightServer.stats)."""
        results = list(self._client.do_action("stats", self._options(self._rpc_timeout)))
        return json.loads(results[0].body.to_pybytes())

    def close(self) -> None:
        """End the stream (the server's handler returns) and the connection. Safe to call twice.

        Does not wait for a put blocked in another thread: closing the connection fails it.
        """
        if self._closed:
            return
        self._closed = True
        if self._idle_closer is not None:
            self._idle_closer.stop()
        if self._lock.acquire(blocking=False):
            try:
                self._drop_stream()
                if self._local is not None:
                    self._local.close()
            finally:
                self._lock.release()
        self._client.close()

    def __enter__(self) -> RolloutFlightClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
