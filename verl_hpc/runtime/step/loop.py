"""The one RL loop: generate -> score -> ref/old logprobs, values -> advantages -> update -> sync.

Why one loop: this file is the algorithm a reader checks against the GRPO and PPO papers,
and it is the same code for one process, a colocated hybrid engine and split role groups.
Where each stage runs is the placement's business (runtime/placement/); what an estimator
needs is the registry's (verl_hpc.algo); when to save, stop or resume is the lifecycle's
(runtime/lifecycle.py). Every trainer rank runs `train_step` on its own rows of the step;
a rank that hosts no trainer runs its role's part of the same step (`placement.serve`).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_hpc.algo import AdvantageInputs, kl_penalty, token_level_rewards
from verl_hpc.config import RunConfig
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.metrics import memory_metrics
from verl_hpc.roles.forward import to_device
from verl_hpc.runtime.placement.one_process import Placement, Timer
from verl_hpc.runtime.state.seeding import reseed
from verl_hpc.runtime.step.counters import StepCounters
from verl_hpc.runtime.step.dynamic_sampling import filtered_rollouts
from verl_hpc.runtime.step.metrics import data_metrics_reduced, perf_metrics, prefixed, sync_metrics

UPDATE_COLUMNS = ("advantages", "returns", "token_rewards", "ref_logprobs", "old_logprobs", "values")


class RLTrainer(StepCounters):
    """The step and the counters that say where the run is (`state_dict` rides in checkpoints)."""

    progress_metric = ("score", "critic/score/mean")  # what the progress line shows

    def __init__(self, cfg: RunConfig, placement: Placement, sampler: PromptSampler,
                 on_stage: Any = None):
        super().__init__(on_stage)
        self.cfg, self.placement, self.sampler = cfg, placement, sampler
        placement.attach_sampler(sampler)  # a rollout group draws the prompts of extra sampling rounds
        self.last_batch: RolloutBatch | None = None  # the leader's rows of the latest step

    def next_step(self) -> dict[str, float] | None:
        """Advance one step; the step's metrics (a serving rank: its own part's), None when told to stop."""
        self.step += 1
        reseed(self.cfg.trainer.seed, self.step, self.placement.seed_stream())
        indices = self.sampler.next_indices()
        if not self.placement.trains:
            timer = self.timer()
            with timer("step"):
                serving = self.placement.serve(self.step, indices, timer)
            return self.placement.serve_metrics(timer) if serving else None
        return self.train_step(indices)

    def train_step(self, indices: list[int]) -> dict[str, float] | None:
        cfg, p, timer = self.cfg, self.placement, self.timer()
        algo = cfg.algorithm
        with timer("step"):
            batch, round_metrics = self.collect_rollouts(indices, timer)
            if batch is None:
                return None
            lag = self.policy_version - min(batch.column("policy_version").to_pylist())
            inputs = to_device(batch.model_inputs(p.roles.pad_id), p.roles.device)
            self.forward_passes(batch, inputs, timer)
            with timer("adv"):
                self.add_advantages(batch, inputs)
            train_metrics: dict[str, float] = dict(round_metrics)
            intake = p.intake_metrics()  # rank 0's own counts: not averaged with the others' below
            if algo.needs_critic:
                with timer("update_critic"):
                    train_metrics.update(prefixed("critic", p.update_critic(batch, inputs)))
            update_actor = self.step > algo.critic_warmup_steps
            if update_actor:
                with timer("update_actor"):
                    train_metrics.update(prefixed("actor", p.roles.actor.update(inputs, p.plan())))
                self.policy_version += 1
            train_metrics.update(self.rollout_probs_diff(batch, inputs))
            with timer("update_weights"):
                sync_bytes = p.sync_weights(self.policy_version, changed=update_actor)
        if cfg.data.record_rollouts:  # the rows leave this rank: carry the step's columns
            batch = batch.with_columns(**{k: inputs[k] for k in UPDATE_COLUMNS if k in inputs})
        p.record(self.step, batch)
        metrics = self.step_metrics(batch, inputs, p.mean_metrics(train_metrics), timer, sync_bytes)
        return {**metrics, **intake, "rollout/policy_lag": float(lag)} if metrics else metrics

    def collect_rollouts(self, indices: list[int], timer: Timer) -> tuple[RolloutBatch | None, dict[str, float]]:
        """This rank's scored rows of the step: one generation round, or DAPO's dynamic sampling."""
        p = self.placement
        if not self.cfg.algorithm.filter_groups.enable:
            return p.rollouts(self.step, indices, self.policy_version, timer), {}
        return filtered_rollouts(p, self.step, indices, self.policy_version, timer, self.sampler)

    def forward_passes(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor], timer: Timer) -> None:
        """Reference and old logprobs, critic values: what the estimator and losses will read."""
        algo, p = self.cfg.algorithm, self.placement
        if algo.needs_ref:
            with timer("ref"):
                inputs["ref_logprobs"] = p.ref_logprobs(batch, inputs)
        rows = inputs["input_ids"].shape[0]
        # The in-reward KL compares the sampling policy with the reference: it needs the old logprobs.
        if algo.kl.in_reward or p.roles.actor.old_logprobs_needed(p.plan(), rows):  # type: ignore[union-attr]
            with timer("old_log_prob"):
                inputs["old_logprobs"] = p.roles.actor.compute_logprobs(  # type: ignore[union-attr]
                    inputs, p.plan().micro_batch_size, p.plan().token_budget)
        if algo.needs_critic:
            with timer("values"):
                inputs["values"] = p.values(batch, inputs)

    def rollout_probs_diff(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
        """|p_engine - p_trainer| of the sampled tokens (verl's `training/rollout_probs_diff_*`).

        Why every step: an engine that silently stops following the weight updates (a stale
        tied LM head after a reload, say) still produces plausible text; its probabilities of
        its own samples drift from the trainer's, and this shows it at once. The trainer side
        is the old-logprob pass when one ran, else the update's own first forward.
        """
        actor = self.placement.roles.actor
        trainer = inputs.get("old_logprobs", actor.sampled_logprobs)  # type: ignore[union-attr]
        if trainer is None or not batch.has("rollout_logprobs"):
            return {}
        mask = inputs["response_mask"]
        engine = batch.token_tensor("rollout_logprobs", mask.shape[1]).to(mask.device)
        diff = (engine.exp() - trainer.float().exp()).abs() * mask
        p = self.placement
        total = p.reduce_sum(torch.stack([diff.sum(), mask.sum()]).double().cpu())
        largest = p.reduce_max(diff.max().reshape(1).double().cpu())
        return {"training/rollout_probs_diff_mean": float(total[0] / total[1].clamp(min=1)),
                "training/rollout_probs_diff_max": float(largest[0])}

    def add_advantages(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> None:
        algo, mask = self.cfg.algorithm, inputs["response_mask"]
        scores = batch.scores().to(mask.device)
        kl = None
        if algo.kl.in_reward:
            kl = kl_penalty(inputs["old_logprobs"], inputs["ref_logprobs"], algo.kl.estimator)
        token_rewards = token_level_rewards(scores, mask, kl, algo.kl.coef if kl is not None else 0.0)
        group_ids = torch.from_numpy(batch.column("group_id").to_numpy()).to(mask.device)
        advantages, returns = algo.estimator.compute(AdvantageInputs(
            scores=scores, group_ids=group_ids, response_mask=mask, token_rewards=token_rewards,
            values=inputs.get("values"), algo=algo, reduce_sum=self.placement.reduce_sum,
            baselines=batch.baseline_scores().to(mask.device) if algo.estimator.greedy_baseline else None))
        inputs.update(advantages=advantages.float(), returns=returns.float(), token_rewards=token_rewards.float())

    def step_metrics(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor], train_metrics: dict[str, float],
                     timer: Timer, sync_bytes: int) -> dict[str, float]:
        """verl's metric names, over the whole step (leader), {} on the other trainer ranks.

        Why reductions: the data statistics are sums and extremes over rows, so every trainer
        rank reduces partials of its own rows (collectives: all of them call this) rather than
        sending its rows to the leader, which at many nodes funnels the step through rank 0.
        """
        p, cfg = self.placement, self.cfg
        data = data_metrics_reduced(batch.scores(), inputs, cfg.algorithm.sampling.max_new_tokens,
                                    p.reduce_sum, p.reduce_max)
        if not p.is_leader:
            return {}
        self.last_batch = batch  # the leader's own rows: the samples TensorBoard shows
        actor = p.roles.actor
        actor.allocator.probe()  # type: ignore[union-attr]
        step_seconds, total_tokens = timer.seconds["timing_s/step"], data.pop("perf/total_num_tokens")
        metrics = {**data, **train_metrics, **timer.seconds, **perf_metrics(total_tokens, step_seconds),
                   **memory_metrics(p.roles.device), **actor.allocator.metrics(),  # type: ignore[union-attr]
                   "actor/policy_version": float(self.policy_version)}
        if sync_bytes or p.last_sync_bytes:
            metrics.update(sync_metrics(sync_bytes, timer.seconds.get("timing_s/update_weights", 0.0),
                                        overlapped=p.sync_overlapped))
        reward = p.roles.reward
        if reward is not None and hasattr(reward, "metrics"):
            metrics.update(reward.metrics())
        return metrics

    def samples_text(self, batch: RolloutBatch) -> str:
        count = min(self.cfg.logging.num_samples, len(batch))
        decode = self.placement.roles.tokenizer.decode
        rows = [f"| `{decode(p)}` | `{decode(r, skip_special_tokens=True)}` | {s:.3f} |" for p, r, s in zip(
            batch.column("prompt_ids").to_pylist()[:count], batch.column("response_ids").to_pylist()[:count],
            batch.scores().tolist()[:count], strict=True)]
        return "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows)
