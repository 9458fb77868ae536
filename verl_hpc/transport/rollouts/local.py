"""Same-node rollouts over a Unix socket: the bytes at memory speed, the contract unchanged.

Why: on one node, Flight's gRPC costs more than the bytes. Each message pays HTTP/2
framing, hand-offs between gRPC's and Python's threads, and a receive-side join of the
slices into one buffer (docs/benchmarks.md, rollout transport).
A producer whose trainer endpoint is on its own node therefore sends the same Arrow IPC
messages over a Unix socket in a private (0700) directory instead. Flight stays for
other nodes.

What does not change (same tests, `tests/transport/test_transport_local.py`):
- the run's secret: the first message of a connection carries it, compared in constant time;
- the schema check, once per connection, before any of its batches is enqueued;
- the server's `RolloutBuffer`: dedup by (producer, sequence), blocking when full, ack
  only once buffered;
- the client's numbering, retries on a broken connection (same number: a duplicate is
  acknowledged, never enqueued twice), and `put_timeout` as a `FlightTimedOutError`.

The wire (a hello, then one frame per IPC message, each batch acknowledged) is in
`frames.py`. Large batches leave the sender without a copy: the IPC writer's buffers go
to one `sendmsg`. The receiver reads each batch into fresh memory that the batch then
owns, and buffers it still encoded: the trainer's `get` decodes it and checks its rows
(`wire.EncodedBatch`), so a put waits for neither. The row checks are the same;
a batch failing them (which `RolloutBatch` itself never lets a producer build) is
dropped at `get` and counted as rejected instead of refused at its put.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import select
import shutil
import socket
import struct
import threading
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.flight as flight

from verl_hpc.transport.rollouts import frames, socket_dir, wire
from verl_hpc.transport.rollouts.buffer import RolloutBuffer

log = logging.getLogger(__name__)

DISABLE_ENV = "VERL_HPC_ROLLOUT_LOCAL"  # "0": producers use Flight even on the trainer's node
_COPY_BELOW = 256 << 10            # smaller batches: one serialise (~10 us) beats ~60 buffer handoffs
_SEND_BUFFER = 4 << 20


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def local_location(path: str) -> str:
    """`unix://<this host><socket path>`: a producer uses it only on the same host."""
    return f"unix://{socket.gethostname()}{path}"


def reachable_path(location: str | None) -> str | None:
    """The socket path of `location` when it is on this host and exists; else None (use Flight)."""
    if not location or not enabled():
        return None
    parsed = urlparse(location)
    if parsed.scheme != "unix" or parsed.hostname != socket.gethostname().lower() or not parsed.path:
        return None
    return parsed.path if os.path.exists(parsed.path) else None


class LocalRolloutServer:
    """Unix-socket listener feeding a Flight server's `RolloutBuffer` (one thread per producer)."""

    def __init__(self, buffer: RolloutBuffer, token: str) -> None:
        self._buffer, self._expected = buffer, token.encode()
        for stale in socket_dir.sweep_stale():
            log.info("removed %s: its trainer was killed before it could (no listener)", stale)
        self._dir = socket_dir.make_private_dir()
        self.path = os.path.join(self._dir, socket_dir.SOCKET_NAME)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.settimeout(0.2)  # the accept loop notices shutdown within this
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopped = threading.Event()
        self.counts = {"local_connections": 0, "local_batches": 0}
        self._thread = threading.Thread(target=self._accept, name="rollout-local-accept", daemon=True)
        self._thread.start()

    @property
    def location(self) -> str:
        return local_location(self.path)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self._conns.add(conn)
                self.counts["local_connections"] += 1
            threading.Thread(target=self._serve, args=(conn,), name="rollout-local-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            producer = self._hello(conn)
            if producer is not None:
                self._batches(conn, producer)
        except (OSError, EOFError, ValueError) as exc:
            if not self._stopped.is_set():
                log.warning("rollout local connection dropped: %s", exc)
        except flight.FlightError as exc:  # a refused batch (schema) or a shutdown: tell the producer
            unavailable = isinstance(exc, (flight.FlightUnavailableError, flight.FlightCancelledError))
            if not unavailable:
                self._buffer.reject()
            text = str(exc).encode()
            with contextlib.suppress(OSError):
                status = frames.UNAVAILABLE if unavailable else frames.REFUSED
                conn.sendall(frames.ACK.pack(0, status) + struct.pack("!I", len(text)) + text)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket) -> str | None:
        hello = frames.read_hello(conn)
        if hello is None:
            return None
        token, producer = hello
        if not hmac.compare_digest(token, self._expected):
            self._buffer.reject()
            conn.sendall(b"\x01")
            return None
        conn.sendall(b"\x00")
        return producer.decode()

    def _batches(self, conn: socket.socket, producer: str) -> None:
        head = bytearray(frames.FRAME.size)
        schema: pa.Schema | None = None
        while (frame := frames.read_frame(conn, head)) is not None:
            seq, kind, body = frame
            where = f"rollout put from {producer!r} #{seq}"
            if kind == frames.SCHEMA:
                schema = pa.ipc.read_schema(pa.ipc.read_message(pa.py_buffer(body)))
                wire.check_schema(schema, f"rollout stream from {producer!r}")
                continue
            if schema is None:
                raise flight.FlightServerError(f"{where}: a batch before its schema")
            # decoded and checked when the trainer takes it (wire.EncodedBatch): not on the put's path
            batch = wire.EncodedBatch(body, schema, where)
            status = self._buffer.offer((producer, seq), batch, lambda: self._gone(conn), wake=False)
            with self._lock:
                self.counts["local_batches"] += 1
            try:  # acknowledged first, then the consumer woken: neither waits on the other for the GIL
                conn.sendall(frames.ACK.pack(seq, 0 if status == "queued" else 1))
            finally:
                self._buffer.wake()

    def _gone(self, conn: socket.socket) -> bool:
        """Whether the producer closed its end (polled only while a put waits for room)."""
        if self._stopped.is_set():
            return True
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "local_open": len(self._conns)}

    def shutdown(self) -> None:
        """Stop accepting, end every connection, remove the socket's directory. Safe twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        shutil.rmtree(self._dir, ignore_errors=True)


class LocalConnection:
    """A producer's connection to a trainer endpoint on its own node; one put at a time."""

    def __init__(self, path: str, token: str, producer_id: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # A Unix stream socket holds at most SO_SNDBUF in flight (default ~208 KB): a 1 MB batch
        # would cross in five hand-offs between the two processes. The kernel caps this at wmem_max.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        try:
            self.sock.connect(path)
            token_b, producer_b = token.encode(), producer_id.encode()
            self.sock.sendall(frames.HELLO.pack(frames.MAGIC, len(token_b), len(producer_b)) + token_b
                              + producer_b)
            reply = bytearray(1)
            if not frames.recv_exact(self.sock, memoryview(reply)) or reply != b"\x00":
                raise flight.FlightUnauthenticatedError(
                    "rollout transport: the trainer refused this producer's token "
                    "(the token is in <run_dir>/secrets/flight_token)")
        except BaseException:
            self.sock.close()
            raise
        self.schema: pa.Schema | None = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._parts: list[Any] = []
        self._ack = bytearray(frames.ACK.size)

    def send(self, record_batch: pa.RecordBatch, seq: int, timeout: float | None) -> str:
        """One batch; returns the ack once the trainer buffered it (`TimeoutError` past `timeout`)."""
        if self.schema is None or not (self.schema is record_batch.schema or self.schema.equals(record_batch.schema)):
            self._start(record_batch.schema)
        if self.sock.gettimeout() is not None:
            self.sock.settimeout(None)
        try:
            self._send_batch(record_batch, seq)
        except (BrokenPipeError, ConnectionResetError):
            self._raise_refusal()  # the trainer refused the schema and closed: say why, not "broken pipe"
            raise
        if timeout is not None:
            self.sock.settimeout(timeout)
        if not frames.recv_exact(self.sock, memoryview(self._ack)):
            raise ConnectionResetError("the trainer closed the rollout connection")
        got, status = frames.ACK.unpack(self._ack)
        if status in (frames.UNAVAILABLE, frames.REFUSED):
            self._raise_refusal(status)
        if got != seq:
            raise ConnectionResetError(f"acknowledgement for #{got}, expected #{seq}")
        return frames.STATUS[status]

    def _send_batch(self, record_batch: pa.RecordBatch, seq: int) -> None:
        if record_batch.get_total_buffer_size() < _COPY_BELOW:
            message = record_batch.serialize()
            head = frames.FRAME.pack(seq, frames.BATCH, message.size)
            frames.sendmsg_all(self.sock, [head, message], frames.FRAME.size + message.size)  # one wake-up, not two
        else:
            self._parts.clear()
            self._writer.write_batch(record_batch)  # type: ignore[union-attr]  # its buffers, no copy
            nbytes = sum(map(len, self._parts))  # bytes and pyarrow Buffers: len is bytes
            head = frames.FRAME.pack(seq, frames.BATCH, nbytes)
            frames.sendmsg_all(self.sock, [head, *self._parts], frames.FRAME.size + nbytes)
            self._parts.clear()

    def _start(self, schema: pa.Schema) -> None:
        """Tell the trainer the schema; later batches carry only their record batch message."""
        message = schema.serialize()
        self.sock.sendall(frames.FRAME.pack(0, frames.SCHEMA, message.size))
        self.sock.sendall(message)
        self.schema = schema
        sink = pa.PythonFile(_PartSink(self._parts), mode="w")
        self._writer = pa.ipc.new_stream(sink, schema)
        self._writer.write_batch(pa.RecordBatch.from_pylist([], schema=schema))
        self._parts.clear()  # the writer writes the schema with its first batch: already sent above

    def _raise_refusal(self, status: int | None = None) -> None:
        """Raise the trainer's refusal as Flight would; `status` None: read it if one is waiting."""
        try:
            if status is None:
                self.sock.settimeout(1.0)
                if not frames.recv_exact(self.sock, memoryview(self._ack)):
                    return
                status = frames.ACK.unpack(self._ack)[1]
                if status not in (frames.UNAVAILABLE, frames.REFUSED):
                    return
            size = bytearray(4)
            frames.recv_exact(self.sock, memoryview(size))
            text = bytearray(struct.unpack("!I", size)[0])
            frames.recv_exact(self.sock, memoryview(text))
        except (OSError, EOFError):
            return
        error = flight.FlightUnavailableError if status == frames.UNAVAILABLE else flight.FlightServerError
        raise error(text.decode(errors="replace"))

    def close(self) -> None:
        self.sock.close()


class LocalRoute:
    """A Flight client's same-node route: connects on demand, fails in Flight's terms.

    So `RolloutFlightClient` keeps one retry policy for both routes: a broken or refused
    connection is a `FlightUnavailableError` (retried under the same number), a put that
    waited past `put_timeout` a `FlightTimedOutError`. If the socket is gone (the trainer
    restarted elsewhere) the route closes for good and the client goes back to Flight.
    """

    def __init__(self, path: str, token: str, producer_id: str) -> None:
        self.path: str | None = path
        self._token, self._producer_id = token, producer_id
        self._conn: LocalConnection | None = None

    def put(self, record_batch: pa.RecordBatch, seq: int, timeout: float | None) -> str:
        where = f"rollout put {self._producer_id} #{seq}"
        try:
            if self._conn is None:
                self._conn = LocalConnection(self.path or "", self._token, self._producer_id)
            return self._conn.send(record_batch, seq, timeout)
        except TimeoutError:
            self.close()
            raise flight.FlightTimedOutError(f"{where}: not acknowledged within put_timeout={timeout:g} s "
                                             "(the trainer's buffer stayed full)") from None
        except flight.FlightError:
            self.close()
            raise
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self.close()
            self.path = None
            raise flight.FlightUnavailableError(f"{where}: same-node socket gone ({exc}); using Flight") from exc
        except (OSError, EOFError) as exc:
            self.close()
            raise flight.FlightUnavailableError(f"{where}: same-node connection broke ({exc})") from exc

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _PartSink:
    """A write-only file for pyarrow's IPC writer that keeps each buffer it is given, uncopied."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts, self.closed = parts, False

    def write(self, data: Any) -> int:
        self.parts.append(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False
