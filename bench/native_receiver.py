"""Build bench/native_receiver.c and serve one same-node producer with it.

Why a separate receiver at all: the route's receiving thread and the trainer's intake share
Python's GIL, and issue 19's 64 KB target (0.5 of a raw socket) sits above the measured
Python floor (docs/benchmarks.md, "The floor under the ratio"). This is the way past that
floor the docs name: receive, hold and acknowledge in a thread that never takes the GIL.
It is built here, in the benchmark, to measure the idea before the product grows a C
extension: the producer is the route's own client end (`LocalConnection`); the hello and
the schema are read in Python with the route's code (`frames`); then C serves the
connection and a Python thread takes each body and decodes and checks it exactly as the
trainer's `get` does (`wire.EncodedBatch`).
"""

from __future__ import annotations

import contextlib
import hmac
import importlib.util
import os
import shlex
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa

from verl_hpc.transport.rollouts import frames, socket_dir, wire

SOURCE = Path(__file__).with_suffix(".c")


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def build_problem() -> str | None:
    """What this machine lacks to build the receiver (a C compiler, Python's headers), or None."""
    compiler = _compiler()
    if not compiler or shutil.which(compiler[0]) is None:
        return f"no C compiler ({compiler[0] if compiler else 'CC'!r} is not on PATH; apt install gcc)"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        return f"no Python headers ({header} is missing; apt install python3-dev)"
    return None


def build(into: str) -> ModuleType:
    """Compile the receiver into `into` and import it (about half a second)."""
    problem = build_problem()
    if problem:
        raise RuntimeError(f"cannot build {SOURCE.name}: {problem}")
    out = os.path.join(into, "native_receiver" + sysconfig.get_config_var("EXT_SUFFIX"))
    command = [*_compiler(), "-O2", "-shared", "-fPIC", "-pthread", f"-I{sysconfig.get_paths()['include']}",
               str(SOURCE), "-o", out]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"cannot build {SOURCE.name}: {shlex.join(command)} said:\n{done.stderr}")
    spec = importlib.util.spec_from_file_location("native_receiver", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NativeReceiver:
    """One producer's connection, greeted in Python, then received in C; a Python thread takes."""

    def __init__(self, token: str, capacity: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="verl-hpc-native-", dir=socket_dir.base_dir())  # where the route's lives
        self._module = build(self._dir)
        self._token, self._capacity = token.encode(), capacity
        self.path = os.path.join(self._dir, "native.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._receiver: Any = None
        self._stopped = threading.Event()
        self.taken = 0
        self.out_of_order = 0  # batches not numbered one after the other: a lost or repeated put
        self._thread = threading.Thread(target=self._serve, name="native-take", daemon=True)
        self._thread.start()

    def _greet(self, conn: socket.socket) -> pa.Schema | None:
        """The route's hello and schema, read by the route's code; None if the producer is refused."""
        hello = frames.read_hello(conn)
        if hello is None:  # gone before it said anything: nobody to answer
            return None
        if not hmac.compare_digest(hello[0], self._token):
            conn.sendall(b"\x01")
            return None
        conn.sendall(b"\x00")
        frame = frames.read_frame(conn, bytearray(frames.FRAME.size))
        if frame is None or frame[1] != frames.SCHEMA:
            return None
        schema = pa.ipc.read_schema(pa.ipc.read_message(pa.py_buffer(frame[2])))
        wire.check_schema(schema, "native receiver")
        return schema

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:  # closed before any producer came
            return
        with conn:
            schema = self._greet(conn)
            if schema is None:
                return
            self._receiver = self._module.Receiver(conn.fileno(), self._capacity)  # C keeps its own fd
        expected = None
        while not self._stopped.is_set():
            got = self._receiver.take(0.2)
            if got is None:
                continue
            seq, body = got
            wire.EncodedBatch(np.frombuffer(body, dtype=np.uint8), schema, f"native #{seq}").decode()
            self.out_of_order += expected is not None and seq != expected
            expected, self.taken = seq + 1, self.taken + 1

    @property
    def received(self) -> int:
        return 0 if self._receiver is None else self._receiver.received

    def close(self) -> None:
        """Stop taking, end the connection, remove the socket and the built module. Safe twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes an `accept` still waiting; close alone does not
        self._listener.close()
        self._thread.join(timeout=5)
        if self._receiver is not None:
            self._receiver.close()
        shutil.rmtree(self._dir, ignore_errors=True)
