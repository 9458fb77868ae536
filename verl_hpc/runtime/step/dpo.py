"""The DPO step: preference pairs -> policy and reference log-probs -> DPO/IPO loss -> one update.

Why a step object beside the RL loop and not a branch in it: DPO generates nothing, scores
nothing and estimates no advantage, so none of `RLTrainer.train_step`'s stages apply. What
it shares is everything around the step — `RunLifecycle` drives this object through the
same interface (`next_step`, `step`, `policy_version`, `state_dict`, `last_batch`,
`samples_text`), so checkpoints, stop signals and requeue, resume, TensorBoard and the
exported model work unchanged, in one process and on FSDP actor processes alike.

Why the same numbers on any number of processes: every rank draws the same pairs, takes
an even contiguous slice of them, and scales each micro-batch's summed loss by
world / pairs, so FSDP's gradient *average* is the gradient of the mean over all pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_hpc.algo.dpo import PreferenceLoss, preference_loss, sequence_logps
from verl_hpc.config import RunConfig
from verl_hpc.data.layout import even_slices
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.metrics import memory_metrics
from verl_hpc.roles.forward import response_logprobs, to_device
from verl_hpc.runtime.state.seeding import reseed
from verl_hpc.runtime.step.counters import StepCounters
from verl_hpc.runtime.step.dpo_build import TokenizedPairs
from verl_hpc.runtime.step.metrics import prefixed
from verl_hpc.runtime.step.stages import Placement


class DPOTrainer(StepCounters):
    """One DPO step per `next_step`; the counters ride in checkpoints (`state_dict`)."""

    progress_metric = ("acc", "dpo/reward_accuracy")  # what the progress line shows

    def __init__(self, cfg: RunConfig, placement: Placement, sampler: PromptSampler, on_stage: Any = None):
        super().__init__(on_stage)
        self.cfg, self.placement, self.sampler = cfg, placement, sampler
        self.seat, self.collectives, self.roles = placement.seat, placement.collectives, placement.roles
        self.pairs: TokenizedPairs = placement.roles.pairs  # type: ignore[attr-defined]
        self.last_batch: list[int] | None = None  # the step's pair indices, on the leader

    def next_step(self) -> dict[str, float]:
        """Advance one step; returns the leader's metrics ({} on the other actor processes)."""
        self.step += 1
        reseed(self.cfg.trainer.seed, self.step, self.seat.stream)
        return self.dpo_step(self.sampler.next_indices())

    def dpo_step(self, pairs: list[int]) -> dict[str, float]:
        seat, timer = self.seat, self.timer()
        with timer("step"):
            start, end = even_slices(len(pairs), seat.world, seat.rank)
            with timer("update_actor"):
                loss, grad_norm = self.update(pairs[start:end], len(pairs))
            self.policy_version += 1
        actor = self.roles.actor
        train = {**prefixed("dpo", loss.stats()), "actor/grad_norm": grad_norm,
                 "actor/lr": actor.scheduler.get_last_lr()[0]}  # type: ignore[union-attr]
        train = self.collectives.mean_metrics(train)  # equal slices: the mean of the ranks' means is the mean over pairs
        if not seat.is_leader:
            return {}
        self.last_batch = pairs
        return {**train, **timer.seconds, **memory_metrics(self.roles.device),
                "actor/policy_version": float(self.policy_version)}

    def update(self, pairs: list[int], total_pairs: int) -> tuple[PreferenceLoss, float]:
        """One optimizer step over this rank's pairs, micro-batch by micro-batch."""
        roles, dpo = self.roles, self.cfg.algorithm.dpo
        actor = roles.actor
        micro = self.cfg.algorithm.micro_batch_size or len(pairs)
        scale = self.seat.world / total_pairs  # FSDP averages gradients over the p.world ranks
        actor.model.train()  # type: ignore[union-attr]
        actor.optimizer.zero_grad(set_to_none=True)  # type: ignore[union-attr]
        parts: list[PreferenceLoss] = []
        average = dpo.loss_type == "ipo"  # type: ignore[union-attr]
        micro_rows = [pairs[begin:begin + micro] for begin in range(0, len(pairs), micro)]
        ref_all = self.ref_logps(micro_rows, average)  # first, so an offloaded ref is resident once
        for rows, ref_logps in zip(micro_rows, ref_all, strict=True):
            inputs = to_device(self.pairs.model_inputs(rows, roles.pad_id), roles.device)
            mask = inputs["response_mask"]
            tokens = response_logprobs(actor.model, inputs, 1.0, chunk_tokens=actor.chunk_tokens,  # type: ignore[union-attr]
                                       remove_padding=actor.remove_padding)[0]  # type: ignore[union-attr]
            policy_logps, k = sequence_logps(tokens, mask, average), len(rows)
            nll = -sequence_logps(tokens[:k], mask[:k], average=True)
            out = preference_loss(policy_logps[:k], policy_logps[k:], ref_logps[:k], ref_logps[k:], dpo.beta,  # type: ignore[union-attr]
                                  dpo.loss_type, dpo.label_smoothing, dpo.sft_coef, nll)  # type: ignore[union-attr]
            (out.losses.sum() * scale).backward()
            parts.append(out)
        grad_norm = actor.clip_and_step()  # type: ignore[union-attr]
        actor.scheduler.step()  # type: ignore[union-attr]
        merged = PreferenceLoss(*(torch.cat([getattr(o, f) for o in parts]).detach() for f in
                                  ("losses", "chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")))
        return merged, grad_norm

    @torch.no_grad()
    def ref_logps(self, micro_rows: list[list[int]], average: bool) -> list[torch.Tensor]:
        """The reference's sequence log-probs of every micro-batch, in one resident pass."""
        roles = self.roles
        actor, ref = roles.actor, roles.ref_model
        out = []
        with roles.ref_offload.resident():
            for rows in micro_rows:
                inputs = to_device(self.pairs.model_inputs(rows, roles.pad_id), roles.device)
                tokens = response_logprobs(ref, inputs, 1.0, chunk_tokens=actor.chunk_tokens,  # type: ignore[union-attr]
                                           remove_padding=actor.remove_padding)[0]  # type: ignore[union-attr]
                out.append(sequence_logps(tokens, inputs["response_mask"], average))
        return out

    def samples_text(self, pairs: list[int]) -> str:
        """The first pairs of the step, as TensorBoard's text tab shows the RL loop's samples."""
        data = self.pairs.dataset
        rows = [f"| `{data.prompts[i]}` | `{data.chosen[i]}` | `{data.rejected[i]}` |"
                for i in pairs[:self.cfg.logging.num_samples]]
        return "| prompt | chosen | rejected |\n|---|---|---|\n" + "\n".join(rows)
