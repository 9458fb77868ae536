"""The environment workers' wire: requests and replies over one `multiprocessing` connection.

Why one module for both ends: a worker the rollout spawned (a Unix socket, `workers.py`) and a
worker on a node of its own (TCP, `remote.py`) speak the same protocol, so the rollout side
(`EnvConnection`) and the worker side (`serve_connection`) are written once.

Wire: requests `(request_id, op, episode, payload)` with op reset/step/close; replies
`(request_id, "ok", (text, reward, done))` (a close: `None`) or `(request_id, "error", why)`, in
any order: every request is answered, so nothing waits on the rollout's side for ever. Many
requests are in flight on one connection: a worker answers each on a thread of its own.

Self-play (`players: 2`, `match.MatchHost`) adds ops `reset_all` (a match's seats start together;
the reply is one `(status, payload)` per seat) and `left` (a seat's episode ended before its game),
and status `parked`: the seat's move is made and
its next observation comes once the other seat has moved, as an unasked message
`(None, "resolve", (episode, status, payload))`. The rollout's end makes the future for that
message before it sends the request (`expect`), so the two may arrive in either order.
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

Notify = Callable[[str, str, Any], None]  # (episode, status, payload): an unasked message


class EnvConnection:
    """The rollout's end of one worker connection: a future per request, one reader thread."""

    def __init__(self, conn: Connection, name: str, why_lost: Callable[[], str]):
        self.conn, self.name, self._why_lost = conn, name, why_lost
        self.pending: dict[int, cf.Future] = {}
        self.parked: dict[str, cf.Future] = {}  # episode -> its observation after the other seat's move
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

    def expect(self, episode: str) -> cf.Future:
        """A future for the `(status, payload)` a `resolve` message will bring `episode` (self-play);
        made before the request whose answer may be `parked`, so the message finds it either way."""
        future: cf.Future = cf.Future()
        self.parked[episode] = future
        if self.lost:
            self.fail_all()
        return future

    def forget(self, episode: str) -> None:
        self.parked.pop(episode, None)

    def _read(self) -> None:
        while True:
            try:
                request_id, status, payload = self.conn.recv()
            except (EOFError, OSError, ValueError, TypeError):  # TypeError: closed under this thread
                self.fail_all()
                return
            if request_id is None and status == "resolve":
                episode, status, payload = payload
                future = self.parked.pop(episode, None)
            else:
                future = self.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result((status, payload))

    def fail_all(self) -> None:
        """The link is gone: every waiting request and parked seat gets an error saying why (once known)."""
        self.lost = True
        why = self._why_lost()
        for waiting in (self.pending, self.parked):
            for key in list(waiting):
                future = waiting.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(("error", why))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()


class EpisodeHost:
    """A worker's environments, one per episode (`players: 1`)."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.envs: dict[str, Any] = {}

    def handle(self, op: str, episode: str, payload: Any, notify: Notify) -> tuple[str, Any]:
        if op == "reset":
            self.envs[episode] = make_environment(self.spec["source"], self.spec["id"], self.spec.get("kwargs"),
                                                  self.spec.get("action_wrappers", ()))
            reply = self.envs[episode].reset(seed=payload[0], **payload[1])
        elif op == "step":
            reply = self.envs[episode].step(payload)
        else:
            env = self.envs.pop(episode, None)
            if env is not None:
                env.close()
            reply = None
        return "ok", None if reply is None else (reply.text, reply.reward, reply.done)

    def close(self) -> None:
        for env in list(self.envs.values()):
            with contextlib.suppress(Exception):  # a failing close costs nothing more
                env.close()


def serve_connection(conn: Connection, spec: dict[str, Any], pool: cf.ThreadPoolExecutor) -> None:
    """Answer one connection's requests until it closes, each on `pool`: one environment per episode
    (`spec`: source, id, kwargs), or self-play matches (`players: 2`). What it held is closed at the end."""
    if int(spec.get("players", 1)) == 2:
        from verl_hpc.roles.env.match import MatchHost

        host: Any = MatchHost(spec)
    else:
        host = EpisodeHost(spec)
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with contextlib.suppress(OSError, ValueError), send_lock:  # the rollout went away: closed below
            conn.send(message)

    def notify(episode: str, status: str, payload: Any) -> None:
        send((None, "resolve", (episode, status, payload)))

    def answer(request_id: int, op: str, episode: str, payload: Any) -> None:
        try:
            result = host.handle(op, episode, payload, notify)
        except Exception as err:  # noqa: BLE001 - the environment's failure is its episode's
            result = ("error", f"raised {type(err).__name__}: {err}")
        send((request_id, *result))

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break
        pool.submit(answer, *request)
    host.close()


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
