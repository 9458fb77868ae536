"""LoRA on the actor: peft's adapters injected in place, and the views of them the run needs.

Why in place (`inject_adapter_in_model`) rather than a `PeftModel` wrapper: the actor stays
the same Hugging Face class, so generation, FSDP2's per-layer sharding, activation
checkpointing and the log-prob head see the model they always see; only the adapted
linears become peft `Linear`s (`base_layer` frozen, `lora_A`/`lora_B` trained).

Why a merged view (`merged_params`): rollout engines (HF copies, vLLM) hold the plain
architecture, so every weight sync sends `W + (alpha / r) * B @ A` under the base weight's
own name; the base weights are never modified, so no rounding drifts into them over a
run and a resumed run starts from bit-identical weights (the base from the model
directory, the adapters from the checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from verl_hpc.config import ConfigError
from verl_hpc.config.schema import LoraConfig


def peft_lora_config(lora: LoraConfig):
    """peft's `LoraConfig` for `model.lora` (no dropout: the PPO ratio needs a deterministic forward)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError:
        raise ConfigError("model.lora", "LoRA needs the peft package, which is not installed",
                          "pip install 'verl-hpc[lora]' (or pip install peft)") from None
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, bias="none",
                          target_modules=lora.target_modules, task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, lora: LoraConfig, seed: int) -> nn.Module:
    """Inject adapters into `model` in place and freeze everything else; returns `model`.

    The adapters' initialisation (A random, B zero) draws from its own RNG seeded by
    `seed`, so every rank of every placement builds the same adapters and the run's other
    random streams are untouched; B = 0 makes the first forward exactly the base model's.
    """
    from peft import inject_adapter_in_model

    config = peft_lora_config(lora)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(config, model)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError("model.lora.target_modules", str(err).splitlines()[0],
                          "name linear layers of this model (e.g. q_proj, v_proj) or use all-linear") from None
    return model


def frozen_names(model: nn.Module) -> set[str]:
    """Every state-dict name of a frozen parameter, tied ones included (`lm_head.weight`)."""
    return {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}


def trainable_state(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """`state` (default: the model's state dict) without frozen parameters: a LoRA actor's
    checkpoint holds only its adapters. A model that trains every weight keeps every entry.
    """
    frozen = frozen_names(model)
    return {k: v for k, v in (model.state_dict() if state is None else state).items() if k not in frozen}


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `trainable_state`'s output; anything missing must be a frozen (base) weight."""
    frozen = frozen_names(model)
    missing, unexpected = model.load_state_dict(state, strict=not frozen)
    absent = sorted(set(missing) - frozen)
    if absent or unexpected:
        raise RuntimeError(f"checkpoint does not fit the model: missing {absent[:5]}, unexpected "
                           f"{sorted(unexpected)[:5]} (was it written with another model.lora?)")
