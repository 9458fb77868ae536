"""CPU workers forked from one process that has already imported torch and transformers.

Why: a worker spends 5-8 s of CPU importing torch, torch.distributed and transformers before
it joins the world (measured: three quarters of the CPU of a 5-step, 4-process run of
configs/quickstart_split.yaml). A fork server imports them once; every worker is a fork of it
with its own environment, session (process group) and log file, as `subprocess.Popen` gives
the launcher otherwise. torch and transformers start no thread on import, so the fork is
safe; the server itself never starts one either.

Used only for plans whose every group runs on the CPU: a GPU worker's CUDA_VISIBLE_DEVICES
must be read by a process that has not touched CUDA's libraries yet, so those stay fresh
processes. `VERL_HPC_FORK_WORKERS=0` turns it off.

The server (`python -m verl_hpc.launch.forkserver [MODULE ...]`, the modules to preload) speaks
JSON lines: on its stdin a request `{"env": {...}, "log": path, "module": name}`, on its
stdout `{"pid": N}` for each, then `{"exit": N, "code": C}` when that worker ends (C as
`Popen.returncode`: negative for a signal). It exits when its stdin closes and every
worker it forked is gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

FORK_ENV = "VERL_HPC_FORK_WORKERS"
WORKER_MODULE = "verl_hpc.runtime.worker"
# What every worker imports before its first step (the server imports them once for all).
# The worker module itself is left out: runpy runs it fresh in each child, as `python -m` would.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "transformers",
           "transformers.modeling_utils", "pyarrow", "pyarrow.flight", "verl_hpc.config",
           "verl_hpc.runtime.lifecycle", "verl_hpc.runtime.placement")
_PR_SET_PDEATHSIG = 1


def forking_wanted(device_types: set[str], command: list[str], env: dict[str, str]) -> bool:
    """Fork workers when every group is on the CPU, the command is the runtime's worker and the
    environment does not turn it off."""
    return (device_types <= {"cpu"} and command[1:] == ["-m", WORKER_MODULE]
            and env.get(FORK_ENV, "1") not in ("0", "false", "no"))


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _set_pdeathsig(parent_pid: int) -> None:
    """Die with the parent (SIGKILL from the kernel); die now if it is already gone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _apply_thread_count(env: dict[str, str]) -> None:
    """OpenMP read OMP_NUM_THREADS when the server imported torch, so a fork would keep the server's
    count whatever the worker's environment says; set the worker's own (the launcher's cores // ranks)."""
    threads = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _fork_worker(request: dict, server_pid: int) -> int:
    """Fork a worker and return its pid once it leads its own session.

    The launcher signals a worker's process group (`killpg(pid)`) the moment it learns the pid; a
    pid reported before the child's `setsid` names no group yet, so the server waits for the child
    to close its end of a pipe after `setsid` (or to die, which closes it too).
    """
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_read)
        os.setsid()
        os.close(ready_write)
        _become_worker(request, server_pid)
    os.close(ready_write)
    os.read(ready_read, 1)  # b"" once the child closed its end
    os.close(ready_read)
    return pid


def _become_worker(request: dict, server_pid: int) -> None:
    """In the forked child, already in its own session: the worker's environment and log file, then its main.

    It never returns to the server's loop: the worker's `sys.exit` (or an error) unwinds the
    child's stack to the interpreter's own exit, so a failing worker finalizes as a fresh
    process would (atexit, logging) and a finished one leaves by `os._exit` as before.
    """
    _set_pdeathsig(server_pid)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    _apply_thread_count(request["env"])
    import runpy

    sys.argv = [request["module"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve(preload: tuple[str, ...] = PRELOAD, stdin: int = 0, stdout: int = 1) -> int:
    """The server's loop: fork on each request, report each worker's end; one thread throughout."""
    for name in preload:
        __import__(name)
    me, children, pending, closed = os.getpid(), set(), b"", False
    out = os.fdopen(stdout, "w", buffering=1)
    while not closed or children:
        readable, _, _ = select.select([] if closed else [stdin], [], [], 0.05)
        if readable:
            chunk = os.read(stdin, 65536)
            closed = not chunk
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = _fork_worker(json.loads(line), me)
                children.add(pid)
                out.write(json.dumps({"pid": pid}) + "\n")
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                out.write(json.dumps({"exit": pid, "code": _returncode(status)}) + "\n")
    return 0


class ForkServer:
    """The launcher's end: start the server, ask it for workers, learn how they end."""

    def __init__(self, env: dict[str, str], preexec_fn=None, module: str = WORKER_MODULE,  # noqa: ANN001
                 preload: tuple[str, ...] = PRELOAD):
        self.module = module
        self.proc = subprocess.Popen([sys.executable, "-m", "verl_hpc.launch.forkserver", *preload], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=preexec_fn,
                                     start_new_session=True)  # a Ctrl-C reaches the launcher only
        self.codes: dict[int, int] = {}
        self._buffer = b""
        os.set_blocking(self.proc.stdout.fileno(), False)  # type: ignore[union-attr]

    def spawn(self, env: dict[str, str], log_path: Path, timeout: float = 600.0) -> ForkedWorker:
        """A new worker with `env`, appending to `log_path`; waits while the server still imports."""
        request = json.dumps({"env": env, "log": str(log_path), "module": self.module}) + "\n"
        self.proc.stdin.write(request.encode())  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while True:
            for message in self._read(0.1):
                if "pid" in message:
                    return ForkedWorker(message["pid"], self)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker fork server exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker fork server did not fork a worker in {timeout:.0f} s")

    def pump(self) -> None:
        """Take in every exit the server has reported so far."""
        for _ in self._read(0.0):
            pass

    def _read(self, wait: float) -> list[dict]:
        """Messages available now (waiting up to `wait` s for the first); exits are recorded."""
        stream = self.proc.stdout
        select.select([stream], [], [], wait)
        try:
            chunk = os.read(stream.fileno(), 65536)  # type: ignore[union-attr]
        except BlockingIOError:
            chunk = b""
        self._buffer += chunk
        messages = []
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.codes[message["exit"]] = message["code"]
            messages.append(message)
        return messages

    def close(self, timeout: float = 30.0) -> None:
        """No more workers: the server exits once the ones it forked are gone."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedWorker:
    """What the launcher uses of `subprocess.Popen`, for a worker the fork server started."""

    def __init__(self, pid: int, server: ForkServer):
        self.pid, self._server = pid, server

    @property
    def returncode(self) -> int | None:
        return self._server.codes.get(self.pid)

    def poll(self) -> int | None:
        if self.pid not in self._server.codes:
            self._server.pump()
            if self.pid not in self._server.codes and self._server.proc.poll() is not None:
                self._server.codes[self.pid] = -int(signal.SIGKILL)  # the server died: so did its workers
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(serve(tuple(sys.argv[1:])))
