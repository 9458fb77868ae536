"""Where a run stands (the step, the policy version) and how long each stage of a step took.

Why one class: the RL loop (`RLTrainer`) and DPO's step (`DPOTrainer`) both ride in the
checkpoint's run state under the same keys and name their stages to the heartbeat the same
way; two copies of that would drift, and a checkpoint of one would mislead the other.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from verl_hpc.metrics.memory import PhaseProbe, process_probe
from verl_hpc.utils.host_allocator import release_free_memory


class Timer:
    """Collects `timing_s/<name>` for one step; `on_enter` hears each stage's name (heartbeat); the
    process's memory probe (metrics/memory.py) records each stage's peak under the same name."""

    def __init__(self, on_enter: Callable[[str], None] | None = None, probe: PhaseProbe | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_enter = on_enter
        self.probe = probe

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.on_enter is not None:
            self.on_enter(name)
        start = time.perf_counter()
        with self.probe.stage(name) if self.probe is not None else contextlib.nullcontext():
            yield
        if name != "step":
            release_free_memory()  # the next stage starts from this one's live memory, not its garbage
        key = f"timing_s/{name}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start


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
        return Timer(None if on_stage is None else lambda name: on_stage(f"step {step} {name}"), process_probe())
