"""Environment worker processes: environments that crash, hang or leak cost their episodes, not the rollout.

Why processes (`environment.num_workers > 0`): an environment in a thread of the rollout process
shares its memory and its interpreter — a segfault takes the run, a hung call keeps its thread
for good, and CPU-heavy games compete with generation for the GIL. Here each worker is a process
of its own (`python -m verl_hpc.roles.env.workers`) holding many episodes' environments, answering
requests in threads so many episodes are in flight per worker. The rollout talks to it over a
Unix socket only its user can open, with the run's own random key. A worker that dies fails the
episodes it held (`env/failures`) and is started again for the next episodes; the run goes on.

Wire: requests `(request_id, op, episode, payload)` with op reset/step/close; replies
`(request_id, "ok", (text, reward, done))` or `(request_id, "error", why)`, in any order.
"""

from __future__ import annotations

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
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from verl_hpc.roles.env.base import EnvFailure, EnvReply
from verl_hpc.roles.env.runner import EnvOutcome

KEY_ENV = "VERL_HPC_ENV_KEY"


class EnvWorker:
    """One worker process and the requests waiting on it."""

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
            self.conn = _accept(listener, self.process, connect_timeout)
        finally:
            listener.close()
        self.pending: dict[int, cf.Future] = {}
        self.episodes: set[str] = set()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"verl-hpc-env-worker{index}")
        self._reader.start()

    def request(self, request_id: int, op: str, episode: str, payload: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        self.pending[request_id] = future
        try:
            with self._send_lock:
                self.conn.send((request_id, op, episode, payload))
        except (OSError, EOFError, ValueError):
            self._fail_all()
        return future

    def _read(self) -> None:
        while True:
            try:
                request_id, status, payload = self.conn.recv()
            except (EOFError, OSError):
                self._fail_all()
                return
            future = self.pending.pop(request_id, None)
            if future is not None:
                future.set_result((status, payload))

    def _fail_all(self) -> None:
        try:  # its socket closed: the process is exiting, so wait a moment for the code that says how
            code = self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        why = f"environment worker {self.index} (pid {self.process.pid}) " + \
            ("is gone" if code is None else f"died (exit code {code})")
        for request_id in list(self.pending):
            future = self.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(("error", why))

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._fail_all()


def _accept(listener: Listener, process: subprocess.Popen, timeout: float) -> Connection:
    accepted: list[Connection] = []
    waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    waiter.start()
    deadline = time.monotonic() + timeout
    while not accepted:
        if process.poll() is not None:
            raise EnvFailure(f"environment worker exited with code {process.returncode} before connecting")
        if time.monotonic() > deadline:
            process.kill()
            raise EnvFailure(f"environment worker did not connect within {timeout:g} s")
        waiter.join(0.05)
    return accepted[0]


class ProcessEnvRunner:
    """`EnvRunner`'s interface over worker processes: each episode's environment lives in one worker."""

    def __init__(self, spec: dict[str, Any], num_workers: int, timeout: float, log_dir: str | None = None):
        self.spec, self.timeout, self.log_dir = spec, timeout, log_dir
        self.workers = [self._start(i) for i in range(num_workers)]
        self.restarts = 0
        self._ids = itertools.count()
        self._home: dict[str, int] = {}
        self._next = itertools.cycle(range(num_workers))
        self._lock = threading.Lock()

    def _start(self, index: int) -> EnvWorker:
        log = os.path.join(self.log_dir, f"env_worker{index}.out") if self.log_dir else None
        return EnvWorker(index, self.spec, log, connect_timeout=max(60.0, self.timeout))

    def _worker(self, episode: str) -> EnvWorker:
        """The episode's worker (started again if it died before this episode began)."""
        with self._lock:
            if episode not in self._home:
                index = next(self._next)
                if not self.workers[index].alive:
                    self.workers[index].stop()
                    self.workers[index] = self._start(index)
                    self.restarts += 1
                self._home[episode] = index
            return self.workers[self._home[episode]]

    def _outcome(self, future: cf.Future, started: float) -> EnvOutcome:
        try:
            status, payload = future.result(self.timeout)
        except cf.TimeoutError:
            return EnvOutcome(None, f"no answer within {self.timeout:g} s", time.perf_counter() - started)
        if status != "ok":
            return EnvOutcome(None, str(payload), time.perf_counter() - started)
        try:
            return EnvOutcome(EnvReply.checked(*payload), None, time.perf_counter() - started)
        except (EnvFailure, TypeError) as err:
            return EnvOutcome(None, str(err), time.perf_counter() - started)

    def _call(self, episode: str, op: str, payload: Any) -> cf.Future:
        started = time.perf_counter()
        raw = self._worker(episode).request(next(self._ids), op, episode, payload)
        done: cf.Future = cf.Future()
        raw.add_done_callback(lambda _: done.set_result(self._outcome(raw, started)))
        threading.Timer(self.timeout, lambda: done.done() or done.set_result(
            EnvOutcome(None, f"no answer within {self.timeout:g} s", self.timeout))).start()
        return done

    def reset_all(self, starts: list[tuple[str, int | None, dict[str, Any]]]) -> list[EnvOutcome]:
        futures = [self._call(name, "reset", (seed, kwargs)) for name, seed, kwargs in starts]
        return [f.result() for f in futures]

    def submit(self, episode: str, action: str) -> cf.Future:
        return self._call(episode, "step", action)

    def finish(self, episode: str) -> None:
        with self._lock:
            index = self._home.pop(episode, None)
        if index is not None and self.workers[index].alive:
            self.workers[index].request(next(self._ids), "close", episode, None)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()


def serve(address: str, spec: dict[str, Any]) -> int:
    """The worker: one environment per episode, each request answered on a thread of its own."""
    from verl_hpc.roles.env.sources import make_environment

    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(KEY_ENV)))
    envs: dict[str, Any] = {}
    send_lock = threading.Lock()
    pool = cf.ThreadPoolExecutor(max_workers=int(spec.get("threads", 16)), thread_name_prefix="env")

    def answer(request_id: int, op: str, episode: str, payload: Any) -> None:
        try:
            if op == "reset":
                envs[episode] = make_environment(spec["source"], spec["id"], spec.get("kwargs"))
                reply = envs[episode].reset(seed=payload[0], **payload[1])
            elif op == "step":
                reply = envs[episode].step(payload)
            else:
                env = envs.pop(episode, None)
                if env is not None:
                    env.close()
                return
            result = ("ok", (reply.text, reply.reward, reply.done))
        except Exception as err:  # noqa: BLE001 - the environment's failure is its episode's
            result = ("error", f"raised {type(err).__name__}: {err}")
        with send_lock:
            conn.send((request_id, *result))

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return 0
        pool.submit(answer, *request)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], json.loads(sys.argv[2])))
