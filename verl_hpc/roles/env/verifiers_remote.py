"""verifiers drivers on the Slurm env component: one per worker, fed episodes over the run's wire.

Why: a verifiers episode's CPU work - its harness, its tool servers, the sandboxes its tools run
code in - is the environment's, and belongs on the env component's CPU nodes (`resources.env`),
not on the nodes that generate. The rollout reaches each worker as it reaches any environment
worker (`remote.RemoteWorker`: the address file in the run directory, TCP, the run's token), opens
a driver there (`verifiers_process.serve_driver_connection`) against its own generate endpoint,
and spreads a step's episodes over the workers. A worker that dies fails the episodes it held
(its supervisor starts it again; the next episode sent there reconnects and reopens).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from verl_hpc.config.errors import FieldError
from verl_hpc.roles.env.base import EnvFailure
from verl_hpc.roles.env.remote import EnvHome, RemoteWorker
from verl_hpc.roles.env.sources import ENV_FIELD as FIELD
from verl_hpc.roles.env.verifiers_process import RESTART_PAUSE_S

log = logging.getLogger(__name__)
RECONNECT_S = 60.0  # how long an episode waits for a worker its supervisor is restarting


def _settle(out: Future, reply: Future) -> None:
    status, payload = reply.result()
    if status == "ok" and isinstance(payload, dict):
        out.set_result(payload)
    else:
        out.set_exception(EnvFailure(str(payload)))


class RemoteVerifiers:
    """The env component's drivers behind `VerifiersDriver`'s interface (`start`, `submit`, `cancel`, `stop`)."""

    def __init__(self, home: EnvHome, opening: dict[str, Any], startup_seconds: float):
        self.home, self.opening, self.startup_seconds = home, opening, startup_seconds
        self.links: list[RemoteWorker | None] = [None] * home.num_workers
        self.ids = itertools.count(1)
        self.turn = itertools.count()
        self.where: dict[str, int] = {}  # episode -> the worker running it
        self.failed_at = [-RESTART_PAUSE_S] * home.num_workers  # when reopening each last failed
        self.tasks = 0
        self.starts = 0
        self.lock = threading.Lock()

    def start(self) -> None:
        """Open a driver on every worker (each loads the environment on its node)."""
        for index in range(len(self.links)):
            self.open(index)

    def open(self, index: int) -> RemoteWorker:
        old = self.links[index]
        link = RemoteWorker(index, self.home) if old is None else RemoteWorker(index, self.home, RECONNECT_S,
                                                                               old.address)
        status, payload = link.request(next(self.ids), "open", "", self.opening).result(self.startup_seconds + 30)
        if status != "ok":
            link.stop()
            raise FieldError(f"{FIELD}.id", f"env worker {index} could not start verifiers' driver: {payload}",
                             "see verifiers_driver_env<i>.log in the run's logs; the same flags must work with "
                             "vf-eval on the env nodes")
        self.links[index], self.tasks = link, int(payload)
        self.starts += 1
        return link

    def submit(self, rid: str, task: int, sampling: dict[str, Any]) -> Future:
        """The episode on the next worker in turn that is up; a lost one is reopened first, unless
        reopening it failed within the last minute (then the next one takes the episode)."""
        out: Future = Future()
        with self.lock:
            link, index = self.next_link()
            if link is None:
                out.set_exception(EnvFailure("no env worker could run verifiers' driver (see the run's "
                                             "verifiers_driver_env<i>.log and env_worker<i>.out)"))
                return out
            self.where[rid] = index
        reply = link.request(next(self.ids), "episode", rid, {"task": task, "sampling": sampling})
        reply.add_done_callback(lambda done: _settle(out, done))
        return out

    def next_link(self) -> tuple[RemoteWorker | None, int]:
        first = next(self.turn)
        for index in [(first + k) % len(self.links) for k in range(len(self.links))]:
            link = self.links[index]
            if link is not None and link.alive:
                return link, index
            if time.monotonic() - self.failed_at[index] < RESTART_PAUSE_S:
                continue
            try:
                return self.open(index), index
            except (EnvFailure, FieldError, TimeoutError) as err:
                log.warning("env worker %d: verifiers' driver could not be reopened: %s", index, err)
                self.failed_at[index] = time.monotonic()
        return None, -1

    def cancel(self, rid: str) -> None:
        index = self.where.pop(rid, None)
        link = None if index is None else self.links[index]
        if link is not None and link.alive:
            link.request(next(self.ids), "cancel", rid, None)

    def stop(self) -> None:
        for link in self.links:
            if link is not None:
                link.stop()
