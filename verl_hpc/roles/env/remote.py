"""Environment workers on CPU nodes of their own: the Slurm `env` component (`resources.env`).

Why a component and not processes of the rollout: agent steps wait on games, code runs and
simulators that need CPUs, not GPUs; on GPU nodes they steal the CPUs generation needs, and a
GPU allocation is the wrong unit to buy them in. The job script starts one task per worker on the
component's nodes (`python -m verl_hpc.roles.env.remote RUN_DIR`) as a job step of its own,
beside the training step, and stops it when training ends; a requeue restarts both.

Rendezvous through the run directory, which every node sees: each worker listens on a TCP port of
its node and writes `env_workers/<job>.<restart>/worker<i>.json` (host, port, pid); the rollout
reads its own attempt's files, so a requeued job never reaches the last attempt's workers.
Connections authenticate with the run's token (`secrets/flight_token`, owner-only): only the
job's owner can drive an environment. Each worker runs under a small supervisor on its node that
starts it again when it dies; the rollout's link notices the loss, fails that worker's episodes
(`env/failures`) and reconnects for the next ones.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from verl_hpc.roles.env.base import EnvFailure
from verl_hpc.roles.env.wire import EnvConnection, serve_connection

ADDRESS_DIR = "env_workers"
HOST_ENV = "VERL_HPC_ENV_HOST"  # the name other nodes reach this one by, when the hostname is not it
RESTART_LIMIT = 10  # restarts within RESTART_WINDOW_S before a supervisor gives up
RESTART_WINDOW_S = 60.0
Address = tuple[str, int, int]  # host, port, pid of a worker


def attempt_dir(run_dir: str | os.PathLike[str], job_id: str, restart: str | int) -> Path:
    """Where the workers of one attempt (job id, restart count) announce themselves."""
    return Path(run_dir) / ADDRESS_DIR / f"{job_id}.{restart}"


def address_path(directory: Path, index: int) -> Path:
    return directory / f"worker{index}.json"


@dataclass(frozen=True)
class EnvHome:
    """Where the rollout finds the env component's workers, and how long it waits for them."""

    directory: Path
    num_workers: int
    token: str
    wait_s: float

    @classmethod
    def of_attempt(cls, run_dir: str | os.PathLike[str], num_workers: int, token: str, wait_s: float,
                   environ: dict[str, str] | None = None) -> EnvHome:
        """This Slurm attempt's home (SLURM_JOB_ID / SLURM_RESTART_COUNT of the calling task)."""
        env = os.environ if environ is None else environ
        job = env.get("SLURM_HET_JOB_ID") or env.get("SLURM_JOB_ID", "0")
        return cls(attempt_dir(run_dir, job, env.get("SLURM_RESTART_COUNT", "0")), num_workers, token, wait_s)


class RemoteWorker:
    """The rollout's link to worker `index` of the env component (reached by its address file)."""

    def __init__(self, index: int, home: EnvHome, wait_s: float | None = None, avoid: Address | None = None):
        self.index, self.home = index, home
        self.address, conn = _connect(home, index, home.wait_s if wait_s is None else wait_s, avoid)
        self.link = EnvConnection(conn, f"env-remote{index}", self._why_lost)

    def _why_lost(self) -> str:
        host, port, pid = self.address
        return f"environment worker {self.index} ({host}:{port}, pid {pid}) closed its connection (died?)"

    @property
    def alive(self) -> bool:
        return not self.link.lost

    def request(self, request_id: int, op: str, episode: str, payload: Any) -> cf.Future:
        return self.link.request(request_id, op, episode, payload)

    def expect(self, episode: str) -> cf.Future:
        return self.link.expect(episode)

    def forget(self, episode: str) -> None:
        self.link.forget(episode)

    def stop(self) -> None:
        self.link.close()
        self.link.fail_all()


def _connect(home: EnvHome, index: int, wait_s: float, avoid: Address | None) -> tuple[Address, Connection]:
    """((host, port, pid), connection) of worker `index`, waiting for its file and its port;
    `avoid`: the address of a worker that died (its restart writes a new one)."""
    path = address_path(home.directory, index)
    deadline = time.monotonic() + wait_s
    last = "no address file yet"
    while True:
        try:
            info = json.loads(path.read_text())
            address = (info["host"], int(info["port"]), int(info["pid"]))
            if address != avoid:
                return address, Client(address[:2], family="AF_INET", authkey=bytes.fromhex(home.token))
            last = "it has not been restarted yet"
        except AuthenticationError:
            raise EnvFailure(f"environment worker {index} at {address[0]}:{address[1]} refused the run's token "
                             f"(another run's worker? {path})") from None
        except (OSError, ValueError, KeyError) as err:
            last = f"{type(err).__name__}: {err}" if path.exists() else "no address file yet"
        if time.monotonic() > deadline:
            raise EnvFailure(f"environment worker {index} unreachable within {wait_s:g} s ({path}: {last}); "
                             "is the env component running? (its log: env_worker<i>.out in the job's logs)")
        time.sleep(0.2)


def remote_starter(home: EnvHome, reconnect_s: float) -> Callable[[int], RemoteWorker]:
    """`ProcessEnvRunner`'s start function: connect at first, and reconnect to a restarted worker."""
    links: dict[int, RemoteWorker] = {}

    def start(index: int) -> RemoteWorker:
        old = links.get(index)
        link = RemoteWorker(index, home) if old is None else RemoteWorker(index, home, reconnect_s, old.address)
        links[index] = link
        return link

    return start


def node_host() -> str:
    """The name other nodes reach this one by: `VERL_HPC_ENV_HOST`, else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def _write_address(directory: Path, index: int, port: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    host = node_host()
    path = address_path(directory, index)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"host": host, "port": port, "pid": os.getpid(), "at": time.time()}))
    os.replace(tmp, path)  # readers never see half a file


def serve(directory: Path, index: int, spec: dict[str, Any], token: str) -> None:
    """One worker: listen on a port of this node, announce it, answer every connection."""
    import threading

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # see `supervise`: the step in progress still needs us
    listener = Listener(("", 0), family="AF_INET", authkey=bytes.fromhex(token))
    pool = cf.ThreadPoolExecutor(max_workers=int(spec.get("threads", 16)), thread_name_prefix="env")
    _write_address(directory, index, listener.address[1])
    print(f"verl-hpc env worker {index}: pid {os.getpid()} on port {listener.address[1]}", flush=True)
    while True:
        try:
            conn = listener.accept()
        except (OSError, EOFError) as err:  # a wrong key (AuthenticationError) or a dropped handshake
            print(f"verl-hpc env worker {index}: refused a connection: {type(err).__name__}: {err}", flush=True)
            continue
        if spec["source"] == "verifiers":  # the rollout opens a verifiers driver on this node
            from verl_hpc.roles.env.verifiers_process import serve_driver_connection

            log_path = directory.parent.parent / "logs" / f"verifiers_driver_env{index}.log"
            threading.Thread(target=serve_driver_connection, args=(conn, spec, log_path), daemon=True).start()
            continue
        threading.Thread(target=serve_connection, args=(conn, spec, pool), daemon=True).start()


def supervise(run_dir: Path, index: int, command: list[str], environ: dict[str, str]) -> int:
    """Run `command` (the worker) and start it again whenever it dies, until SIGINT.

    SIGTERM does not stop it: Slurm sends it to every task at once (`scontrol requeue`, scancel,
    the time limit), and the trainer then finishes its step and saves, which needs the
    environments of that step's episodes. The job script ends this step once training is over,
    and Slurm's SIGKILL follows any SIGTERM after KillWait."""
    stopping: list[int] = []
    child: list[subprocess.Popen] = []

    def stop(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, lambda *_: print(f"verl-hpc env worker {index}: SIGTERM; serving on while "
                                                   "training finishes its step", flush=True))
    starts: list[float] = []
    while not stopping:
        starts = [t for t in starts if time.monotonic() - t < RESTART_WINDOW_S] + [time.monotonic()]
        if len(starts) > RESTART_LIMIT:
            print(f"verl-hpc env worker {index}: died {RESTART_LIMIT} times within {RESTART_WINDOW_S:g} s; "
                  "giving up (its episodes fail: env/failures)", flush=True)
            return 1
        child[:] = [subprocess.Popen(command, env=environ)]
        code = _wait(child[0])
        if not stopping:
            print(f"verl-hpc env worker {index}: exited with code {code}; starting it again", flush=True)
            time.sleep(0.5)
    return 0


def _wait(process: subprocess.Popen) -> int:
    """The child's exit code; a signal handler's interruption is not its exit."""
    while True:
        try:
            return process.wait()
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for old interpreters
            continue


def worker_spec(cfg: Any) -> dict[str, Any]:
    """What a worker needs of the config: the environment and its threads."""
    from verl_hpc.roles.env.sources import env_spec

    return env_spec(cfg.rollout.multi_turn.environment)


def main(argv: list[str]) -> int:
    """`python -m verl_hpc.roles.env.remote RUN_DIR`: one task of the env component (its supervisor)."""
    from verl_hpc.config import load_config
    from verl_hpc.transport.secret import read_run_secret

    run_dir = Path(argv[0])
    index = int(os.environ.get("SLURM_PROCID", "0"))
    home = EnvHome.of_attempt(run_dir, 0, read_run_secret(run_dir), 0.0)
    if len(argv) > 1 and argv[1] == "--serve":
        serve(home.directory, index, worker_spec(load_config(run_dir / "config.yaml")), home.token)
        return 0
    command = [sys.executable, "-m", "verl_hpc.roles.env.remote", str(run_dir), "--serve"]
    return supervise(run_dir, index, command, dict(os.environ))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
