"""Rollout engines behind one interface (HF generate now; vLLM plugs in the same way)."""

from verl_hpc.roles.rollout.base import Generation, RolloutEngine
from verl_hpc.roles.rollout.hf import HFRolloutEngine

__all__ = ["Generation", "HFRolloutEngine", "RolloutEngine"]
