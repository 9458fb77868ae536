"""Child processes that call back: wait for the connection, and give up the moment the child dies.

Why one helper: a vLLM engine and an environment worker are both started as a process that
connects back to a `multiprocessing.connection.Listener`; `Listener.accept` blocks with no
timeout and cannot notice that the child died while starting, so a crashed start would hang
its parent. Accepting on a daemon thread while polling the child fails fast on either.
"""

from __future__ import annotations

import subprocess
import threading
import time
from multiprocessing.connection import Connection, Listener


def accept_child(listener: Listener, process: subprocess.Popen, timeout: float, what: str,
                 error: type[Exception] = RuntimeError) -> Connection:
    """The connection `process` makes to `listener`; `error` if it exits first, TimeoutError after
    `timeout` seconds (the child is left running: the caller decides whether to kill it)."""
    accepted: list[Connection] = []
    waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True,
                              name=f"verl-hpc-accept-{what}")
    waiter.start()
    deadline = time.monotonic() + timeout
    while not accepted:
        if process.poll() is not None:
            raise error(f"{what} exited with code {process.returncode} before connecting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not connect within {timeout:g} s")
        waiter.join(0.05)
    return accepted[0]
