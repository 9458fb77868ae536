"""The one RL loop: generate -> score -> ref/old logprobs, values -> advantages -> update -> sync.

Why one loop: this file is the algorithm a reader checks against the GRPO and PPO papers,
and it is the same code for one process, a colocated hybrid engine and split role groups.
Where each stage runs is the placement's business (the `Stages` it implements,
step/stages.py); what an estimator needs is the registry's (verl_hpc.algo); when to save,
stop or resume is the lifecycle's (runtime/lifecycle.py). Every trainer rank runs
`train_step` on its own rows of the step; a rank that hosts no trainer runs its role's part
of the same step (`Service.serve`).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_hpc.algo import AdvantageInputs, kl_penalty, token_level_rewards
from verl_hpc.config import RunConfig
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.state.seeding import reseed
from verl_hpc.runtime.step.counters import StepCounters, Timer
from verl_hpc.runtime.step.dynamic_sampling import filtered_rollouts
from verl_hpc.runtime.step.metrics import (
    data_metrics_reduced,
    episode_metrics_reduced,
    perf_metrics,
    prefixed,
    sync_metrics,
    turn_versions,
    version_metrics,
)
from verl_hpc.runtime.step.stages import Placement, Stages, StepData, SyncReport


class RLTrainer(StepCounters):
    """The step and the counters that say where the run is (`state_dict` rides in checkpoints)."""

    progress_metric = ("score", "critic/score/mean")  # what the progress line shows

    def __init__(self, cfg: RunConfig, placement: Placement, sampler: PromptSampler, on_stage: Any = None):
        super().__init__(on_stage)
        self.cfg, self.placement, self.sampler = cfg, placement, sampler
        self.seat, self.collectives, self.lifecycle = placement.seat, placement.collectives, placement.lifecycle
        self.last_batch: RolloutBatch | None = None  # the leader's rows of the latest step

    @property
    def stages(self) -> Stages:
        assert self.placement.stages is not None, "a serving rank has no trainer stages"
        return self.placement.stages

    def next_step(self) -> dict[str, float] | None:
        """Advance one step; the step's metrics (a serving rank: its own part's), None when told to stop."""
        self.step += 1
        reseed(self.cfg.trainer.seed, self.step, self.seat.stream)
        indices = self.sampler.next_indices()
        service = self.placement.service
        if service is not None:
            timer = self.timer()
            with timer("step"):
                serving = service.serve(self.step, indices, timer, self.sampler)
            return service.serve_metrics(timer) if serving else None
        return self.train_step(indices)

    def train_step(self, indices: list[int]) -> dict[str, float] | None:
        algo, stages, timer = self.cfg.algorithm, self.stages, self.timer()
        with timer("step"):
            batch, round_metrics = self.collect_rollouts(indices, timer)
            if batch is None:
                return None
            versions = version_metrics(turn_versions(batch), self.policy_version)
            data = stages.step_data(batch)
            self.forward_passes(data, timer)
            with timer("adv"):
                self.add_advantages(data)
            train_metrics: dict[str, float] = dict(round_metrics)
            intake = stages.intake_metrics()  # rank 0's own counts: not averaged with the others' below
            if algo.needs_critic:
                with timer("update_critic"):
                    train_metrics.update(prefixed("critic", stages.update_critic(data)))
            update_actor = self.step > algo.critic_warmup_steps
            first_logprobs = None
            if update_actor:
                with timer("update_actor"):
                    update = stages.update_actor(data)
                train_metrics.update(prefixed("actor", update.metrics))
                first_logprobs = update.first_logprobs
                self.policy_version += 1
            train_metrics.update(self.rollout_probs_diff(data, first_logprobs))
            with timer("update_weights"):
                sync = stages.sync_weights(self.policy_version, update_actor, self.step)
        if algo.filter_groups.enable:  # a smaller step (dynamic sampling ran out of groups) lasts one step
            self.seat.lay_out(self.cfg, self.cfg.trainer.batch_size)
        if self.cfg.data.record_rollouts:  # the rows leave this rank: carry the step's columns
            batch = batch.with_columns(**data.added())
        self.lifecycle.record(self.step, batch)
        memory = stages.memory_boundary(data)  # every trainer rank: a re-plan is agreed over all of them
        metrics = self.step_metrics(data, self.collectives.mean_metrics(train_metrics), timer, sync)
        return {**metrics, **memory, **intake, **versions} if metrics else metrics

    def collect_rollouts(self, indices: list[int], timer: Timer) -> tuple[RolloutBatch | None, dict[str, float]]:
        """This rank's scored rows of the step: one generation round, or DAPO's dynamic sampling."""
        if not self.cfg.algorithm.filter_groups.enable:
            return self.stages.rollouts(self.step, indices, self.policy_version, timer), {}
        return filtered_rollouts(self.cfg, self.stages, self.collectives, self.seat, self.step, indices,
                                 self.policy_version, timer, self.sampler)

    def forward_passes(self, data: StepData, timer: Timer) -> None:
        """Reference and old logprobs, critic values: what the estimator and losses will read."""
        algo, stages = self.cfg.algorithm, self.stages
        if algo.needs_ref:
            with timer("ref"):
                data.ref_logprobs = stages.ref_logprobs(data)
        # The in-reward KL compares the sampling policy with the reference: it needs the old logprobs.
        if algo.kl.in_reward or stages.needs_old_logprobs(data):
            with timer("old_log_prob"):
                data.old_logprobs = stages.old_logprobs(data)
        if algo.needs_critic:
            with timer("values"):
                data.values = stages.values(data)

    def rollout_probs_diff(self, data: StepData, first_logprobs: torch.Tensor | None) -> dict[str, float]:
        """|p_engine - p_trainer| of the sampled tokens (verl's `training/rollout_probs_diff_*`).

        Why every step: an engine that silently stops following the weight updates (a stale
        tied LM head after a reload, say) still produces plausible text; its probabilities of
        its own samples drift from the trainer's, and this shows it at once. The trainer side
        is the old-logprob pass when one ran, else the update's own first forward.
        """
        trainer = data.old_logprobs if data.old_logprobs is not None else first_logprobs
        if trainer is None or not data.batch.has("rollout_logprobs"):
            return {}
        mask = data.response_mask
        engine = data.batch.token_tensor("rollout_logprobs", mask.shape[1]).to(mask.device)
        diff = (engine.exp() - trainer.float().exp()).abs() * mask
        total = self.collectives.reduce_sum(torch.stack([diff.sum(), mask.sum()]).double().cpu())
        largest = self.collectives.reduce_max(diff.max().reshape(1).double().cpu())
        return {"training/rollout_probs_diff_mean": float(total[0] / total[1].clamp(min=1)),
                "training/rollout_probs_diff_max": float(largest[0])}

    def add_advantages(self, data: StepData) -> None:
        algo, mask, batch = self.cfg.algorithm, data.response_mask, data.batch
        scores = batch.scores().to(mask.device)
        kl = None
        if algo.kl.in_reward:
            kl = kl_penalty(data.old_logprobs, data.ref_logprobs, algo.kl.estimator)
        token_rewards = token_level_rewards(scores, mask, kl, algo.kl.coef if kl is not None else 0.0)
        group_ids = torch.from_numpy(batch.column("group_id").to_numpy()).to(mask.device)
        advantages, returns = algo.estimator.compute(AdvantageInputs(
            scores=scores, group_ids=group_ids, response_mask=mask, token_rewards=token_rewards,
            values=data.values, algo=algo, reduce_sum=self.collectives.reduce_sum,
            baselines=batch.baseline_scores().to(mask.device) if algo.estimator.greedy_baseline else None))
        data.advantages, data.returns, data.token_rewards = advantages.float(), returns.float(), token_rewards.float()

    def step_metrics(self, data: StepData, train_metrics: dict[str, float], timer: Timer,
                     sync: SyncReport) -> dict[str, float]:
        """verl's metric names, over the whole step (leader), {} on the other trainer ranks.

        Why reductions: the data statistics are sums and extremes over rows, so every trainer
        rank reduces partials of its own rows (collectives: all of them call this) rather than
        sending its rows to the leader, which at many nodes funnels the step through rank 0.
        """
        c = self.collectives
        stats = data_metrics_reduced(data.batch.scores(), data.tensors(), self.cfg.algorithm.sampling.max_new_tokens,
                                     c.reduce_sum, c.reduce_max)
        if self.cfg.rollout.multi_turn.enable:  # agent/*: every rank's episodes, wherever they ran
            stats.update(episode_metrics_reduced(data.batch, c.reduce_sum, c.reduce_max))
        if not self.seat.is_leader:
            return {}
        self.last_batch = data.batch  # the leader's own rows: the samples TensorBoard shows
        step_seconds, total_tokens = timer.seconds["timing_s/step"], stats.pop("perf/total_num_tokens")
        metrics = {**stats, **train_metrics, **timer.seconds, **perf_metrics(total_tokens, step_seconds),
                   **self.stages.role_metrics(), "actor/policy_version": float(self.policy_version)}
        if sync.bytes:
            metrics.update(sync_metrics(sync.bytes, timer.seconds.get("timing_s/update_weights", 0.0),
                                        overlapped=sync.overlapped))
        return metrics

    def samples_text(self, batch: RolloutBatch) -> str:
        """The first rows as a Markdown table: prompt, response, score, and an LLM judge's verdict when one scored."""
        count = min(self.cfg.logging.num_samples, len(batch))
        decode = self.stages.decode
        whole = batch.is_trajectory  # an episode: every turn, tool reply and turn marker shows
        verdicts = batch.column("judge_verdict").to_pylist()[:count]
        judged = any(v is not None for v in verdicts)
        rows = [f"| `{decode(p)}` | `{decode(r, skip_special_tokens=not whole)}` | {s:.3f} |"
                + (f" `{_cell(v)}` |" if judged else "") for p, r, s, v in zip(
            batch.column("prompt_ids").to_pylist()[:count], batch.column("response_ids").to_pylist()[:count],
            batch.scores().tolist()[:count], verdicts, strict=True)]
        head = "| prompt | response | score | judge's verdict |\n|---|---|---|---|\n" if judged else \
            "| prompt | response | score |\n|---|---|---|\n"
        return head + "\n".join(rows)


def _cell(text: str | None) -> str:
    """A verdict inside one table cell: on one line, no backticks or pipes to break the table."""
    return "" if text is None else " ".join(text.split()).replace("`", "'").replace("|", "/")
