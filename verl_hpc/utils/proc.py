"""How a process that used torch.distributed leaves: without interpreter finalization.

Why (proven on 4 Dec from a core dump, docs/benchmarks.md "The teardown abort"): a gloo
process group's worker thread destroys each finished work itself, and a work can hold the
last reference to a tensor that has a Python object. Releasing that object needs the GIL.
If the thread passed the "is Python still up" check just before the main thread began
finalizing, it waits for the GIL, and when it gets it the interpreter ends the thread with
`pthread_exit`; that unwinds through the work's `noexcept` destructor, and C++ calls
`std::terminate`: SIGABRT, "terminate called without an active exception", after all the
work was done and written. Asynchronous collectives whose handles are dropped make the
window far wider (an FSDP2 gather by concurrent async broadcasts: 10 of 30 spawned runs).
Leaving by `os._exit` once everything that matters is flushed skips that teardown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys


def exit_now(code: int) -> None:
    """Flush logs and output, then `os._exit(code)`: no finalization, so no native teardown
    (gloo's threads, gRPC's pollers, DCP's writer pool) against a half-dismantled interpreter.

    Call it only once everything the process made is closed and written: a finished or
    cleanly stopped run, a spawned worker whose result is on disk. A failure should exit
    normally, so its traceback and exit code reach the parent as usual.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to save
            stream.flush()
    os._exit(code)
