"""What any Python receiver pays per put, measured beside the route: the floor under its ratio.

Why: issue 19 asks the same-node route for >= 0.5 of a raw socket at 64 KB. The route must
acknowledge a put only once the batch is in the trainer's buffer, and the trainer takes it
in another thread, so every put wakes that thread. These two receivers keep only that:
- "unix": a Python thread reads length-prefixed bytes from a Unix socket into fresh memory
  and answers one byte (the route's socket family, nothing else);
- "floor": the same, but each body is appended to a queue under a condition, the byte is
  answered, and a consumer thread waiting on the condition is woken to take it.
No decoding, no checks, no dedup: no design that keeps the route's contract in Python can
beat "floor", so the route's ratio is read against it (docs/benchmarks.md, "The floor").
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import tempfile
import threading

import numpy as np

from verl_hpc.transport.rollouts import socket_dir

MODES = ("unix", "floor")
_LENGTH = struct.Struct("!Q")


class FloorReceiver:
    """One receiving thread (and, for "floor", one consumer thread) on a fresh Unix socket."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._dir = tempfile.mkdtemp(prefix="verl-hpc-floor-", dir=socket_dir.base_dir())  # where the route's lives
        self.path = os.path.join(self._dir, "floor.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._cond = threading.Condition()
        self._queue: collections.deque[np.ndarray] = collections.deque()
        self._stopped = False
        self.taken = 0
        self._threads = [threading.Thread(target=self._receive, daemon=True)]
        if mode == "floor":
            self._threads.append(threading.Thread(target=self._consume, daemon=True))
        for thread in self._threads:
            thread.start()

    def _receive(self) -> None:
        conn, _ = self._listener.accept()
        head = bytearray(_LENGTH.size)
        with conn:
            while conn.recv_into(head, _LENGTH.size, socket.MSG_WAITALL) == _LENGTH.size:
                size = _LENGTH.unpack(head)[0]
                body = np.empty(size, dtype=np.uint8)
                if conn.recv_into(memoryview(body), size, socket.MSG_WAITALL) != size:
                    return
                if self.mode == "unix":
                    conn.sendall(b"\x01")
                    continue
                with self._cond:
                    self._queue.append(body)
                conn.sendall(b"\x01")  # acknowledged, then the consumer woken: as the route does
                with self._cond:
                    self._cond.notify_all()

    def _consume(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._queue.popleft()
                self.taken += 1

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._listener.close()
        for thread in self._threads[1:]:
            thread.join(timeout=5)
        if os.path.exists(self.path):
            os.unlink(self.path)
        os.rmdir(self._dir)


class FloorSender:
    """The producer's end: the same bytes, one `sendmsg` with their length, then the one-byte answer."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)  # as the route's producer
        self._sock.connect(path)
        self._ack = bytearray(1)

    def send(self, payload: bytes) -> None:
        self._sock.sendmsg([_LENGTH.pack(len(payload)), payload])
        if self._sock.recv_into(self._ack, 1, socket.MSG_WAITALL) != 1:
            raise RuntimeError("floor receiver closed the connection")

    def close(self) -> None:
        self._sock.close()
