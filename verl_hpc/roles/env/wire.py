"""The environment workers' wire: requests and replies over one `multiprocessing` connection.

Why one module for both ends: a worker the rollout spawned (a Unix socket, `workers.py`) and a
worker on a node of its own (TCP, `remote.py`) speak the same protocol, so the rollout side
(`EnvConnection`) and the worker side (`serve_connection`) are written once.

Wire: requests `(request_id, op, episode, payload)` with op reset/step/close; replies
`(request_id, "ok", (text, reward, done))` (a close: `None`) or `(request_id, "error", why)`, in
any order: every request is answered, so nothing waits on the rollout's side for ever. Many
requests are in flight on one connection: a worker answers each on a thread of its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from verl_hpc.roles.env.sources import make_environment


class EnvConnection:
    """The rollout's end of one worker connection: a future per request, one reader thread."""

    def __init__(self, conn: Connection, name: str, why_lost: Callable[[], str]):
        self.conn, self.name, self._why_lost = conn, name, why_lost
        self.pending: dict[int, cf.Future] = {}
        self.lost = False
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"verl-hpc-{name}")
        self._reader.start()

    def request(self, request_id: int, op: str, episode: str, payload: Any) -> cf.Future:
        """Send one request; its future gets `(status, payload)`, or an error once the link is lost."""
        future: cf.Future = cf.Future()
        self.pending[request_id] = future
        try:
            with self._send_lock:
                self.conn.send((request_id, op, episode, payload))
        except (OSError, EOFError, ValueError):
            self.fail_all()
        return future

    def _read(self) -> None:
        while True:
            try:
                request_id, status, payload = self.conn.recv()
            except (EOFError, OSError, ValueError, TypeError):  # TypeError: closed under this thread
                self.fail_all()
                return
            future = self.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result((status, payload))

    def fail_all(self) -> None:
        """The link is gone: every waiting request gets an error saying why (once known)."""
        self.lost = True
        why = self._why_lost()
        for request_id in list(self.pending):
            future = self.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(("error", why))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()


def serve_connection(conn: Connection, spec: dict[str, Any], pool: cf.ThreadPoolExecutor) -> None:
    """Answer one connection's requests until it closes: one environment per episode (`spec`:
    source, id, kwargs), each request on `pool`. The episodes it held are closed at the end."""
    envs: dict[str, Any] = {}
    send_lock = threading.Lock()

    def answer(request_id: int, op: str, episode: str, payload: Any) -> None:
        try:
            if op == "reset":
                envs[episode] = make_environment(spec["source"], spec["id"], spec.get("kwargs"),
                                                 spec.get("action_wrappers", ()))
                reply = envs[episode].reset(seed=payload[0], **payload[1])
            elif op == "step":
                reply = envs[episode].step(payload)
            else:
                env = envs.pop(episode, None)
                if env is not None:
                    env.close()
                reply = None
            result = ("ok", None if reply is None else (reply.text, reply.reward, reply.done))
        except Exception as err:  # noqa: BLE001 - the environment's failure is its episode's
            result = ("error", f"raised {type(err).__name__}: {err}")
        with contextlib.suppress(OSError, ValueError), send_lock:  # the rollout went away: closed below
            conn.send((request_id, *result))

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break
        pool.submit(answer, *request)
    for env in list(envs.values()):
        with contextlib.suppress(Exception):  # a failing close costs nothing more
            env.close()


class TimeoutSweeper:
    """Settles futures still pending at their deadline with a given value, from one thread.

    Why not a `threading.Timer` per call: a step of thousands of environment calls would start
    thousands of threads; one heap and one condition serve them all.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, cf.Future, Any]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="verl-hpc-env-timeouts")
        self._thread.start()

    def settle_at(self, future: cf.Future, seconds: float, value: Any) -> None:
        """`future.set_result(value)` after `seconds`, unless it is done by then."""
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), future, value))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, future, value = heapq.heappop(self._heap)
            with contextlib.suppress(cf.InvalidStateError):  # its answer may have come in the meantime
                future.set_result(value)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
