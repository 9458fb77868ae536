"""One agent episode: the token sequence the trainer will score, built turn by turn, and its record.

Why the sequence is kept as ids and never as text: every id in `response_ids` is either one the
engine sampled (`loss_mask` 1, with the engine's logprob) or one of the template text inserted
between turns (`loss_mask` 0, logprob 0); nothing is ever re-tokenised, so the trainer scores
exactly what was sampled. The message list is the same conversation in readable form, for the
reward (`extra_info["messages"]`) and for the `template_mismatch` check.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.data.trajectory import episode_counts, episode_metrics


@dataclass
class Episode:
    """An episode in flight; `done` once it answered, ran out of turns or budget, or failed."""

    key: tuple[int, int, int]            # (step, group, sample): unique within a run
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_bounds: list[int] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    tool_log: list[dict[str, Any]] = field(default_factory=list)
    model_tokens: int = 0
    assistant_turns: int = 0
    tool_turns: int = 0
    tool_rewards: float = 0.0
    has_env: bool = False      # an environment answers this episode's turns (roles/env)
    env_reward: float = 0.0    # the environment's rewards so far
    env_steps: int = 0
    env_seconds: float = 0.0
    env_done: bool = False     # the environment said the episode is over
    env_failed: bool = False   # the environment raised, hung or answered garbage: counted in env/failures
    env_retries: int = 0       # earlier runs of this episode that its environment failed (re-run since)
    done: bool = False
    finished: bool = False     # the last turn ended with the end-of-turn token and asked for no tool
    truncated: bool = False    # stopped by a budget (turns, tokens, length) while it had more to do
    final_answer: str = ""
    last_close: str = ""       # the text of the end-of-turn token the last turn sampled ('' if none)
    template_mismatch: bool = False
    pending: Future | None = None

    @property
    def name(self) -> str:
        return "episode-{}-{}-{}".format(*self.key)

    def context(self) -> list[int]:
        """What the engine continues from: the prompt and every token so far."""
        return [*self.prompt_ids, *self.response_ids]

    def add_sampled(self, ids: list[int], logprobs: list[float], version: int) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.loss_mask.extend([1] * len(ids))
        self.turn_bounds.extend([start, len(self.response_ids)])
        self.turn_versions.append(int(version))
        self.model_tokens += len(ids)
        self.assistant_turns += 1

    def add_inserted(self, ids: list[int]) -> None:
        self.response_ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.loss_mask.extend([0] * len(ids))

    def end(self, finished: bool, truncated: bool) -> None:
        self.done, self.finished, self.truncated = True, finished, truncated

    def record(self) -> dict[str, Any]:
        """The `trajectory` column's JSON: what the reward and the samples view read."""
        return {"messages": self.messages, "tool_calls": self.tool_log, "final_answer": self.final_answer,
                "finished": self.finished, "truncated": self.truncated, "num_turns": self.assistant_turns,
                "tool_rewards": self.tool_rewards, "template_mismatch": self.template_mismatch,
                "has_env": self.has_env, "env_reward": self.env_reward, "env_steps": self.env_steps,
                "env_seconds": self.env_seconds,
                "env_done": self.env_done, "env_failed": self.env_failed, "env_retries": self.env_retries}

    def record_json(self) -> str:
        return json.dumps(self.record(), default=str)


def trajectory_columns(episodes: list[Episode]) -> dict[str, list[Any]]:
    """`RolloutBatch.from_generation(trajectory=...)`'s columns for these episodes, in order."""
    return {"loss_mask": [e.loss_mask for e in episodes], "turn_bounds": [e.turn_bounds for e in episodes],
            "turn_versions": [e.turn_versions for e in episodes],
            "trajectory": [e.record_json() for e in episodes]}


def episodes_batch(episodes: list[Episode], step: int, groups: list[int], samples: list[int],
                   prompt_index: list[int], dataset: Any, version: int) -> RolloutBatch:
    """A step's rows (row = group * n + sample) as one unscored trajectory batch, in order."""
    return RolloutBatch.from_generation(
        [e.prompt_ids for e in episodes], [e.response_ids for e in episodes], [e.logprobs for e in episodes],
        group_ids=groups, prompt_index=prompt_index, ground_truth=[dataset.answers[i] for i in prompt_index],
        policy_version=version, step=step, sample_index=samples,
        data_source=[dataset.data_sources[i] for i in prompt_index],
        extra_info=[dataset.extra_infos[i] for i in prompt_index], trajectory=trajectory_columns(episodes))


def agent_metrics(episodes: list[Episode]) -> dict[str, float]:
    """`agent/*` over one step's episodes (this process's)."""
    if not episodes:
        return {}
    return episode_metrics(*episode_counts([e.record() for e in episodes]))
