"""Rollout engines behind one interface: HF generate (everywhere) and vLLM (`strategy: vllm`)."""

from verl_hpc.roles.rollout.base import Generation, RolloutEngine
from verl_hpc.roles.rollout.factory import build_engine, shares_module
from verl_hpc.roles.rollout.hf import HFRolloutEngine

__all__ = ["Generation", "HFRolloutEngine", "RolloutEngine", "build_engine", "shares_module"]
