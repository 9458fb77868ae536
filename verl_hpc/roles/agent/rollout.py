"""The trajectory rollout: a step's rows as agent episodes, returned as one Arrow rollout batch.

Why a role object built once per run: the tools are imported and checked, the chat template is
probed, the tool pool and its event loop started before the first step — a bad tool or a
template that cannot hold a tool conversation is refused before anything trains — and every
step reuses them. A placement asks it for rows exactly as it asks the engine for responses
(`rows(step, groups, samples, prompt_index, dataset, version)`), so any placement that runs an
engine can run episodes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.agent.episode import Episode, agent_metrics, episodes_batch
from verl_hpc.roles.agent.loop import AgentLoop
from verl_hpc.roles.agent.parsers import get_parser
from verl_hpc.roles.agent.render import ChatRenderer
from verl_hpc.roles.agent.tool_runner import ToolRunner
from verl_hpc.roles.agent.tools import load_tools
from verl_hpc.roles.env.runner import EnvCalls, EnvRunner
from verl_hpc.utils.fs import expand_path

log = logging.getLogger(__name__)
RECONNECT_S = 10.0  # how long a new episode waits for a remote environment worker its node is restarting


def tools_kwargs_of(extra_info: str | None) -> dict[str, Any]:
    """verl's per-row `extra_info.tools_kwargs` ({tool: {create_kwargs, execute_kwargs, ...}})."""
    if not extra_info:
        return {}
    info = json.loads(extra_info)
    found = info.get("tools_kwargs") if isinstance(info, dict) else None
    return found if isinstance(found, dict) else {}


def env_start(extra_info: str | None, index: int) -> tuple[int | None, dict[str, Any]]:
    """(seed, reset kwargs) of a row's environment: `extra_info.env_seed` (else the row's index) and
    `extra_info.env_kwargs`."""
    info = json.loads(extra_info) if extra_info else {}
    info = info if isinstance(info, dict) else {}
    seed = info.get("env_seed", index)
    kwargs = info.get("env_kwargs")
    return (None if seed is None else int(seed)), (dict(kwargs) if isinstance(kwargs, dict) else {})


def env_runner(multi_turn: Any, num_workers: int | None = None, home: Any = None) -> EnvCalls | None:
    """The run's environment runner, with the class or game checked by building one now: threads of
    this process, `num_workers` worker processes it starts (default: the environment's own count),
    or the workers of the Slurm env component at `home` (a `remote.EnvHome`)."""
    env = multi_turn.environment
    if env is None:
        return None
    from verl_hpc.roles.env.sources import env_spec, make_environment

    make_environment(env.source, env.id, env.kwargs, env.action_wrappers).close()  # a bad id or class: refused before any step
    count = env.num_workers if num_workers is None else num_workers
    if home is not None or count > 0:
        from verl_hpc.roles.env.workers import ProcessEnvRunner

        if home is not None:
            from verl_hpc.roles.env.remote import remote_starter

            log.info("environment workers: %d of the env component (%s)", home.num_workers, home.directory)
            return ProcessEnvRunner(remote_starter(home, RECONNECT_S), home.num_workers, env.timeout_seconds,
                                    env.players, env.workers)
        return ProcessEnvRunner.local(env_spec(env), count, env.timeout_seconds)
    if env.players == 2:  # self-play: both seats of each match in threads here
        from verl_hpc.roles.env.match import MatchRunner

        return MatchRunner(env.id, env.kwargs, env.workers, env.timeout_seconds, env.action_wrappers)
    return EnvRunner(lambda: make_environment(env.source, env.id, env.kwargs, env.action_wrappers), env.workers,
                     env.timeout_seconds)


def checked_renderer(multi_turn: Any, tokenizer: Any, schemas: list[dict[str, Any]]) -> ChatRenderer:
    """The run's chat template (`chat_template`, else the tokenizer's) over these tools, refused in
    one line if it cannot hold a tool conversation (with no tools: a conversation of user turns)."""
    template = None
    if multi_turn.chat_template is not None:
        template = expand_path(multi_turn.chat_template).read_text()
    renderer = ChatRenderer(tokenizer, schemas, template, f"rollout.multi_turn.chat_template {multi_turn.chat_template}")
    if schemas:
        renderer.check_tool_capable()
    else:
        renderer.check_user_turns()
    return renderer


class AgentRollout:
    """Tools, template, parser and loop of a run; `rows(...)` samples a step's rows as episodes."""

    def __init__(self, multi_turn: Any, engine: Any, tokenizer: Any, eot_ids: list[int],
                 max_context: int | None = None, allocator: Any = None, envs: EnvCalls | None = None):
        self.cfg = multi_turn
        self.tools = load_tools(multi_turn)
        self.renderer = checked_renderer(multi_turn, tokenizer, self.tools.schemas)
        self.parser = get_parser(multi_turn.format)
        self.runner = ToolRunner(self.tools, multi_turn.tool_workers, multi_turn.tool_timeout_seconds,
                                 multi_turn.max_tool_response_length, multi_turn.tool_response_truncate_side,
                                 multi_turn.max_parallel_calls)
        self.envs = envs if envs is not None else env_runner(multi_turn)
        self.loop = AgentLoop(engine, tokenizer, self.renderer, self.parser, self.runner, multi_turn, eot_ids,
                              max_context, allocator, self.envs)
        self.last_episodes: list[Episode] = []
        log.info("multi-turn rollouts: tools %s, format %s, template: %s%s", ", ".join(self.tools.tools) or "none",
                 multi_turn.format, self.renderer.source,
                 "" if multi_turn.environment is None else
                 f", environment {multi_turn.environment.source}:{multi_turn.environment.id}")

    def episodes(self, step: int, groups: list[int], samples: list[int], prompts: list[Any],
                 extra_infos: list[str | None], indices: list[int] | None = None) -> list[Episode]:
        """New episodes; with an environment, each reset first (all at once; the samples of a row share its seed)."""
        firsts: list[Any] = [None] * len(prompts)
        if self.envs is not None:
            starts = [env_start(info, i) for info, i in zip(extra_infos, indices or range(len(prompts)), strict=True)]
            names = [Episode((step, g, s), [], []).name for g, s in zip(groups, samples, strict=True)]
            firsts = self.envs.reset_all([(n, seed, kw) for n, (seed, kw) in zip(names, starts, strict=True)])
        return [self.loop.start((step, g, s), prompt, tools_kwargs_of(info), first)
                for g, s, prompt, info, first in zip(groups, samples, prompts, extra_infos, firsts, strict=True)]

    def rows(self, step: int, groups: list[int], samples: list[int], prompt_index: list[int], dataset: Any,
             sampling: Any, version: int, keep: bool = True) -> RolloutBatch:
        """The step's rows (row = group * n + sample) as finished episodes, unscored; `keep`: their
        metrics are the step's (validation rows are not)."""
        prompts, infos = [dataset.prompts[i] for i in prompt_index], [dataset.extra_infos[i] for i in prompt_index]
        episodes = self.episodes(step, groups, samples, prompts, infos, list(prompt_index))
        self.loop.run(episodes, sampling, version)
        if self.cfg.environment is not None:
            self.rerun_failed(episodes, step, groups, samples, prompts, infos, list(prompt_index), sampling, version)
        if keep:
            self.last_episodes = episodes
        return episodes_batch(episodes, step, groups, samples, list(prompt_index), dataset, version)

    def rerun_failed(self, episodes: list[Episode], step: int, groups: list[int], samples: list[int],
                     prompts: list[Any], infos: list[Any], indices: list[int], sampling: Any, version: int) -> None:
        """Episodes whose environment failed, run again from a fresh reset, in place, up to
        `environment.max_retries` times: a crashed or hung environment costs a re-run, not a row
        of the group (GRPO's baseline needs every sample). The last failure stays, counted."""
        for _ in range(self.cfg.environment.max_retries):
            failed = [i for i, e in enumerate(episodes) if e.env_failed]
            if not failed:
                return
            log.warning("re-running %d episode(s) whose environment failed", len(failed))
            again = self.episodes(step, [groups[i] for i in failed], [samples[i] for i in failed],
                                  [prompts[i] for i in failed], [infos[i] for i in failed], [indices[i] for i in failed])
            self.loop.run(again, sampling, version)
            for i, episode in zip(failed, again, strict=True):
                episode.env_retries = episodes[i].env_retries + 1
                episodes[i] = episode

    def metrics(self) -> dict[str, float]:
        """`agent/*` of the latest step's episodes."""
        return agent_metrics(self.last_episodes)

    def close(self) -> None:
        self.runner.close()
        if self.envs is not None:
            self.envs.close()


class ToolRewardAdded:
    """A reward plus the rewards tools returned during each episode (`add_tool_rewards`)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def score(self, batch: RolloutBatch) -> Any:
        import torch

        base = self.inner.score(batch)
        if not batch.has("trajectory"):
            return base
        extra = [json.loads(t)["tool_rewards"] if t else 0.0 for t in batch.column("trajectory").to_pylist()]
        return base + torch.tensor(extra, dtype=base.dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
