"""Environment worker processes: environments that crash, hang or leak cost their episodes, not the rollout.

Why processes (`environment.num_workers > 0`, or `resources.env`): an environment in a thread of
the rollout process shares its memory and its interpreter — a segfault takes the run, a hung call
keeps its thread for good, and CPU-heavy games compete with generation for the GIL. Here each
worker is a process of its own holding many episodes' environments, answering requests in threads
so many episodes are in flight per worker (the wire: `wire.py`). Locally the rollout starts them
(`python -m verl_hpc.roles.env.workers`) and talks to each over a Unix socket only its user can
open, with a random key; under Slurm they are a hetjob component of their own (`remote.py`). A
worker that dies fails the episodes it held (`env/failures`) and is started again (or, remote,
reconnected once its node restarted it) for the next episodes; the run goes on.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import itertools
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Listener
from typing import Any, Protocol

from verl_hpc.roles.env.base import EnvFailure, EnvReply
from verl_hpc.roles.env.runner import EnvOutcome, ParkedFuture
from verl_hpc.roles.env.wire import EnvConnection, TimeoutSweeper, serve_connection
from verl_hpc.utils.child import accept_child

KEY_ENV = "VERL_HPC_ENV_KEY"
RETRY_AFTER_S = 60.0  # a worker that could not be started again is not tried before this


class WorkerLink(Protocol):
    """One environment worker as the runner sees it: local (`EnvWorker`) or remote (`remote.RemoteWorker`)."""

    index: int

    @property
    def alive(self) -> bool: ...

    def request(self, request_id: int, op: str, episode: str, payload: Any) -> cf.Future: ...

    def expect(self, episode: str) -> cf.Future: ...

    def forget(self, episode: str) -> None: ...

    def stop(self) -> None: ...


class EnvWorker:
    """One worker process this rollout started, and the requests waiting on it."""

    def __init__(self, index: int, spec: dict[str, Any], log_path: str | None, connect_timeout: float):
        self.index = index
        self._sock_dir = tempfile.mkdtemp(prefix="verl-hpc-env-")  # 0700: only this user can connect
        address = os.path.join(self._sock_dir, "env.sock")
        key = secrets.token_bytes(32)
        listener = Listener(address, family="AF_UNIX", authkey=key)
        out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - None: the rank's own log
        self.process = subprocess.Popen([sys.executable, "-m", "verl_hpc.roles.env.workers", address,
                                         json.dumps(spec)], env={**os.environ, KEY_ENV: key.hex()},
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            conn = accept_child(listener, self.process, connect_timeout, f"environment worker {index}", EnvFailure)
        except TimeoutError as err:
            self.process.kill()
            raise EnvFailure(str(err)) from None
        finally:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(address)
                os.rmdir(self._sock_dir)
        self.link = EnvConnection(conn, f"env-worker{index}", self._why_lost)

    def _why_lost(self) -> str:
        try:  # its socket closed: the process is exiting, so wait a moment for the code that says how
            code = self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        return f"environment worker {self.index} (pid {self.process.pid}) " + \
            ("is gone" if code is None else f"died (exit code {code})")

    def request(self, request_id: int, op: str, episode: str, payload: Any) -> cf.Future:
        return self.link.request(request_id, op, episode, payload)

    def expect(self, episode: str) -> cf.Future:
        return self.link.expect(episode)

    def forget(self, episode: str) -> None:
        self.link.forget(episode)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.link.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.link.fail_all()


class Admission:
    """At most `limit` requests in flight per worker; the others wait here, in order (back-pressure).

    Why: a worker answers on `threads` threads, and requests beyond them would queue inside it while
    their timeout already runs — a worker that falls behind would fail episodes whose environments
    never hung. Held here, a request's timeout starts when the worker can take it. A request that
    timed out gives its place back (its call may hang for good; the worker's queue takes over then).
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self.busy: dict[int, int] = {}
        self.waiting: dict[int, collections.deque[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def run(self, worker: int, send: Callable[[], None]) -> None:
        """`send()` now if `worker` has a free place, else once one is released."""
        with self._lock:
            if self.limit is not None and self.busy.get(worker, 0) >= self.limit:
                self.waiting.setdefault(worker, collections.deque()).append(send)
                return
            self.busy[worker] = self.busy.get(worker, 0) + 1
        send()

    def release(self, worker: int) -> None:
        """A request to `worker` was answered (or timed out): the next waiting one goes."""
        with self._lock:
            self.busy[worker] = max(0, self.busy.get(worker, 0) - 1)
        self._drain()

    def _drain(self) -> None:
        """Send what fits; a loop, not recursion: a send to a dead worker is answered (and released) at once."""
        if getattr(self._local, "draining", False):
            return  # the loop further up this thread's stack goes on
        self._local.draining = True
        try:
            while True:
                with self._lock:
                    ready = next((w for w, queue in self.waiting.items()
                                  if queue and self.busy.get(w, 0) < (self.limit or 0)), None)
                    if ready is None:
                        return
                    send = self.waiting[ready].popleft()
                    self.busy[ready] = self.busy.get(ready, 0) + 1
                send()
        finally:
            self._local.draining = False


class ProcessEnvRunner:
    """`EnvRunner`'s interface over worker processes: each episode's environment lives in one worker.

    `start(index)` makes worker `index` (again, when it died): a process of this rollout, or a
    link to a worker of the Slurm env component (`remote.remote_starter`). With `players: 2` both
    seats of a self-play match live in one worker (`match.MatchHost`), started together."""

    def __init__(self, start: Callable[[int], WorkerLink], num_workers: int, timeout: float, players: int = 1,
                 in_flight: int | None = None):
        self.start, self.timeout, self.players = start, timeout, players
        self.admission = Admission(in_flight)  # requests per worker at once: its threads
        self.workers = [start(i) for i in range(num_workers)]
        self.restarts = 0
        self._ids = itertools.count()
        self._home: dict[str, int] = {}
        self._next = itertools.cycle(range(num_workers))
        self._lock = threading.Lock()
        self._sweeper = TimeoutSweeper()
        self._down_until: dict[int, float] = {}  # workers that could not be started again, until when
        self._left: set[str] = set()  # self-play episodes whose worker was told they left

    @classmethod
    def local(cls, spec: dict[str, Any], num_workers: int, timeout: float,
              log_dir: str | None = None) -> ProcessEnvRunner:
        """Workers as processes of this rollout (`spec`: source, id, kwargs, threads)."""
        def start(index: int) -> EnvWorker:
            log = os.path.join(log_dir, f"env_worker{index}.out") if log_dir else None
            return EnvWorker(index, spec, log, connect_timeout=max(60.0, timeout))

        return cls(start, num_workers, timeout, int(spec.get("players", 1)), int(spec.get("threads", 16)))

    def _worker(self, episode: str) -> WorkerLink:
        """The episode's worker, chosen in turn when the episode begins.

        Why the lock only on the first call: choosing may start a dead worker again (up to the
        reconnect wait of a remote one), and the steps of episodes already placed must not wait
        for that. Their home is read without it (one dict lookup is atomic in CPython)."""
        home = self._home.get(episode)
        if home is None:
            with self._lock:
                if episode not in self._home:
                    self._home[episode] = self._pick()
                home = self._home[episode]
        return self.workers[home]

    def _pick(self) -> int:
        """The next worker, started again if it died; if it cannot be (tried again after RETRY_AFTER_S,
        so a worker gone for good does not cost every step a wait), another one still alive."""
        index = next(self._next)
        if self.workers[index].alive:
            return index
        self.workers[index].stop()
        try:
            if time.monotonic() < self._down_until.get(index, 0.0):
                raise EnvFailure(f"environment worker {index} could not be started again a moment ago")
            self.workers[index] = self.start(index)
        except EnvFailure:
            self._down_until[index] = max(self._down_until.get(index, 0.0), time.monotonic() + RETRY_AFTER_S)
            alive = [i for i, worker in enumerate(self.workers) if worker.alive]
            if not alive:
                raise
            return alive[index % len(alive)]
        self.restarts += 1
        return index

    def _outcome(self, status: str, payload: Any, started: float, parked_raw: cf.Future | None = None) -> EnvOutcome:
        """A wire answer as the loop takes it; `parked`: a `ParkedFuture` the other seat's move settles."""
        seconds = time.perf_counter() - started
        if status == "parked" and parked_raw is not None:
            later = ParkedFuture()
            parked_raw.add_done_callback(lambda done: later.set_result(self._outcome(*done.result(), time.perf_counter())))
            return EnvOutcome(None, None, seconds, later=later)
        if status != "ok":
            return EnvOutcome(None, str(payload), seconds)
        try:
            return EnvOutcome(EnvReply.checked(*payload), None, seconds)
        except (EnvFailure, TypeError) as err:
            return EnvOutcome(None, str(err), seconds)

    def _send(self, worker: WorkerLink | None, episodes: list[str], op: str, payload: Any,
              decode: Callable[[str, Any, float, dict[str, cf.Future]], Any],
              failed: Callable[[str, float], Any]) -> cf.Future:
        """One request about `episodes[0]` (a match start: all of `episodes`) to its worker; the
        future gets `decode(status, payload, started, parked)`, or `failed(why, seconds)` when no worker
        is reached or none answers within the timeout."""
        done: cf.Future = cf.Future()
        try:
            link = worker or self._worker(episodes[0])
            # before the request: a seat's observation may come back before the answer that parks it
            parked = {name: link.expect(name) for name in episodes} if self.players == 2 else {}
        except EnvFailure as err:  # no worker could be started or reached
            done.set_result(failed(str(err), 0.0))
            return done

        def send() -> None:  # when the worker has a free thread: the timeout runs from here
            started = time.perf_counter()
            raw = link.request(next(self._ids), op, episodes[0], payload)

            def settle(_: cf.Future) -> None:
                with contextlib.suppress(cf.InvalidStateError):  # the timeout came first
                    done.set_result(decode(*raw.result(), started, parked))

            raw.add_done_callback(settle)
            self._sweeper.settle_at(done, self.timeout, failed(f"no answer within {self.timeout:g} s", self.timeout))

        done.add_done_callback(lambda _: self.admission.release(link.index))
        self.admission.run(link.index, send)
        return done

    def _call(self, episode: str, op: str, payload: Any) -> cf.Future:
        return self._send(None, [episode], op, payload,
                          lambda status, answer, started, parked: self._outcome(status, answer, started,
                                                                                parked.get(episode)),
                          lambda why, seconds: EnvOutcome(None, why, seconds))

    def reset_all(self, starts: list[tuple[str, int | None, dict[str, Any]]]) -> list[EnvOutcome]:
        if self.players == 2:
            return self._start_matches(starts)
        futures = [self._call(name, "reset", (seed, kwargs)) for name, seed, kwargs in starts]
        return [f.result() for f in futures]

    def _start_matches(self, starts: list[tuple[str, int | None, dict[str, Any]]]) -> list[EnvOutcome]:
        """Both seats of each match on one worker (chosen in turn), one `reset_all` request per worker."""
        from verl_hpc.roles.env.match import seat_of

        by_worker: dict[int, list[tuple[str, int | None, dict[str, Any]]]] = {}
        placed: dict[str, int] = {}
        try:
            with self._lock:
                for start in starts:
                    match = seat_of(start[0])[0]
                    if match not in placed:
                        placed[match] = self._pick()
                    self._home[start[0]] = placed[match]
                    by_worker.setdefault(placed[match], []).append(start)
        except EnvFailure as err:
            return [EnvOutcome(None, str(err)) for _ in starts]

        def decode_for(names: list[str]) -> Callable[[str, Any, float, dict[str, cf.Future]], list[EnvOutcome]]:
            def decode(status: str, answer: Any, started: float, parked: dict[str, cf.Future]) -> list[EnvOutcome]:
                if status == "ok" and not (isinstance(answer, list) and len(answer) == len(names)):
                    status, answer = "error", f"a match start answered {answer!r:.80}, not one answer per seat"
                if status != "ok":
                    return [self._outcome(status, answer, started) for _ in names]
                return [self._outcome(*one, started, parked[name]) for name, one in zip(names, answer, strict=True)]
            return decode

        futures = {}
        for index, seats in by_worker.items():
            names = [name for name, _, _ in seats]
            futures[index] = self._send(self.workers[index], names, "reset_all", [list(seat) for seat in seats],
                                        decode_for(names), lambda why, seconds, k=len(names): [EnvOutcome(None, why, seconds)] * k)
        outcomes: dict[str, EnvOutcome] = {}
        for index, seats in by_worker.items():
            outcomes.update(zip([name for name, _, _ in seats], futures[index].result(), strict=True))
        return [outcomes[name] for name, _, _ in starts]

    def submit(self, episode: str, action: str) -> cf.Future:
        return self._call(episode, "step", action)

    def left(self, episode: str) -> None:
        """Self-play: the episode ended before its game; its worker tells the other seat (`MatchRunner.left`).
        Sent once per episode: the loop reports ended episodes after every round.

        Why wait for the answer: the worker sends the other seat's news before it, so once it is in, that
        seat is ready exactly as it would be in-process, and the loop's next round holds the same episodes
        (else a busy worker's late news moved the seat to a later round: other matches, other samples)."""
        index = self._home.get(episode)
        if self.players == 2 and index is not None and episode not in self._left and self.workers[index].alive:
            self._left.add(episode)
            answered = self.workers[index].request(next(self._ids), "left", episode, None)
            with contextlib.suppress(cf.TimeoutError):  # a worker that does not answer is found by its calls
                answered.result(timeout=self.timeout)

    def finish(self, episode: str) -> None:
        self._left.discard(episode)
        index = self._home.pop(episode, None)  # atomic: a restart's lock is not waited for
        if index is not None:
            self.workers[index].forget(episode)
            if self.workers[index].alive:
                self.workers[index].request(next(self._ids), "close", episode, None)

    def close(self) -> None:
        self._sweeper.close()
        for worker in self.workers:
            worker.stop()


def serve(address: str, spec: dict[str, Any]) -> int:
    """A worker the rollout started: connect back, then answer until the rollout goes."""
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(KEY_ENV)))
    serve_connection(conn, spec, cf.ThreadPoolExecutor(max_workers=int(spec.get("threads", 16)),
                                                       thread_name_prefix="env"))
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], json.loads(sys.argv[2])))
