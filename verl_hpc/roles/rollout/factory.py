"""One place that turns a rollout role's `strategy` into an engine.

Why here and not in the runtime: the embedded loop and the distributed ranks must build
the same engine from the same resources; only this module knows that `vllm` means a
child process and `hf` means a module in this process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from verl_hpc.config.resources import RoleResources, VllmArgs
from verl_hpc.roles.rollout.base import RolloutEngine, stop_token_ids
from verl_hpc.roles.rollout.hf import HFRolloutEngine

EngineBuilder = Callable[..., RolloutEngine]
ENGINES: dict[str, EngineBuilder] = {}  # resources.rollout.strategy -> builder


def register_engine(strategy: str) -> Callable[[EngineBuilder], EngineBuilder]:
    """Make `strategy` buildable: the builder takes `build_engine`'s arguments."""
    def add(builder: EngineBuilder) -> EngineBuilder:
        ENGINES[strategy] = builder
        return builder
    return add


def build_engine(resources: RoleResources, model_dir: str, tokenizer, device: torch.device, *,
                 colocated: bool, timeout: float, log_file: Path | None = None,
                 hf_model: torch.nn.Module | None = None, launched: bool = True) -> RolloutEngine:
    """The rollout engine for `resources.strategy` (any strategy but vllm: the HF engine); `hf_model`
    is the HF engine's module (loaded from `model_dir` when not given). `launched`: this process's
    GPUs were already narrowed to its slot by a launcher or Slurm (else the configured device ids apply)."""
    builder = ENGINES.get(resources.strategy, ENGINES["hf"])
    return builder(resources, model_dir, tokenizer, device, colocated=colocated, timeout=timeout,
                   log_file=log_file, hf_model=hf_model, launched=launched)


@register_engine("vllm")
def _vllm(resources: RoleResources, model_dir: str, tokenizer, device: torch.device, *, colocated: bool,
          timeout: float, log_file: Path | None, launched: bool, **_: object) -> RolloutEngine:
    from verl_hpc.roles.rollout.vllm_engine import VLLMRolloutEngine

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id != tokenizer.eos_token_id else None
    return VLLMRolloutEngine(model_dir, pad_id, resources.vllm_args or VllmArgs(), resources.device_type,
                             None if launched else resources.device_ids, colocated=colocated, timeout=timeout,
                             log_file=log_file, eos_ids=stop_token_ids(tokenizer, model_dir))


@register_engine("hf")
def _hf(resources: RoleResources, model_dir: str, tokenizer, device: torch.device, *,
        hf_model: torch.nn.Module | None, **_: object) -> RolloutEngine:
    if hf_model is None:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    return HFRolloutEngine(hf_model, tokenizer, device)


def shares_module(engine: RolloutEngine, model: torch.nn.Module) -> bool:
    """Whether `engine` generates with `model` itself (embedded HF): then a sync is free."""
    return getattr(engine, "model", None) is model

