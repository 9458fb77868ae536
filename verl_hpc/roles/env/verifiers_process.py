"""The verifiers driver as a child process: started, fed episodes, stopped, started again when it dies.

Why a process of its own under another interpreter: see `verifiers_driver.py`, the script it runs.
Its wire is JSON lines on the child's stdin and stdout; each episode request gets a Future that
resolves to the episode verifiers recorded (a dict) or fails with `EnvFailure` - when the driver
answers an error, or dies (every episode it held fails at once, and the next `submit` starts it
again). It runs in a session of its own, so stopping it also stops the harnesses and tool servers
verifiers started under it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_hpc.config.errors import FieldError
from verl_hpc.roles.env.base import EnvFailure
from verl_hpc.roles.env.sources import ENV_FIELD as FIELD
from verl_hpc.utils.fs import expand_path

log = logging.getLogger(__name__)

DEFAULT_PYTHON = "~/.cache/verl-hpc/verifiers-0.4.0/bin/python"  # where tools/verifiers_ref.sh installs it
DRIVER = Path(__file__).resolve().parent / "verifiers_driver.py"
TOKEN_VAR = "VERL_HPC_GENERATE_TOKEN"
RESTART_PAUSE_S = 60.0  # after a failed restart, episodes fail at once for this long instead of each waiting


@dataclass(frozen=True)
class VerifiersOptions:
    """`environment.kwargs` of a verifiers environment: its interpreter, vf-eval's flags, start-up limit."""

    python: str = DEFAULT_PYTHON
    args: tuple[str, ...] = ()
    startup_seconds: float = 300.0
    keep_traces: bool = False  # every episode as verifiers recorded it, in <run_dir>/verifiers/traces.jsonl

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> VerifiersOptions:
        unknown = sorted(set(kwargs) - {"python", "args", "startup_seconds", "keep_traces"})
        if unknown:
            raise FieldError(f"{FIELD}.kwargs", f"{', '.join(unknown)}: not a verifiers option",
                             "python (verifiers' interpreter), args (vf-eval's flags, a list), startup_seconds, "
                             "keep_traces")
        args = kwargs.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
            raise FieldError(f"{FIELD}.kwargs.args", f"{args!r} is not a list of flags",
                             "e.g. [--env.agent.harness.id, 'null', --client.renderer.name, custom]")
        return cls(str(kwargs.get("python", DEFAULT_PYTHON)), tuple(str(a) for a in args),
                   float(kwargs.get("startup_seconds", 300.0)), bool(kwargs.get("keep_traces", False)))

    def interpreter(self) -> Path:
        """verifiers' Python, refused in one line if it is not there or has no verifiers."""
        python = expand_path(self.python)
        probe = subprocess.run([str(python), "-c", "import verifiers.v1"], capture_output=True, text=True,
                               timeout=120) if python.is_file() else None
        if probe is None or probe.returncode != 0:
            why = "does not exist" if probe is None else f"cannot import verifiers.v1 ({probe.stderr.strip()[-200:]})"
            raise FieldError(f"{FIELD}.kwargs.python", f"{python} {why}",
                             "install verifiers into a venv of its own (bash tools/verifiers_ref.sh) and name "
                             "its bin/python here")
        return python


def driver_argv(python: Path, env_id: str, options: VerifiersOptions, model: str, url: str) -> list[str]:
    """The driver's command line: vf-eval's flags, pointed at our endpoint (pure)."""
    return [str(python), str(DRIVER), env_id, *options.args, "-m", model, "--client.type", "train",
            "--client.base-url", f"{url}/v1", "--client.api-key-var", TOKEN_VAR]


class VerifiersDriver:
    """The driver child: `submit` an episode -> a Future of verifiers' episode (a dict); restarted
    on the next `submit` once it has died."""

    def __init__(self, argv: list[str], token: str, log_path: Path, startup_seconds: float):
        self.argv, self.token, self.log_path, self.startup_seconds = argv, token, log_path, startup_seconds
        self.proc: subprocess.Popen | None = None
        self.pending: dict[str, Future] = {}
        self.tasks = 0
        self.starts = 0
        self.failed_start = -RESTART_PAUSE_S  # when a restart last failed (monotonic)
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start it and wait for its `ready` line (the taskset loaded, the tool servers up)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as err:
            # Its venv's bin first: verifiers' harnesses and tool servers run under the uv installed there;
            # a session of its own: stopping it stops what it started too
            path = os.pathsep.join([str(Path(self.argv[0]).parent), os.environ.get("PATH", "")])
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, env={**os.environ, TOKEN_VAR: self.token, "PATH": path},
                                         start_new_session=True)
        self.starts += 1
        ready: Future = Future()
        threading.Thread(target=self._read, args=(self.proc, ready), daemon=True, name="verifiers-driver").start()
        try:
            self.tasks = int(ready.result(timeout=self.startup_seconds)["tasks"])
        except (FutureTimeout, EnvFailure, KeyError, TypeError, ValueError) as err:
            self.stop()
            tail = self.log_path.read_text()[-1500:] if self.log_path.is_file() else ""
            raise FieldError(f"{FIELD}.id", f"verifiers could not load the environment ({err or 'no answer'}): "
                             f"{tail.strip()[-800:]}", f"see {self.log_path}; the same flags must work "
                             "with vf-eval") from None
        if self.tasks < 1:
            raise FieldError(f"{FIELD}.id", "the taskset has no task", "check the environment's taskset")

    def _read(self, proc: subprocess.Popen, ready: Future) -> None:
        """Answers to their futures; when the driver ends, every episode it held fails."""
        for line in proc.stdout:  # type: ignore[union-attr]
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                log.warning("verifiers driver: not a wire line: %s", line[:200])
                continue
            if answer.get("ready"):
                ready.set_result(answer)
                continue
            with self.lock:
                future = self.pending.pop(str(answer.get("id")), None)
            if future is None:
                continue
            if "episode" in answer and isinstance(answer["episode"], dict):
                future.set_result(answer["episode"])
            else:
                future.set_exception(EnvFailure(str(answer.get("error") or "the driver answered no episode")))
        code = proc.wait()
        failure = EnvFailure(f"the verifiers driver exited ({code}); see {self.log_path}")
        if not ready.done():
            ready.set_exception(failure)
        with self.lock:
            held, self.pending = list(self.pending.values()), {}
        for future in held:
            if not future.done():
                future.set_exception(failure)

    def submit(self, rid: str, task: int, sampling: dict[str, Any]) -> Future:
        """The episode's Future; when the driver cannot be started again, it fails (the episode, not the run)."""
        future: Future = Future()
        if not self.alive():
            if self.proc is not None:
                log.warning("verifiers driver exited (%s); starting it again", self.proc.returncode)
            if time.monotonic() - self.failed_start < RESTART_PAUSE_S:  # it just failed: don't wait on it again
                future.set_exception(EnvFailure(f"the verifiers driver could not start again ({self.log_path})"))
                return future
            try:
                self.start()
            except FieldError as err:
                self.failed_start = time.monotonic()
                future.set_exception(EnvFailure(f"the verifiers driver could not start again: {err}"))
                return future
        with self.lock:
            self.pending[rid] = future
        try:
            self.proc.stdin.write(json.dumps({"id": rid, "task": task, "sampling": sampling}) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError as err:
            with self.lock:
                self.pending.pop(rid, None)
            future.set_exception(EnvFailure(f"the verifiers driver is gone: {err}"))
        return future

    def cancel(self, rid: str) -> None:
        with self.lock:
            self.pending.pop(rid, None)
        if self.alive():
            try:
                self.proc.stdin.write(json.dumps({"cancel": rid}) + "\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what it started and left behind
        self.proc.wait()


def serve_driver_connection(conn: Any, spec: dict[str, Any], log_path: Path) -> None:
    """A rollout's link to this env worker (`remote.serve`): its `open` starts a driver here against
    the rollout's endpoint, then each `episode` request is answered with the episode verifiers recorded
    (`(request_id, "ok", episode)` or `(request_id, "error", why)`), in any order. The driver stops
    when the link closes."""
    options = VerifiersOptions.of(dict(spec.get("kwargs") or {}))
    driver: VerifiersDriver | None = None
    lock = threading.Lock()

    def send(request_id: int, status: str, payload: Any) -> None:
        with lock, contextlib.suppress(OSError, ValueError):
            conn.send((request_id, status, payload))

    def answer(request_id: int, future: Future) -> None:
        error = future.exception()
        send(request_id, "error" if error else "ok", str(error) if error else future.result())

    try:
        while True:
            try:
                request_id, op, episode, payload = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if op == "open":
                    if driver is not None:
                        driver.stop()
                    argv = driver_argv(options.interpreter(), spec["id"], options, payload["model"], payload["url"])
                    driver = VerifiersDriver(argv, payload["token"], log_path, options.startup_seconds)
                    driver.start()
                    send(request_id, "ok", driver.tasks)
                elif driver is None:
                    send(request_id, "error", f"{op}: no driver is open on this worker")
                elif op == "episode":
                    future = driver.submit(episode, int(payload["task"]), dict(payload["sampling"]))
                    future.add_done_callback(lambda done, rid=request_id: answer(rid, done))
                elif op == "cancel":
                    driver.cancel(episode)
                    send(request_id, "ok", None)
            except FieldError as err:  # the driver could not (re)start here: said, the link stays
                send(request_id, "error", str(err))
    finally:
        if driver is not None:
            driver.stop()
