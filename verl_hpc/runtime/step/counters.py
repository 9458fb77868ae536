"""Where a run stands: the step and the policy version, for any step object the lifecycle drives.

Why one class: the RL loop (`RLTrainer`) and DPO's step (`DPOTrainer`) both ride in the
checkpoint's run state under the same keys and name their stages to the heartbeat the same
way; two copies of that would drift, and a checkpoint of one would mislead the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_hpc.runtime.placement.one_process import Timer


class StepCounters:
    def __init__(self, on_stage: Callable[[str], None] | None = None) -> None:
        self.step = 0
        self.policy_version = 0
        self.on_stage = on_stage  # heartbeat: hears "step N <stage>" as each stage starts

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "policy_version": self.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.policy_version = int(state["step"]), int(state["policy_version"])

    def timer(self) -> Timer:
        step, on_stage = self.step, self.on_stage
        return Timer(None if on_stage is None else lambda name: on_stage(f"step {step} {name}"))
