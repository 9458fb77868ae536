"""The actor: the policy being trained, its optimizer and LR schedule, and the PPO update.

Why no shuffling between epochs: the mini-batches are the same contiguous slices of the
step's (already shuffled) prompts every epoch, as in verl, so that any number of ranks
sees the same optimizer steps (data/layout.py).

Why old logprobs may come from the training forward itself: with one mini-batch and one
epoch, the policy that produced the rollout (synced every step) is exactly the one being
differentiated, so `old = logprobs.detach()` is the same number a separate no-grad pass
would compute — one forward saved per step. With several mini-batches or epochs the
weights move between them, so the old logprobs are computed up front instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_hpc.algo import aggregate_loss, counted_rows, get_policy_loss, kl_penalty
from verl_hpc.config import AlgorithmConfig
from verl_hpc.config.schema import LOGPROB_CHUNK_TOKENS, OptimConfig
from verl_hpc.roles.allocator import ResourceAllocator
from verl_hpc.roles.forward import batched_logprobs, response_logprobs
from verl_hpc.roles.micro_batching import micro_batches_of, reassemble
from verl_hpc.roles.optimizer import OptimizedModel
from verl_hpc.utils.collective import all_reduce_kept


@dataclass
class UpdatePlan:
    """How this rank cuts its rows of the step: mini-batches per optimizer step, micro per forward.

    Sizes are per rank: with W data-parallel ranks each holds mini_batch_size / W rows of
    every global mini-batch (data/layout.py), in the same order every epoch, so the
    optimizer sees the same mini-batches on any number of ranks.
    """

    mini_batch_size: int
    micro_batch_size: int
    epochs: int
    token_budget: int | None = None  # algorithm.use_dynamic_bsz: micro-batches by tokens, not rows

    @classmethod
    def from_config(cls, algo: AlgorithmConfig, batch_size: int, world: int = 1) -> UpdatePlan:
        """`batch_size` is the step's global batch (a smaller one is one mini-batch); the plan is for
        one of `world` ranks."""
        mini = min(algo.mini_batch_size or batch_size, batch_size) // world
        return cls(mini, min(algo.micro_batch_size or mini, mini), algo.ppo_epochs, algo.token_budget)

    def single_pass(self, batch_size: int) -> bool:
        return self.epochs == 1 and self.mini_batch_size >= batch_size

    def mini_batches(self, batch_size: int) -> list[slice]:
        return [slice(start, start + self.mini_batch_size) for start in range(0, batch_size, self.mini_batch_size)]


def micro_weight(mask: torch.Tensor, total_tokens: torch.Tensor, total_rows: int | torch.Tensor,
                 agg_mode: str) -> float:
    """A micro-batch's share of its mini-batch, so accumulated gradients equal one big batch.

    `total_rows` counts the mini-batch's rows that have a token (`counted_rows`): every
    seq-* mode is a mean over those, so the share is their share; `token-sum` is a plain
    sum, so every micro-batch counts whole.
    """
    if agg_mode == "token-mean":
        return float(mask.sum() / total_tokens)
    if agg_mode == "token-sum":
        return 1.0
    return float(counted_rows(mask).sum()) / max(float(total_rows), 1.0)


def data_parallel_scale(mask: torch.Tensor, agg_mode: str, group: dist.ProcessGroup | None) -> float:
    """Loss multiplier so FSDP's gradient *average* over ranks equals the global-batch loss.

    Ranks hold different numbers of valid tokens; scaling each rank's local mean by
    local_count * world / global_count makes the average of the ranks' gradients the
    gradient of the mean over every token (or counted sequence) of the whole batch. A sum
    (`token-sum`) is scaled by the world size alone, as verl scales it by dp_size.
    """
    if group is None or dist.get_world_size(group) == 1:
        return 1.0
    if agg_mode == "token-sum":
        return float(dist.get_world_size(group))
    local = mask.sum() if agg_mode == "token-mean" else counted_rows(mask).sum()
    total = local.detach().clone().float().cpu()
    all_reduce_kept(total, group=group)
    return float(local) * dist.get_world_size(group) / max(float(total), 1.0)


class Actor(OptimizedModel):
    def __init__(self, model: torch.nn.Module, algo: AlgorithmConfig, optim: OptimConfig, total_steps: int,
                 dp_group: dist.ProcessGroup | None = None, chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
                 remove_padding: bool = False):
        super().__init__(model, optim, total_steps)
        self.dp_group = dp_group
        self.chunk_tokens = chunk_tokens  # model.logprob_chunk_tokens
        self.remove_padding = remove_padding  # model.remove_padding
        self.algo = algo
        self.allocator = ResourceAllocator()  # the trainer sets device and floor (trainer.min_micro_batch_size)
        # With one pass (no separate old-logprob pass), the forward's own logprobs of the sampled
        # tokens, [B, R] in row order: what the rollout-vs-trainer check compares with the engine's.
        self.sampled_logprobs: torch.Tensor | None = None

    def compute_logprobs(self, inputs: dict[str, torch.Tensor], micro_batch_size: int,
                         token_budget: int | None = None) -> torch.Tensor:
        return batched_logprobs(self.model, inputs, self.algo.sampling.temperature, micro_batch_size,
                                self.chunk_tokens, token_budget, self.dp_group, self.remove_padding)

    def update(self, inputs: dict[str, torch.Tensor], plan: UpdatePlan) -> dict[str, float]:
        """PPO epochs over this rank's mini-batches; metrics are this rank's share (see `_optimizer_step`)."""
        batch_size = inputs["input_ids"].shape[0]
        reuse_forward = plan.single_pass(batch_size) and "old_logprobs" not in inputs
        by_tokens = plan.token_budget is not None
        self.sampled_logprobs = None
        totals: dict[str, float] = {}
        count = 0
        self.model.train()
        for _ in range(plan.epochs):
            for rows in plan.mini_batches(batch_size):
                mini = {k: v[rows] for k, v in inputs.items()}
                # An OOM retry repeats this whole optimizer step at half the micro-batch (allocator.py),
                # or at half the token budget.
                stats = self.allocator.run(
                    "train_tokens" if by_tokens else "train", plan.token_budget or plan.micro_batch_size,
                    lambda size, mini=mini: self._optimizer_step(mini, size, reuse_forward, by_tokens))
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
        self.scheduler.step()
        return {k: v / count for k, v in totals.items()}

    def _optimizer_step(self, mini: dict[str, torch.Tensor], micro_size: int, reuse_forward: bool,
                        by_tokens: bool = False) -> dict[str, float]:
        """One optimizer step; loss metrics are returned pre-scaled by the data-parallel share.

        Each micro-batch's weight is its share of the *global* mini-batch times the number of
        ranks (FSDP averages gradients), so a plain mean of the ranks' metrics is the number
        one process holding the whole mini-batch would report.
        """
        algo = self.algo
        loss_fn = get_policy_loss(algo.policy_loss).compute
        self.optimizer.zero_grad(set_to_none=True)
        mini_mask = mini["response_mask"]
        total_tokens, total_rows = mini_mask.sum().clamp(min=1), counted_rows(mini_mask).sum()
        dp_scale = data_parallel_scale(mini_mask, algo.loss_agg_mode, self.dp_group)
        # clipfrac, clipfrac_lower and ppo_kl are token means whatever the loss's mode
        stat_scale = dp_scale if algo.loss_agg_mode == "token-mean" else \
            data_parallel_scale(mini_mask, "token-mean", self.dp_group)
        sums = dict.fromkeys(("pg_loss", "entropy", "kl_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"), 0.0)
        seen: list[tuple[list[int], torch.Tensor]] = []
        for rows, micro in micro_batches_of(mini, micro_size, micro_size if by_tokens else None, self.dp_group):
            mask = micro["response_mask"]
            weight = micro_weight(mask, total_tokens, total_rows, algo.loss_agg_mode) * dp_scale
            stat_weight = micro_weight(mask, total_tokens, total_rows, "token-mean") * stat_scale
            logprobs, entropy = response_logprobs(self.model, micro, algo.sampling.temperature,
                                                  with_entropy=True, chunk_tokens=self.chunk_tokens,
                                                  remove_padding=self.remove_padding,
                                                  entropy_grad=algo.entropy_coef > 0)
            old = logprobs.detach() if reuse_forward else micro["old_logprobs"]
            seen.append((rows, old))
            pg, pg_stats = loss_fn(logprobs, old, micro["advantages"], mask, algo)
            loss, ent, kl_value = self._objective(pg, logprobs, entropy, micro)
            (loss * weight).backward()
            for key, value in (("pg_loss", pg), ("entropy", ent), ("kl_loss", kl_value)):
                sums[key] += float(value.detach()) * weight
            for key, stat in (("pg_clipfrac", "clipfrac"), ("pg_clipfrac_lower", "clipfrac_lower"),
                              ("ppo_kl", "approx_kl")):
                sums[key] += float(pg_stats.get(stat, 0.0)) * stat_weight
        grad_norm = self.clip_and_step()
        if reuse_forward:
            self.sampled_logprobs = reassemble(seen, mini_mask.shape[0], mini_mask.shape[1])
        return {**sums, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0]}

    def _objective(self, pg: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor,
                   micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, entropy, KL loss) of one micro-batch: pg - entropy_coef * H + kl.coef * KL, as verl's
        actor combines them, the entropy and the KL aggregated with `loss_agg_mode` like the policy loss."""
        algo, mask = self.algo, micro["response_mask"]
        norm = algo.sampling.max_new_tokens
        ent = aggregate_loss(entropy, mask, algo.loss_agg_mode, norm)
        loss = pg - algo.entropy_coef * ent if algo.entropy_coef > 0 else pg
        kl_value = torch.zeros(())
        if "ref_logprobs" in micro and not algo.kl.in_reward:
            kl_mat = kl_penalty(logprobs, micro["ref_logprobs"], algo.kl.estimator)
            kl_value = aggregate_loss(kl_mat, mask, algo.loss_agg_mode, norm)
            loss = loss + algo.kl.coef * kl_value
        return loss, ent, kl_value

    def old_logprobs_needed(self, plan: UpdatePlan, batch_size: int) -> bool:
        return not plan.single_pass(batch_size)
