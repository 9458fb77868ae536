"""What a DPO process holds: the policy, its frozen copy as the reference, and the tokenized pairs.

Why not `build_roles`: DPO hosts no engine and no reward, and its data are pairs, not
prompts; but the actor is made exactly as the RL actor is (same loading, same FSDP
sharding over the trainer group, same `Actor` optimizer and LR schedule), so the
lifecycle checkpoints, resumes and exports it without knowing which algorithm ran.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_hpc.config import ConfigError, RunConfig
from verl_hpc.data.preferences import PreferenceDataset, reply_ids
from verl_hpc.data.records import RowError
from verl_hpc.roles.actor import Actor
from verl_hpc.roles.allocator import ResourceAllocator
from verl_hpc.roles.fsdp import checkpoint_activations
from verl_hpc.roles.loading import GroupLoad, causal_lm_skeleton
from verl_hpc.roles.lora import apply_lora
from verl_hpc.roles.offload import ParamOffload, offloads_to_host
from verl_hpc.roles.precision import shard_or_autocast
from verl_hpc.runtime.build import (
    DTYPES,
    BuildSpec,
    Roles,
    ensure_model,
    load_causal_lm,
    prompt_files,
    tokenize_prompts,
)


@dataclass
class TokenizedPairs:
    """Token ids of every pair: the rendered prompt, and chosen/rejected replies ending in EOS."""

    dataset: PreferenceDataset
    prompt_ids: list[list[int]]
    chosen_ids: list[list[int]]
    rejected_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def model_inputs(self, pairs: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        """One forward's tensors for `pairs`: their chosen rows, then their rejected rows.

        The RL loop's layout (`RolloutBatch.model_inputs`): [pad.. prompt | reply ..pad], so
        `response_logprobs` reads the replies' log-probs exactly as it reads sampled responses.
        """
        prompts = [self.prompt_ids[i] for i in pairs] * 2
        replies = [self.chosen_ids[i] for i in pairs] + [self.rejected_ids[i] for i in pairs]
        width, reply_width = max(map(len, prompts)), max(map(len, replies))
        input_ids = torch.full((len(replies), width + reply_width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
            input_ids[row, width - len(prompt):width] = torch.tensor(prompt)
            input_ids[row, width:width + len(reply)] = torch.tensor(reply)
            attention_mask[row, width - len(prompt):width + len(reply)] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                "response_mask": attention_mask[:, width:].float()}


@dataclass
class DPORoles(Roles):
    pairs: TokenizedPairs | None = None


def load_pairs(cfg: RunConfig, run_dir: Path, tokenizer: Any) -> TokenizedPairs:
    """Every pair read, checked and tokenized before the first step (a bad row stops the run here)."""
    data, dpo = cfg.data, cfg.algorithm.dpo
    try:
        dataset = PreferenceDataset(prompt_files(cfg, run_dir), data.prompt_key)
        eos = tokenizer.eos_token_id
        field = "algorithm.dpo.max_response_length"
        chosen = reply_ids(tokenizer, dataset.chosen, eos, dpo.max_response_length, dataset.where, field)
        rejected = reply_ids(tokenizer, dataset.rejected, eos, dpo.max_response_length, dataset.where, field)
    except RowError as err:
        raise ConfigError(err.field, err.message, err.hint) from None
    where = [f"{w}, column {data.prompt_key!r}" for w in dataset.where]
    prompt_ids = tokenize_prompts(tokenizer, dataset.prompts, data.max_prompt_length, data.truncation, where)
    return TokenizedPairs(dataset, prompt_ids, chosen, rejected)


def build_dpo_roles(cfg: RunConfig, run_dir: Path, spec: BuildSpec, actor_model: Any = None) -> DPORoles:
    """The actor (sharded over `spec.fsdp_group` if set) and a frozen copy of its initial weights."""
    from transformers import AutoTokenizer

    model_dir = str(ensure_model(cfg))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    pairs = load_pairs(cfg, run_dir, tokenizer)
    dtype = DTYPES[cfg.model.dtype]
    load = GroupLoad(spec.fsdp_group, spec.device, cfg.model.load if actor_model is None else "every_rank")
    policy = actor_model if isinstance(actor_model, torch.nn.Module) else \
        causal_lm_skeleton(model_dir, dtype) if load.skeleton else \
        load_causal_lm(str(actor_model) if actor_model is not None else model_dir, dtype)
    if not load.skeleton:
        policy.to(spec.device)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    if cfg.model.lora is not None:
        apply_lora(policy, cfg.model.lora, cfg.trainer.seed)
    if cfg.model.gradient_checkpointing:
        checkpoint_activations(policy)
    offload = cfg.model.param_offload.ref
    load.shard(ref, lambda m: shard_or_autocast(m, cfg.model.mixed_precision, spec.device, spec.fsdp_group, offload),
               offloads_to_host(offload, spec.device))
    load.shard(policy, lambda m: shard_or_autocast(m, cfg.model.mixed_precision, spec.device, spec.fsdp_group))
    actor = Actor(policy, cfg.algorithm, cfg.trainer.actor_optim, cfg.trainer.total_steps, dp_group=spec.fsdp_group,
                  chunk_tokens=cfg.model.logprob_chunk_tokens, remove_padding=cfg.model.remove_padding)
    trainer = cfg.trainer
    allocator = ResourceAllocator(spec.device, trainer.min_micro_batch_size, False)  # no OOM retry: fixed slices
    actor.allocator = allocator
    return DPORoles(tokenizer=tokenizer, device=spec.device, dataset=pairs.dataset, prompt_ids=pairs.prompt_ids,  # type: ignore[arg-type]
                    hosted=("actor", "ref"), actor=actor, ref_model=ref, allocator=allocator, pairs=pairs,
                    ref_offload=ParamOffload(ref, spec.device, offload, name="ref"))
