"""Reading agent episodes back out of a rollout batch's `trajectory` column.

Why in the data layer: the reward (what `compute_score` sees), the step's `agent/*` metrics
and the samples view all read the same per-row record, wherever the rows are — beside the
engine, on a trainer rank, on a reward group — so none of them needs the agent role that
wrote it.
"""

from __future__ import annotations

import json
from typing import Any

from verl_hpc.data.rollout_batch import RolloutBatch

EMPTY_EPISODE: dict[str, Any] = {"final_answer": "", "finished": False}


def episode_records(batch: RolloutBatch) -> list[dict[str, Any]] | None:
    """Each row's episode record (messages, tool-call log, final answer, ...); None: single-turn rows."""
    if not batch.has("trajectory"):
        return None
    return [json.loads(t) if t else dict(EMPTY_EPISODE) for t in batch.column("trajectory").to_pylist()]


def episode_counts(records: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
    """(sums, maxima) over episodes: what `agent/*` is made of, ready to be reduced over ranks."""
    turns = [float(r.get("num_turns", 0)) for r in records]
    calls = [c for r in records for c in r.get("tool_calls", [])]
    sums = {"episodes": float(len(records)), "turns": sum(turns), "calls": float(len(calls)),
            "errors": float(sum(c.get("error") is not None for c in calls)),
            "tool_seconds": float(sum(c.get("seconds", 0.0) for c in calls)),
            "truncated": float(sum(bool(r.get("truncated")) for r in records)),
            "mismatch": float(sum(bool(r.get("template_mismatch")) for r in records)),
            "env_episodes": float(sum(bool(r.get("has_env")) for r in records)),
            "env_steps": float(sum(r.get("env_steps", 0) for r in records)),
            "env_seconds": float(sum(r.get("env_seconds", 0.0) for r in records)),
            "env_failures": float(sum(bool(r.get("env_failed")) + r.get("env_retries", 0) for r in records)),
            "env_retries": float(sum(r.get("env_retries", 0) for r in records)),
            "env_done": float(sum(bool(r.get("env_done")) for r in records))}
    return sums, {"turns": max(turns, default=0.0)}


def episode_metrics(sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
    """`agent/*` from (reduced) `episode_counts`."""
    episodes = max(sums["episodes"], 1.0)
    return {"agent/num_turns/mean": sums["turns"] / episodes, "agent/num_turns/max": maxes["turns"],
            "agent/tool_calls/mean": sums["calls"] / episodes, "agent/tool_errors": sums["errors"],
            "agent/tool_time_s": sums["tool_seconds"], "agent/truncated_ratio": sums["truncated"] / episodes,
            "agent/template_mismatch": sums["mismatch"], **_env_metrics(sums, episodes)}


def _env_metrics(sums: dict[str, float], episodes: float) -> dict[str, float]:
    """`env/*` when the episodes had an environment."""
    if not sums.get("env_episodes"):
        return {}
    return {"env/failures": sums["env_failures"], "env/retries": sums.get("env_retries", 0.0),
            "env/steps/mean": sums["env_steps"] / episodes,
            "env/done_ratio": sums["env_done"] / episodes, "env/time_s": sums["env_seconds"]}


def environment_score(prompt: str = "", response: str = "", ground_truth: str = "",
                      extra_info: dict[str, Any] | None = None, **_: object) -> float:
    """An episode's score as its environment gave it: the sum of its per-step rewards (0 if it failed)."""
    return float((extra_info or {}).get("env_reward") or 0.0)


def environment_win(prompt: str = "", response: str = "", ground_truth: str = "",
                    extra_info: dict[str, Any] | None = None, **_: object) -> float:
    """1.0 for an episode the environment ended with a full reward (a won game), else 0.0.

    Why: games such as TextArena's GuessTheNumber pay partial credit for an unwon game's end
    (an invalid move, the turn limit), which a policy can learn to collect instead of winning.
    """
    info = extra_info or {}
    return 1.0 if info.get("env_done") and float(info.get("env_reward") or 0.0) >= 1.0 else 0.0
