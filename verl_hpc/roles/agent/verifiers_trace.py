"""A verifiers episode (its recorded trace) as the trajectory the trainer scores: pure functions.

Why the trace and not its messages: verifiers records every model call's tokens as the engine
returned them (`nodes[i].token_ids`, with `mask` 1 on the sampled ones and their `logprobs`) and the
scaffold between calls as its renderer built it. Concatenated along the path to the last call, they
are the exact token sequence the engine saw, so the trainer's logprobs are taken on what was sampled,
as for the agent loop's own episodes (roles/agent/episode.py); nothing is re-tokenised.
"""

from __future__ import annotations

from typing import Any

from verl_hpc.roles.agent.episode import Episode
from verl_hpc.roles.env.base import EnvFailure


def path_to(nodes: list[dict[str, Any]], index: int) -> list[int]:
    """Node indices from the trace graph's root to `index`."""
    path: list[int] = []
    at: int | None = index
    while at is not None:
        if at in path or not 0 <= at < len(nodes):
            raise EnvFailure(f"the trace's node graph is broken at node {at}")
        path.append(at)
        at = nodes[at].get("parent")
    return path[::-1]


def spread(node: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """(token ids, loss mask, logprobs) of one node: its logprobs on its sampled tokens, 0 elsewhere."""
    ids = [int(t) for t in node.get("token_ids") or []]
    mask = [int(bool(m)) for m in node.get("mask") or [0] * len(ids)]
    values = [float(x) for x in node.get("logprobs") or []]
    if len(mask) != len(ids) or (values and len(values) != sum(mask)):
        raise EnvFailure(f"a trace node has {len(ids)} tokens, {len(mask)} mask entries and {len(values)} "
                         "logprobs; a renderer that records tokens must record all three")
    at, logprobs = iter(values), []
    for m in mask:
        logprobs.append(next(at, 0.0) if m else 0.0)
    return ids, mask, logprobs


def trace_reward(trace: dict[str, Any]) -> float:
    """verifiers' episode reward: its named rewards' score times weight, summed (unscored ones count 0)."""
    total = 0.0
    for reward in (trace.get("rewards") or {}).values():
        if reward is not None:
            total += float(reward.get("score", 0.0)) * float(reward.get("weight", 1.0))
    return total


def message_of(message: dict[str, Any]) -> dict[str, Any]:
    """A trace message in the agent loop's shape (OpenAI's tool_calls), for the record and the reward."""
    out = {"role": message.get("role"), "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c.get("name"), "arguments": c.get("arguments")}}
                             for c in message["tool_calls"]]
    return out


def trace_episode(key: tuple[int, int, int], trace: dict[str, Any], version: int) -> Episode:
    """The episode of one trace: prompt = every token before the first sampled one, response = the
    rest of the path to the last model call; each run of sampled tokens a turn stamped `version`.
    Calls off that path (a harness that branches) are not trained."""
    nodes = trace.get("nodes") or []
    calls = [c for c in trace.get("calls") or [] if c.get("node") is not None]
    if not calls:
        raise EnvFailure("the episode made no model call")
    path = path_to(nodes, int(calls[-1]["node"]))
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for index in path:
        node_ids, node_mask, node_logprobs = spread(nodes[index])
        ids += node_ids
        mask += node_mask
        logprobs += node_logprobs
    if 1 not in mask:
        raise EnvFailure("the trace holds no sampled token")
    first = mask.index(1)
    messages = [message_of(nodes[i].get("message") or {}) for i in path]
    sampled_from = next(k for k, i in enumerate(path) if 1 in (nodes[i].get("mask") or []))
    episode = Episode(key, ids[:first], messages, has_env=True)
    episode.response_ids, episode.loss_mask, episode.logprobs = ids[first:], mask[first:], logprobs[first:]
    on_path = set(path)
    turns = [c for c in calls if int(c["node"]) in on_path]
    episode.turn_bounds = turn_bounds(mask[first:])
    episode.turn_versions = [int(version)] * (len(episode.turn_bounds) // 2)
    episode.model_tokens = sum(episode.loss_mask)
    episode.assistant_turns = len(turns)
    episode.tool_log = tool_log(messages[sampled_from:])
    episode.tool_turns = sum(1 for m in messages[sampled_from:] if m["role"] == "tool")
    episode.env_reward = trace_reward(trace)
    episode.env_seconds = float(((trace.get("timing") or {}).get("agent") or {}).get("harness", {}).get("duration")
                                or 0.0)
    episode.env_steps = len(turns)
    episode.env_done = True
    last = turns[-1].get("finish_reason")
    episode.end(finished=last != "length", truncated=last == "length")
    episode.final_answer = str(messages[-1].get("content") or "") if messages else ""
    return episode


def tool_log(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls the model made (from its first sampled turn on) and their replies, as the agent
    loop logs them (`agent/tool_calls`); verifiers ran them, so their time is the harness's."""
    log: list[dict[str, Any]] = []
    turn, waiting = 0, []
    for message in messages:
        if message["role"] == "assistant":
            turn += 1
            waiting = list(message.get("tool_calls") or [])
        elif message["role"] == "tool" and waiting:
            call = waiting.pop(0)["function"]
            log.append({"turn": turn, "name": call["name"], "arguments": call["arguments"],
                        "response": message.get("content"), "error": None, "seconds": 0.0, "reward": 0.0})
    return log


def turn_bounds(mask: list[int]) -> list[int]:
    """[start, end) of each run of sampled tokens: one per model turn."""
    bounds: list[int] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            bounds.append(i)
        if m and (i + 1 == len(mask) or not mask[i + 1]):
            bounds.append(i + 1)
    return bounds


def failed_episode(key: tuple[int, int, int], error: str, fill_id: int) -> Episode:
    """A row for an episode verifiers could not run: one untrained token each side, reward 0, counted
    in `env/failures` (the group keeps its size for the baseline)."""
    episode = Episode(key, [fill_id], [{"role": "system", "content": f"verifiers episode failed: {error}"}],
                      has_env=True, env_failed=True)
    episode.add_inserted([fill_id])
    episode.end(finished=True, truncated=False)
    return episode
