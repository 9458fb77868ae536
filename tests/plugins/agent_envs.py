"""Environments for tests/roles/test_env.py: OpenEnv-shaped classes that count, fail, hang or lie."""

from __future__ import annotations

import time

from pydantic import BaseModel


class GuessAction(BaseModel):
    message: str


class GuessObservation(BaseModel):
    prompt: str
    done: bool = False
    reward: float | None = None
    metadata: dict = {}


class CountdownEnv:
    """Three turns whatever the model says; each step's reward is 1 if the turn holds a digit. `mode`
    makes a step raise, hang, take 0.4 s or answer garbage."""

    failed_seeds: set = set()  # mode "flaky": seeds whose first step already failed (per process)

    def __init__(self, turns: int = 3, mode: str = "ok"):
        self.turns, self.mode, self.left = turns, mode, turns

    def reset(self, seed: int | None = None, **kwargs: object) -> GuessObservation:
        self.left, self.seed = self.turns, seed
        return GuessObservation(prompt=f"what is it {seed}")

    def step(self, action: GuessAction) -> GuessObservation:
        if self.mode == "raise":
            raise RuntimeError("the simulator crashed")
        if self.mode == "flaky" and self.seed not in CountdownEnv.failed_seeds:
            CountdownEnv.failed_seeds.add(self.seed)
            raise RuntimeError("the simulator crashed once")
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "slow":  # a step that takes its time: 0.4 s
            time.sleep(0.4)
        if self.mode == "garbage":
            return {"not": "an observation"}  # type: ignore[return-value]
        self.left -= 1
        reward = 1.0 if any(ch.isdigit() for ch in action.message) else 0.0
        return GuessObservation(prompt=f"answer {self.left}", done=self.left == 0, reward=reward)


class PidEnv(CountdownEnv):
    """CountdownEnv that says which process it lives in, and can take that process down."""

    def reset(self, seed: int | None = None, **kwargs: object) -> GuessObservation:
        super().reset(seed)
        import os

        return GuessObservation(prompt=str(os.getpid()))

    def step(self, action: GuessAction) -> GuessObservation:
        if action.message == "crash":
            import os

            os._exit(3)
        return super().step(action)
