"""What travels on the rollout wire: descriptors, per-message metadata, schema checks.

Why apart from the Flight classes: these are pure functions of bytes and schemas, the
part both ends must agree on; keeping them here lets them be tested without sockets and
keeps the server and client files about sockets and threads only.

Two ways to send a batch, both keyed by (producer_id, sequence_no) for deduplication:
- one `do_put` per batch, descriptor `[b"rollouts", producer_id, sequence_no]`, JSON ack
  (any Flight client can speak it);
- one long-lived `do_exchange` stream per producer, descriptor `[b"rollouts",
  producer_id]`: each batch is one or more record batches whose app_metadata is
  `CHUNK_META` (sequence number, last-chunk flag), answered by one metadata-only message
  `ACK_META` (sequence number, status) once the batch is in the trainer's buffer.
"""

from __future__ import annotations

import hmac
import struct
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from verl_hpc.data.rollout_batch import RolloutBatch, SchemaError, schema_of, validate

DESCRIPTOR_ROOT = b"rollouts"
# Why ~4 MB record batches: one huge gRPC message is copied and flow-controlled as a unit
# (about 1 GB/s on loopback here), while a stream of 4 MB messages pipelines sender, wire
# and receiver (2-4x faster for 64 MB+; bench/transport.py).
PUT_CHUNK_BYTES = 4 << 20
CHUNK_META = struct.Struct("<QB")  # sequence_no, 1 on the batch's last chunk
ACK_META = struct.Struct("<QB")  # sequence_no, index into ACK_STATUSES
ACK_STATUSES = ("queued", "duplicate")


def _path(descriptor: flight.FlightDescriptor, size: int, shape: str) -> list[bytes]:
    path = list(descriptor.path or [])
    if len(path) != size or path[0] != DESCRIPTOR_ROOT:
        raise flight.FlightServerError(f"rollout transport: descriptor path must be {shape}, got {path!r}")
    return path


def _producer(raw: bytes, path: list[bytes]) -> str:
    try:
        producer = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise flight.FlightServerError(f"rollout transport: producer id is not UTF-8 in {path!r}") from None
    if not producer:
        raise flight.FlightServerError(f"rollout transport: empty producer id in {path!r}")
    return producer


def parse_put_descriptor(descriptor: flight.FlightDescriptor) -> tuple[str, int]:
    """`[b"rollouts", producer_id, sequence_no]` -> (producer_id, sequence_no)."""
    path = _path(descriptor, 3, "[b'rollouts', producer_id, sequence_no]")
    producer = _producer(path[1], path)
    try:
        seq = int(path[2])
    except ValueError:
        raise flight.FlightServerError(f"rollout put: bad sequence number in {path!r}") from None
    if seq < 0:
        raise flight.FlightServerError(f"rollout put: negative sequence number in {path!r}")
    return producer, seq


def parse_stream_descriptor(descriptor: flight.FlightDescriptor) -> str:
    """`[b"rollouts", producer_id]` -> producer_id."""
    path = _path(descriptor, 2, "[b'rollouts', producer_id] for a rollout stream")
    return _producer(path[1], path)


def schema_problem(schema: pa.Schema) -> str | None:
    """Name the first column that is missing, mistyped or unexpected; None if all fit.

    Two layouts travel: single-turn rows (SCHEMA) and agent episodes (TRAJECTORY_SCHEMA, the
    same columns and four more); a batch carrying any trajectory column must carry them all.
    """
    expected = schema_of(schema)
    for field in expected:
        if field.name not in schema.names:
            return f"column {field.name!r} is missing"
        got = schema.field(field.name).type
        if got != field.type:
            return f"column {field.name!r} has type {got}, expected {field.type}"
    extra = [name for name in schema.names if name not in expected.names]
    return f"unexpected column(s) {extra!r}" if extra else None


def check_schema(schema: pa.Schema, where: str) -> None:
    """Raise FlightServerError naming the first bad column (checked before any data is read)."""
    problem = schema_problem(schema)
    if problem:
        raise flight.FlightServerError(f"{where} rejected: {problem}")


def assemble(chunks: list[pa.RecordBatch], where: str) -> RolloutBatch:
    """The received record batches of one put -> one validated batch laid out exactly as its
    schema (SCHEMA, or TRAJECTORY_SCHEMA for agent episodes).

    Why the chunks are validated one by one and not concatenated: every check is per
    row, so it holds for the whole iff it holds for each chunk, and the trainer joins
    them together with the other generators' batches anyway (`RolloutBatch.concat`).
    """
    chunks = [chunk for chunk in chunks if chunk.num_rows]
    if not chunks:
        raise flight.FlightServerError(f"{where} rejected: the put carried no rows")
    expected = schema_of(chunks[0].schema)
    if not chunks[0].schema.equals(expected):  # column order or nullability flags differ (zero-copy fix)
        chunks = [pa.RecordBatch.from_arrays([c.column(f.name) for f in expected], schema=expected) for c in chunks]
    try:
        for chunk in chunks:
            validate(chunk)
    except SchemaError as exc:
        raise flight.FlightServerError(f"{where} rejected: {exc}") from None
    return RolloutBatch.from_chunks(chunks, check=False)


class EncodedBatch:
    """One received batch still as its IPC message: decoded and checked when the trainer takes it.

    Why not decoded on arrival: the same-node route acknowledges a put once its bytes are
    buffered, and across processes on a busy node the decode and the row checks cost more
    than the bytes (64 KB: ~60 µs of a ~145 µs put; docs/benchmarks.md, "Decoded when
    taken"). Moved to the trainer's `get`, they run off the producer's path, in the thread
    that reads the batch next anyway. The schema is still checked per connection before
    any batch is accepted; a batch that fails the row checks here (only a sender that
    bypasses `RolloutBatch`'s own validation can make one) is dropped and counted.
    """

    __slots__ = ("body", "schema", "where")

    def __init__(self, body: Any, schema: pa.Schema, where: str) -> None:
        self.body, self.schema, self.where = body, schema, where

    def decode(self) -> RolloutBatch:
        """The checked batch, owning `body` (no copy); FlightServerError names what is wrong."""
        try:
            message = pa.ipc.read_message(pa.py_buffer(self.body))
            record_batch = pa.ipc.read_record_batch(message, self.schema)
        except (pa.ArrowException, ValueError, OSError, EOFError) as exc:  # what pyarrow raises on bad bytes
            raise flight.FlightServerError(f"{self.where} rejected: not a record batch message ({exc})") from None
        return assemble([record_batch], self.where)


def chunks(record_batch: pa.RecordBatch, max_bytes: int) -> list[pa.RecordBatch]:
    """Zero-copy row slices of about `max_bytes` each (the whole batch when it is smaller)."""
    rows = record_batch.num_rows
    # get_total_buffer_size is O(columns); nbytes walks offsets to size slices exactly (~25 µs)
    if rows <= 1 or record_batch.get_total_buffer_size() <= max_bytes:
        return [record_batch]
    nbytes = record_batch.nbytes
    if nbytes <= max_bytes:
        return [record_batch]
    step = max(1, rows * max_bytes // nbytes)
    return [record_batch.slice(start, step) for start in range(0, rows, step)]


def decode_chunk_meta(metadata: pa.Buffer | None, where: str) -> tuple[int, bool]:
    """A data message's app_metadata -> (sequence_no, is_last_chunk)."""
    if metadata is None or metadata.size != CHUNK_META.size:
        size = "none" if metadata is None else f"{metadata.size} bytes"
        raise flight.FlightServerError(f"{where}: every record batch needs {CHUNK_META.size} bytes of "
                                       f"app_metadata (sequence_no, last flag), got {size}; "
                                       f"send with RolloutFlightClient")
    seq, last = CHUNK_META.unpack(metadata.to_pybytes())
    return seq, bool(last)


def encode_ack(seq: int, status: str) -> pa.Buffer:
    return pa.py_buffer(ACK_META.pack(seq, ACK_STATUSES.index(status)))


def decode_ack(metadata: pa.Buffer | None, expected_seq: int) -> str:
    """The server's acknowledgement -> "queued" or "duplicate"; raises on a garbled or stray ack."""
    if metadata is None or metadata.size != ACK_META.size:
        raise flight.FlightServerError(f"rollout stream: malformed acknowledgement {metadata!r}")
    seq, status = ACK_META.unpack(metadata.to_pybytes())
    if seq != expected_seq or status >= len(ACK_STATUSES):
        raise flight.FlightServerError(f"rollout stream: acknowledgement for #{seq} (status {status}) "
                                       f"while waiting for #{expected_seq}")
    return ACK_STATUSES[status]


AUTH_HEADER = "authorization"


class BearerTokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Refuse every RPC that lacks `authorization: Bearer <run token>`.

    Why middleware rather than Flight's handshake auth: the handshake hands out a
    session token that later calls must carry anyway; a static per-run bearer token
    checked on each call is simpler, stateless, and covers every method uniformly.
    """

    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str | bytes]]) -> None:
        values = [v for k, vs in headers.items() if k.lower() == AUTH_HEADER for v in vs]
        raw = values[0] if len(values) == 1 else b""
        presented = raw.encode() if isinstance(raw, str) else raw
        # compare_digest: the time taken must not reveal how many leading bytes matched
        if not hmac.compare_digest(presented, self._expected):
            raise flight.FlightUnauthenticatedError(
                "rollout transport: missing or wrong bearer token (the token is in "
                "<run_dir>/secrets/flight_token)")
        return None
