"""Rollout transport over Arrow Flight: workers push record batches, the trainer pulls.

Why Flight: rollouts already are Arrow record batches (SCHEMA), and Flight moves them
over gRPC as Arrow IPC — no pickling, no per-row framing, and the trainer receives
buffers it can hand to numpy/torch directly. Why push (do_put) rather than pull: the
trainer does not need to know where workers run; workers only need one address and
the run's token (see `secret.py`).

Delivery contract (what makes retries and restarts safe):
- every put carries the descriptor path `[b"rollouts", producer_id, sequence_no]`;
- the server keeps the set of (producer_id, sequence_no) it has enqueued and answers a
  repeat with an acknowledgement but no second enqueue — at-most-once into the buffer,
  at-least-once on the wire, i.e. exactly-once overall as long as a producer retries;
- the buffer is bounded: when it holds `capacity` batches a put blocks until the
  trainer takes one, so fast generation cannot exhaust trainer memory.
"""

from __future__ import annotations

import hmac
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

from verl_hpc.data.rollout_batch import SCHEMA, RolloutBatch, SchemaError, validate
from verl_hpc.data.transport.buffer import RolloutBuffer

log = logging.getLogger(__name__)

DESCRIPTOR_ROOT = b"rollouts"
_AUTH_HEADER = "authorization"
# Why puts are cut into ~4 MB record batches: one huge gRPC message is copied and
# flow-controlled as a unit (about 1 GB/s on loopback here), while a stream of 4 MB
# messages pipelines sender, wire and receiver (2-4x faster for 64 MB+; bench/transport.py).
PUT_CHUNK_BYTES = 4 << 20


class _BearerTokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Refuse every RPC that lacks `authorization: Bearer <run token>`.

    Why middleware rather than Flight's handshake auth: the handshake hands out a
    session token that later calls must carry anyway; a static per-run bearer token
    checked on each call is simpler, stateless, and covers every method uniformly.
    """

    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str | bytes]]) -> None:
        values = [v for k, vs in headers.items() if k.lower() == _AUTH_HEADER for v in vs]
        raw = values[0] if len(values) == 1 else b""
        presented = raw.encode() if isinstance(raw, str) else raw
        # compare_digest: the time taken must not reveal how many leading bytes matched
        if not hmac.compare_digest(presented, self._expected):
            raise flight.FlightUnauthenticatedError(
                "rollout transport: missing or wrong bearer token (the token is in "
                "<run_dir>/secrets/flight_token)")
        return None


def _parse_descriptor(descriptor: flight.FlightDescriptor) -> tuple[str, int]:
    """`[b"rollouts", producer_id, sequence_no]` -> (producer_id, sequence_no)."""
    path = list(descriptor.path or [])
    if len(path) != 3 or path[0] != DESCRIPTOR_ROOT:
        raise flight.FlightServerError(f"rollout put: descriptor path must be [b'rollouts', producer_id, "
                                       f"sequence_no], got {path!r}")
    try:
        producer, seq = path[1].decode("utf-8"), int(path[2])
    except (UnicodeDecodeError, ValueError):
        raise flight.FlightServerError(f"rollout put: bad producer id or sequence number in {path!r}") from None
    if not producer or seq < 0:
        raise flight.FlightServerError(f"rollout put: empty producer id or negative sequence in {path!r}")
    return producer, seq


def _schema_problem(schema: pa.Schema) -> str | None:
    """Name the first column that is missing, mistyped or unexpected; None if all fit."""
    for field in SCHEMA:
        if field.name not in schema.names:
            return f"column {field.name!r} is missing"
        got = schema.field(field.name).type
        if got != field.type:
            return f"column {field.name!r} has type {got}, expected {field.type}"
    extra = [name for name in schema.names if name not in SCHEMA.names]
    return f"unexpected column(s) {extra!r}" if extra else None


def _read_batch(reader: flight.MetadataRecordBatchReader, where: str) -> RolloutBatch:
    """Read the whole put stream into one validated batch laid out exactly as SCHEMA."""
    problem = _schema_problem(reader.schema)
    if problem:  # checked before reading the data: no point receiving a batch we reject
        raise flight.FlightServerError(f"{where} rejected: {problem}")
    batches = reader.read_all().to_batches()
    if not batches or sum(b.num_rows for b in batches) == 0:
        raise flight.FlightServerError(f"{where} rejected: the put carried no rows")
    record_batch = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
    if not record_batch.schema.equals(SCHEMA):  # column order or nullability flags differ
        record_batch = pa.RecordBatch.from_arrays([record_batch.column(f.name) for f in SCHEMA],
                                                  schema=SCHEMA)
    try:
        validate(record_batch)
    except SchemaError as exc:
        raise flight.FlightServerError(f"{where} rejected: {exc}") from None
    return RolloutBatch(record_batch, check=False)


def _chunks(record_batch: pa.RecordBatch, max_bytes: int) -> list[pa.RecordBatch]:
    """Zero-copy row slices of about `max_bytes` each (the whole batch when it is smaller)."""
    nbytes, rows = record_batch.nbytes, record_batch.num_rows
    if nbytes <= max_bytes or rows <= 1:
        return [record_batch]
    step = max(1, rows * max_bytes // nbytes)
    return [record_batch.slice(start, step) for start in range(0, rows, step)]


class RolloutFlightServer(flight.FlightServerBase):
    """Trainer-side Flight endpoint plus the in-process consumer API (`get`, `qsize`).

    Lifecycle: pyarrow starts listening (on gRPC's own threads) as soon as the object
    exists, so there is no serve thread to manage; `shutdown()` — idempotent, also
    run by the context manager — first releases producers blocked on a full buffer
    (they would otherwise keep gRPC's shutdown waiting forever), then stops gRPC.
    """

    def __init__(self, location: str = "grpc://127.0.0.1:0", *, token: str, capacity: int = 8) -> None:
        if not token:
            raise ValueError("RolloutFlightServer needs a non-empty token (see create_run_secret)")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._buffer = RolloutBuffer(capacity)
        self._host = urlparse(location).hostname or "127.0.0.1"
        self._stop_lock = threading.Lock()
        self._stopped = False
        super().__init__(location, middleware={"auth": _BearerTokenMiddlewareFactory(token)})
        log.info("rollout Flight server listening on %s (capacity %d)", self.location, capacity)

    @property
    def location(self) -> str:
        """The address workers should connect to (wildcard binds -> this host's name)."""
        host = socket.gethostname() if self._host in ("0.0.0.0", "::") else self._host
        return f"grpc://[{host}]:{self.port}" if ":" in host else f"grpc://{host}:{self.port}"

    def do_put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader, writer: flight.FlightMetadataWriter) -> None:
        """Validate, then enqueue (blocking while full); the ack tells queued from duplicate."""
        try:
            producer, seq = _parse_descriptor(descriptor)
            batch = _read_batch(reader, f"rollout put from {producer!r} #{seq}")
        except flight.FlightServerError:
            self._buffer.reject()
            raise
        status = self._buffer.offer((producer, seq), batch, context.is_cancelled)
        writer.write(pa.py_buffer(json.dumps({"status": status, "sequence_no": seq}).encode()))

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterable[bytes]:
        """Health and counters for workers and operators, behind the same token as puts."""
        if action.type == "ping":
            return [b"pong"]
        if action.type == "stats":
            return [json.dumps(self.stats()).encode()]
        raise flight.FlightServerError(f"unknown action {action.type!r}; known: ping, stats")

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return [("ping", "liveness check; returns b'pong'"),
                ("stats", "JSON counters: received, duplicates, queued, consumed, rejected")]

    def get(self, timeout: float | None = None) -> RolloutBatch:
        """Next batch in arrival order; TimeoutError after `timeout` s (None: wait forever)."""
        return self._buffer.get(timeout)

    def qsize(self) -> int:
        return self._buffer.qsize()

    def stats(self) -> dict[str, Any]:
        return self._buffer.stats()

    def shutdown(self) -> None:
        """Stop accepting puts, unblock waiting producers, stop gRPC. Safe to call twice.

        Batches already queued stay readable through `get` until the buffer is empty.
        """
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._buffer.close()
        super().shutdown()

    def __enter__(self) -> RolloutFlightServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


class RolloutFlightClient:
    """Worker-side pusher: numbered, authenticated, retried puts to one trainer.

    Why the client numbers puts: the server's dedup key is (producer_id, sequence_no),
    so a put retried after a lost acknowledgement lands once. A producer_id must be
    unique per live producer (e.g. f"{job_id}-rank{rank}"); a restarted producer that
    reuses its id must continue its numbering, or its first puts count as duplicates.
    """

    def __init__(self, location: str, token: str, producer_id: str, *, put_timeout: float | None = None,
                 rpc_timeout: float = 10.0, retries: int = 4, backoff_s: float = 0.25) -> None:
        if not producer_id:
            raise ValueError("producer_id must be non-empty")
        self.producer_id = producer_id
        self.next_sequence_no = 0
        self._client = flight.FlightClient(location)
        self._auth = [(_AUTH_HEADER.encode(), f"Bearer {token}".encode())]
        self._put_timeout, self._rpc_timeout = put_timeout, rpc_timeout
        self._retries, self._backoff_s = retries, backoff_s
        self._lock = threading.Lock()  # one put at a time keeps this producer's order
        self._closed = False

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
        descriptor = flight.FlightDescriptor.for_path(DESCRIPTOR_ROOT, self.producer_id.encode(),
                                                      str(seq).encode())
        record_batch = batch.record_batch
        writer, reader = self._client.do_put(descriptor, record_batch.schema, self._options(self._put_timeout))
        try:
            for chunk in _chunks(record_batch, PUT_CHUNK_BYTES):
                writer.write_batch(chunk)
            writer.done_writing()
            ack = reader.read()  # None when the server failed the call; close() raises why
        finally:
            writer.close()
        return json.loads(ack.to_pybytes())["status"] if ack is not None else "unknown"

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
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> RolloutFlightClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
