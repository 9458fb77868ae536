"""The environment interface: reset to a first observation, then one step per model turn.

Why OpenEnv's shape (`reset(seed) / step(action)` returning an observation with `reward` and
`done`): it is the interface TRL adopted and the one the field's environment hubs publish, and
TextArena's, Gymnasium's and verl's interaction classes all map onto it. The action is the text
of the model's turn; an observation is text for the next user turn. Rewards are per step; an
episode's reward is their sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# Where an observation's text is, by field name, in the order looked for (OpenEnv observations are
# pydantic models or their fields' dicts; each environment names its own).
TEXT_FIELDS = ("text", "message", "prompt", "content", "observation", "feedback")


class EnvFailure(Exception):
    """An environment that raised, hung past its timeout or answered something that is not an
    observation: the episode it held ends and is counted in `env/failures`, the run goes on."""


@dataclass(frozen=True)
class EnvReply:
    """What an environment says after `reset` or a `step`."""

    text: str
    reward: float = 0.0
    done: bool = False

    @classmethod
    def checked(cls, text: Any, reward: Any = 0.0, done: Any = False) -> EnvReply:
        """An observation from an adapter, refused as garbage unless its fields are what they claim."""
        if not isinstance(text, str):
            raise EnvFailure(f"the observation is {type(text).__name__}, not text")
        try:
            value = float(reward if reward is not None else 0.0)
        except (TypeError, ValueError):
            raise EnvFailure(f"the reward {reward!r} is not a number") from None
        if not math.isfinite(value):
            raise EnvFailure(f"the reward {value} is not finite")
        return cls(text, value, bool(done))


@runtime_checkable
class Environment(Protocol):
    """One episode's environment; an adapter makes a new one per episode."""

    def reset(self, seed: int | None = None, **kwargs: Any) -> EnvReply:
        """Start an episode: the first observation (the episode's first user turn)."""
        ...

    def step(self, action: str) -> EnvReply:
        """The model's turn as text -> the next observation, this step's reward, and whether it ended."""
        ...

    def close(self) -> None:
        """Release what the episode held."""
        ...
