"""A small environment in OpenEnv's shape (reset/step returning observations with `done` and `reward`)
for configs/env_box.yaml: the box holds a digit; each turn the model names one and is told whether it
was right; the right digit earns 1 and ends the episode. Written without the `openenv` package so the
example runs anywhere; an OpenEnv `Environment` subclass plugs in the same way
(tests/plugins/openenv_box.py is this environment written against openenv-core's base classes)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass
class BoxObservation:
    prompt: str
    done: bool = False
    reward: float = 0.0


class BoxEnv:
    """One episode: `reset(seed)` hides a digit in 0..max_digit, `step(text)` checks a guess."""

    def __init__(self, max_digit: int = 4):
        self.max_digit, self.digit = max_digit, 0

    def reset(self, seed: int | None = None, **kwargs: Any) -> BoxObservation:
        self.digit = random.Random(seed).randint(0, self.max_digit)
        return BoxObservation("what is in the box")

    def step(self, action: str) -> BoxObservation:
        right = action.strip() == str(self.digit)
        return BoxObservation("it is" if right else "it is not", done=right, reward=1.0 if right else 0.0)
