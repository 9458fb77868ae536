"""verifiers environments trained on: their harness drives each episode, our engine samples every turn.

Why this shape (`source: verifiers`): verifiers inverts control, so the rollout cannot step it the way
it steps a TextArena game. Instead, once per run, the rollout serves its own engine at vLLM's
token-level endpoint (`roles/rollout/serve.py`, on a free local port, behind a token of its own) and
starts `roles/env/verifiers_driver.py` under verifiers' Python, which loads the environment exactly
as `vf-eval` would. Each row of a step is one request (its task: `extra_info.env_seed`, else the
row's index, modulo the taskset's size); each answer is the episode verifiers recorded, whose trace
becomes the row's trajectory (`verifiers_trace.py`). A driver that dies, hangs or answers garbage
costs the episodes it held (re-run up to `max_retries`, counted in `env/failures`) and is started
again; the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
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
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.agent.episode import Episode, agent_metrics, episodes_batch
from verl_hpc.roles.agent.verifiers_trace import failed_episode, trace_episode
from verl_hpc.roles.env.base import EnvFailure
from verl_hpc.utils.fs import expand_path

log = logging.getLogger(__name__)
FIELD = "rollout.multi_turn.environment"
DEFAULT_PYTHON = "~/.cache/verl-hpc/verifiers-0.4.0/bin/python"  # where tools/verifiers_ref.sh installs it
DRIVER = Path(__file__).resolve().parent.parent / "env" / "verifiers_driver.py"
TOKEN_VAR = "VERL_HPC_GENERATE_TOKEN"


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
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start it and wait for its `ready` line (the taskset loaded, the tool servers up)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as err:
            # A session of its own: stopping it stops the harnesses and tool servers it started too
            # Its venv's bin first: verifiers' harnesses and tool servers run under the uv installed there
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
            held, self.pending = [f for f in self.pending.values()], {}
        for future in held:
            if not future.done():
                future.set_exception(failure)

    def submit(self, rid: str, task: int, sampling: dict[str, Any]) -> Future:
        if not self.alive():
            if self.proc is not None:
                log.warning("verifiers driver exited (%s); starting it again", self.proc.returncode)
            self.start()
        future: Future = Future()
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


def task_of(extra_info: str | None, index: int) -> int:
    """A row's task: `extra_info.env_seed`, else the row's index (the driver takes it modulo the taskset)."""
    info = json.loads(extra_info) if extra_info else {}
    seed = info.get("env_seed") if isinstance(info, dict) else None
    return int(index if seed is None else seed)


def episode_trace(episode: dict[str, Any]) -> dict[str, Any]:
    """The trace to train on of a verifiers episode (its first agent's), or EnvFailure saying why none."""
    traces = episode.get("traces") or []
    if not episode.get("ok", True) or not traces:
        errors = episode.get("errors") or ["no trace"]
        raise EnvFailure(f"verifiers reported the episode failed: {str(errors)[:300]}")
    return traces[0]


class VerifiersRollout:
    """The run's verifiers environment: `rows(...)` runs a step's rows as verifiers episodes against
    this process's engine; the interface is AgentRollout's, so every placement that runs one runs this."""

    def __init__(self, multi_turn: Any, engine: Any, model_dir: str, eot_ids: list[int],
                 max_context: int | None, run_dir: str | None):
        from verl_hpc.roles.rollout.serve import GenerateServer, ServedModel

        self.cfg, self.env = multi_turn, multi_turn.environment
        options = VerifiersOptions.of(self.env.kwargs)
        python = options.interpreter()
        self.fill_id = int(eot_ids[0])
        token = secrets.token_urlsafe(24)
        served = ServedModel(model_dir, max_context, multi_turn.max_tokens_per_turn or 256)
        self.server = GenerateServer(engine, served, list(eot_ids), token=token, owns_engine=False).start()
        log_path = Path(run_dir or ".") / "logs" / "verifiers_driver.log"
        self.traces_path = Path(run_dir or ".") / "verifiers" / "traces.jsonl" if options.keep_traces else None
        self.driver = VerifiersDriver(driver_argv(python, self.env.id, options, model_dir, self.server.url), token,
                                      log_path, options.startup_seconds)
        self.driver.start()
        self.last_episodes: list[Episode] = []
        log.info("verifiers environment %s: %d task(s), episodes against %s", self.env.id, self.driver.tasks,
                 self.server.url)

    def sampling(self, sampling: Any) -> dict[str, Any]:
        """Each model call's sampling, as verifiers sends it on: the run's, one turn's tokens at most."""
        return {"temperature": sampling.temperature, "top_p": sampling.top_p,
                "max_tokens": self.cfg.max_tokens_per_turn or sampling.max_new_tokens}

    def run(self, keys: list[tuple[int, int, int]], tasks: list[int], sampling: Any, version: int) -> list[Episode]:
        """Every episode in flight at once; one that fails or outlasts `timeout_seconds` is a failed row."""
        params = self.sampling(sampling)
        names = [Episode(key, [], []).name for key in keys]
        futures = [self.driver.submit(name, task, params) for name, task in zip(names, tasks, strict=True)]
        deadline = time.monotonic() + self.env.timeout_seconds
        episodes = []
        for key, name, future in zip(keys, names, futures, strict=True):
            try:
                answer = future.result(max(0.0, deadline - time.monotonic()))
                self.keep(name, version, answer)
                episode = trace_episode(key, episode_trace(answer), version)
            except FutureTimeout:
                self.driver.cancel(name)
                episode = failed_episode(key, f"no answer within {self.env.timeout_seconds:g} s", self.fill_id)
            except EnvFailure as err:
                log.warning("verifiers episode %s failed: %s", name, err)
                episode = failed_episode(key, str(err), self.fill_id)
            episodes.append(episode)
        return episodes

    def keep(self, name: str, version: int, answer: dict[str, Any]) -> None:
        """An episode as verifiers recorded it, appended to `traces.jsonl` (`keep_traces`): its own tools read it."""
        if self.traces_path is None:
            return
        self.traces_path.parent.mkdir(parents=True, exist_ok=True)
        with self.traces_path.open("a") as out:
            out.write(json.dumps({"row": name, "policy_version": version, "episode": answer}) + "\n")

    def rows(self, step: int, groups: list[int], samples: list[int], prompt_index: list[int], dataset: Any,
             sampling: Any, version: int, keep: bool = True) -> RolloutBatch:
        """The step's rows as verifiers episodes (failed ones re-run up to `max_retries`), unscored."""
        keys = [(step, g, s) for g, s in zip(groups, samples, strict=True)]
        tasks = [task_of(dataset.extra_infos[i], i) for i in prompt_index]
        episodes = self.run(keys, tasks, sampling, version)
        for _ in range(self.env.max_retries):
            failed = [i for i, e in enumerate(episodes) if e.env_failed]
            if not failed:
                break
            log.warning("re-running %d verifiers episode(s) that failed", len(failed))
            again = self.run([keys[i] for i in failed], [tasks[i] for i in failed], sampling, version)
            for i, episode in zip(failed, again, strict=True):
                episode.env_retries = episodes[i].env_retries + 1
                episodes[i] = episode
        if keep:
            self.last_episodes = episodes
        return episodes_batch(episodes, step, groups, samples, list(prompt_index), dataset, version)

    def metrics(self) -> dict[str, float]:
        """`agent/*` of the latest step's episodes."""
        return agent_metrics(self.last_episodes)

    def close(self) -> None:
        self.driver.stop()
        self.server.close()
