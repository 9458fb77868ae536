"""verifiers environments trained on: their harness drives each episode, our engine samples every turn.

Why this shape (`source: verifiers`): verifiers inverts control, so the rollout cannot step it the way
it steps a TextArena game. Instead, once per run, the rollout serves its own engine at vLLM's
token-level endpoint (`roles/rollout/serve.py`, behind a token of its own) and starts verifiers'
driver (`roles/env/verifiers_process.py`) under verifiers' Python, here or on each worker of the
Slurm env component (`resources.env`, `roles/env/verifiers_remote.py`); it loads the environment
exactly as `vf-eval` would. Each row of a step is one episode (its task: `extra_info.env_seed`,
else the row's index, modulo the taskset's size); each answer is the episode verifiers recorded,
whose trace becomes the row's trajectory (`verifiers_trace.py`). A driver that dies, hangs or
answers garbage costs the episodes it held (re-run up to `max_retries`, counted in
`env/failures`) and is started again; the run goes on.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.agent.episode import Episode, agent_metrics, episodes_batch
from verl_hpc.roles.agent.verifiers_trace import failed_episode, trace_episode
from verl_hpc.roles.env.base import EnvFailure
from verl_hpc.roles.env.verifiers_process import VerifiersDriver, VerifiersOptions, driver_argv

log = logging.getLogger(__name__)


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
                 max_context: int | None, run_dir: str | None, env_home: Any = None):
        from verl_hpc.roles.rollout.serve import GenerateServer, ServedModel

        self.cfg, self.env = multi_turn, multi_turn.environment
        options = VerifiersOptions.of(self.env.kwargs)
        self.fill_id = int(eot_ids[0])
        token = secrets.token_urlsafe(24)
        served = ServedModel(model_dir, max_context, multi_turn.max_tokens_per_turn or 256)
        host = "127.0.0.1" if env_home is None else "0.0.0.0"  # env nodes reach it over the network
        self.server = GenerateServer(engine, served, list(eot_ids), host=host, token=token, owns_engine=False).start()
        run = Path(run_dir or ".")
        self.traces_path = run / "verifiers" / "traces.jsonl" if options.keep_traces else None
        self.driver = self.drivers(options, model_dir, token, run, env_home)
        self.driver.start()
        self.last_episodes: list[Episode] = []
        log.info("verifiers environment %s: %d task(s), episodes against %s", self.env.id, self.driver.tasks,
                 self.server.url)

    def drivers(self, options: VerifiersOptions, model_dir: str, token: str, run: Path, env_home: Any) -> Any:
        """One driver beside this engine, or one on each worker of the env component (`env_home`)."""
        if env_home is None:
            argv = driver_argv(options.interpreter(), self.env.id, options, model_dir, self.server.url)
            return VerifiersDriver(argv, token, run / "logs" / "verifiers_driver.log", options.startup_seconds)
        from verl_hpc.roles.env.remote import node_host
        from verl_hpc.roles.env.verifiers_remote import RemoteVerifiers

        url = f"http://{node_host()}:{self.server.httpd.server_address[1]}"
        return RemoteVerifiers(env_home, {"model": model_dir, "url": url, "token": token}, options.startup_seconds)

    def sampling(self, sampling: Any) -> dict[str, Any]:
        """Each model call's sampling, as verifiers sends it on (extra keys pass through to the endpoint):
        the run's, one turn's tokens at most."""
        params = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                  "max_tokens": self.cfg.max_tokens_per_turn or sampling.max_new_tokens}
        if getattr(sampling, "top_k", 0):
            params["top_k"] = sampling.top_k
        return params

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
                episode = failed_episode(key, f"no answer within {self.env.timeout_seconds:g} s (the step's episodes "
                                         "share rollout.multi_turn.environment.timeout_seconds)", self.fill_id)
            except (EnvFailure, KeyError, TypeError, ValueError, AttributeError) as err:  # garbage too
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
