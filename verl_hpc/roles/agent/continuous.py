"""Continuous batching of agent turns on an engine that takes requests one at a time (vLLM).

Why not rounds there: in a round the engine waits for the round's longest turn before any
episode whose tool has replied can start its next turn. An engine with `submit`/`poll`
(`VLLMRolloutEngine`) takes each turn the moment its episode is ready — its first turn, or
its next one once the tool replied — into the batch it is already running, and hands back
each turn as it finishes, so a slow tool or a long turn holds its own episode only.

Seeds: a turn's seed is a function of the step's seed, the episode and the turn number, never
of when it was submitted (which depends on tool latency), so a resumed run samples the same
episodes (up to the engine's batch-dependent numerics).
"""

from __future__ import annotations

import concurrent.futures as cf
import random
from typing import Any, Protocol

import torch

from verl_hpc.roles.agent.episode import Episode
from verl_hpc.roles.agent.tool_runner import ToolOutcome

POLL_SECONDS_WITH_TOOLS = 0.02  # how long a poll may step the engine while tool replies may come in
POLL_SECONDS = 5.0


class TurnHandler(Protocol):
    """What continuous batching needs of the agent loop (loop.py's `AgentLoop`): the engine, the
    stop ids, each episode's budget, and what to do with a finished turn and with tool replies."""

    engine: Any
    stop_ids: list[int]

    def budget(self, episode: Episode, max_new_tokens: int) -> int: ...

    def ended_by_budget(self, episode: Episode, sampling: Any) -> bool: ...

    def after_turn(self, episode: Episode, ids: list[int]) -> None: ...

    def take_replies(self, episode: Episode, outcomes: list[ToolOutcome]) -> None: ...

    def release_ended(self, episodes: list[Episode]) -> None: ...


def takes_requests(engine: Any) -> bool:
    """Whether the engine batches continuously (`submit` and `poll`)."""
    return callable(getattr(engine, "submit", None)) and callable(getattr(engine, "poll", None))


def turn_seed(step_seed: int, episode: Episode) -> int:
    """The seed of the episode's next turn: its step's seed, its key and its turn number only."""
    return random.Random(f"{step_seed}/{episode.key}/{episode.assistant_turns}").randrange(2**31 - 1)


def run_continuous(loop: TurnHandler, episodes: list[Episode], sampling: Any, version: int) -> None:
    """Every episode to its end, each turn submitted as soon as its episode is ready."""
    step_seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # the step's RNG: the same on a resume
    position = {id(e): i for i, e in enumerate(episodes)}  # an episode's key on the engine
    in_engine: dict[int, Episode] = {}
    waiting: list[Episode] = []

    def submit(ready: list[Episode]) -> None:
        waiting.extend(e for e in ready if e.pending is not None)  # self-play: a seat waiting for the other's move
        ready = [e for e in ready if e.pending is None and not loop.ended_by_budget(e, sampling)]
        if not ready:
            return
        keys = [position[id(e)] for e in ready]
        loop.engine.submit(keys, [e.context() for e in ready], [turn_seed(step_seed, e) for e in ready], sampling,
                           stop_token_ids=loop.stop_ids, max_tokens=[loop.budget(e, sampling.max_new_tokens)
                                                                     for e in ready])
        in_engine.update(zip(keys, ready, strict=True))

    submit(episodes)
    while in_engine or waiting:
        loop.release_ended(episodes)
        if in_engine:
            for key, ids, logprobs in loop.engine.poll(POLL_SECONDS_WITH_TOOLS if waiting else POLL_SECONDS):
                episode = in_engine.pop(key)
                episode.add_sampled(ids, logprobs, version)
                loop.after_turn(episode, ids)
                if episode.pending is not None:
                    waiting.append(episode)
        elif waiting:
            cf.wait([e.pending for e in waiting], return_when=cf.FIRST_COMPLETED)  # type: ignore[misc]
        replied = [e for e in waiting if e.pending is not None and e.pending.done()]
        for episode in replied:
            waiting.remove(episode)
            loop.take_replies(episode, episode.pending.result())  # type: ignore[union-attr]
        submit(replied)
