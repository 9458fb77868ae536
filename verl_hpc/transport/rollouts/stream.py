"""One producer's long-lived `do_exchange` stream to the trainer, and its idle closer.

Why a stream instead of one `do_put` per batch: a put is a new gRPC call (HTTP/2
stream, auth middleware, a Python handler started on a gRPC thread, a JSON reply),
about 0.3-0.5 ms here; on an open stream a batch costs one message each way. Auth is
checked once, when the stream opens.

Why streams close when idle: pyarrow's `FlightServerBase.shutdown()` waits for every
open call and has no deadline, and the server cannot end a call that sits waiting for
the client's next message. A stream left open by a producer that has nothing to send
would hold the trainer's shutdown forever; closing it after `idle_close_s` bounds that
wait, and a producer that puts often (the case the stream is for) keeps it open.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pyarrow as pa
import pyarrow.flight as flight

from verl_hpc.transport.rollouts import wire


class ProducerStream:
    """An open exchange call carrying batches of one schema; not thread-safe (the client locks)."""

    def __init__(self, client: flight.FlightClient, producer_id: str, schema: pa.Schema,
                 options: flight.FlightCallOptions) -> None:
        descriptor = flight.FlightDescriptor.for_path(wire.DESCRIPTOR_ROOT, producer_id.encode())
        self.schema = schema
        self._writer, self._reader = client.do_exchange(descriptor, options)
        self._writer.begin(schema)
        self.cancelled = False

    def send(self, record_batch: pa.RecordBatch, seq: int) -> str:
        """Write the batch as ~PUT_CHUNK_BYTES messages, then wait for its acknowledgement.

        Raises whatever the server failed the call with (wrong schema, shutting down,
        cancelled); the stream is unusable afterwards and the caller drops it.
        """
        parts = wire.chunks(record_batch, wire.PUT_CHUNK_BYTES)
        last = len(parts) - 1
        for i, part in enumerate(parts):
            self._writer.write_with_metadata(part, pa.py_buffer(wire.CHUNK_META.pack(seq, i == last)))
        return wire.decode_ack(self._reader.read_chunk().app_metadata, seq)

    def cancel(self) -> None:
        """Abort the call from another thread (a put_timeout): the server sees is_cancelled()."""
        self.cancelled = True
        self._reader.cancel()

    def close(self) -> None:
        """End the call; errors are ignored because a dropped stream is dropped either way."""
        try:
            self._writer.done_writing()
            self._writer.close()
        except (flight.FlightError, OSError, pa.ArrowException):
            pass


class IdleCloser:
    """A daemon thread that runs `close_if_idle(idle_s)` every `idle_s / 2` until stopped."""

    def __init__(self, idle_s: float, close_if_idle: Callable[[float], None], name: str) -> None:
        self._idle_s = idle_s
        self._close_if_idle = close_if_idle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._idle_s / 2):
            self._close_if_idle(self._idle_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
