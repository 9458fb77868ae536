"""Calls the environments of many episodes at once: a bounded pool, a timeout per call, failures counted.

Why a failure ends only its episode: an environment that raises, hangs past `timeout_seconds` or
answers something that is not an observation (`EnvFailure`) has lost that episode's state; the
episode ends where it is, scores nothing from the environment and is counted in `env/failures`,
while every other episode of the step goes on. A hung call is abandoned on its daemon thread
(Python cannot kill a thread); an environment that may hang for good belongs in a process of its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from verl_hpc.roles.env.base import EnvFailure, Environment, EnvReply


@dataclass
class EnvOutcome:
    """One call's observation, or why there is none."""

    reply: EnvReply | None
    error: str | None = None
    seconds: float = 0.0
    # The observation comes later, when another episode moves (self-play, match.py): neither a reply
    # nor an error yet, and the loop must not wait on it while it still has turns to generate.
    later: cf.Future | None = None


class ParkedFuture(cf.Future):
    """An observation that comes when another episode moves (self-play), not from a call in flight."""


def parked(future: Any) -> bool:
    """Whether waiting on `future` would wait on a generation round (the loop must not)."""
    return isinstance(future, ParkedFuture)


class EnvCalls(Protocol):
    """What the agent loop asks of environments: threads here (`EnvRunner`), or worker processes
    (`workers.ProcessEnvRunner`)."""

    def reset_all(self, starts: list[tuple[str, int | None, dict[str, Any]]]) -> list[EnvOutcome]: ...

    def submit(self, episode: str, action: str) -> cf.Future: ...

    def finish(self, episode: str) -> None: ...

    def close(self) -> None: ...


def call_within(fn: Callable[[], Any], timeout: float) -> Any:
    """`fn()` on a daemon thread; EnvFailure if it raises or runs past `timeout` seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - carried to the calling thread
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True, name="verl-hpc-env-call")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise EnvFailure(f"no answer within {timeout:g} s")
    if "error" in box:
        err = box["error"]
        raise err if isinstance(err, EnvFailure) else EnvFailure(f"raised {type(err).__name__}: {err}")
    return box.get("value")


class EnvRunner:
    """One environment per episode; `reset` and `submit(step)` on a pool, each call within the timeout."""

    def __init__(self, make: Callable[[], Environment], workers: int, timeout: float):
        self.make, self.timeout = make, timeout
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verl-hpc-env")
        self._envs: dict[str, Environment] = {}
        self._lock = threading.Lock()

    def _timed(self, fn: Callable[[], EnvReply]) -> EnvOutcome:
        started = time.perf_counter()
        try:
            reply = call_within(fn, self.timeout)
            if not isinstance(reply, EnvReply):
                raise EnvFailure(f"answered {type(reply).__name__}, not an observation")
            return EnvOutcome(reply, None, time.perf_counter() - started)
        except EnvFailure as err:
            return EnvOutcome(None, str(err), time.perf_counter() - started)

    def _reset(self, episode: str, seed: int | None, kwargs: dict[str, Any]) -> EnvOutcome:
        def start() -> EnvReply:
            env = self.make()
            with self._lock:
                self._envs[episode] = env
            return env.reset(seed=seed, **kwargs)

        return self._timed(start)

    def reset_all(self, starts: list[tuple[str, int | None, dict[str, Any]]]) -> list[EnvOutcome]:
        """The first observation of each (episode, seed, reset kwargs), all at once, in order."""
        futures = [self.pool.submit(self._reset, *start) for start in starts]
        return [f.result() for f in futures]

    def submit(self, episode: str, action: str) -> cf.Future:
        """The observation after the episode's turn `action`, computed on the pool (an `EnvOutcome`)."""
        with self._lock:
            env = self._envs.get(episode)
        if env is None:
            done: cf.Future = cf.Future()
            done.set_result(EnvOutcome(None, "the episode has no environment (its reset failed)"))
            return done
        return self.pool.submit(self._timed, lambda: env.step(action))

    def finish(self, episode: str) -> None:
        """Close the episode's environment (a failing close costs nothing but that environment)."""
        with self._lock:
            env = self._envs.pop(episode, None)
        if env is not None:
            with contextlib.suppress(EnvFailure):
                call_within(env.close, self.timeout)

    def close(self) -> None:
        for episode in list(self._envs):
            self.finish(episode)
        self.pool.shutdown(wait=False, cancel_futures=True)
