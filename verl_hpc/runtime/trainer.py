"""The RL loop: generate -> score -> ref/old logprobs -> values -> advantages -> update.

Why the loop is this short: every decision about *where* things run lives in the
components and (later) the distributed runtime; this file is the algorithm a reader
checks against the GRPO and PPO papers. `HybridTrainer` is also the Python API of the
seeds: `HybridTrainer(actor_model=..., reward_model=..., config=...).train()`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_hpc.algo import gae_advantages, grpo_advantages, kl_penalty, token_level_rewards
from verl_hpc.config import RunConfig, dump_config, load_config
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.metrics import MetricsLogger, Progress, memory_metrics
from verl_hpc.roles.actor import UpdatePlan
from verl_hpc.roles.allocator import ResourceAllocator, generate_guarded
from verl_hpc.roles.forward import batched_logprobs, to_device
from verl_hpc.roles.rollout import shares_module
from verl_hpc.roles.weight_sync import push_weights
from verl_hpc.runtime.checkpointing import RunCheckpointer, build_manager, reseed, resume_path, seed_all
from verl_hpc.runtime.components import Components, build_components
from verl_hpc.runtime.env import JobEnvironment
from verl_hpc.runtime.run_dir import prepare_run_dir
from verl_hpc.runtime.signals import StopFlag, requeue
from verl_hpc.runtime.step_metrics import data_metrics, perf_metrics, prefixed, sync_metrics
from verl_hpc.utils.logging import get_logger, setup_logging

log = get_logger("trainer")


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    hf_model_dir: Path | None
    last_metrics: dict[str, float] = field(default_factory=dict)
    stopped_by: str | None = None  # the signal that stopped the run early, if any


class Timer:
    """Collects `timing_s/<name>` for one step."""

    def __init__(self, on_enter=None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_enter = on_enter

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.on_enter is not None:
            self.on_enter(name)
        start = time.perf_counter()
        yield
        self.seconds[f"timing_s/{name}"] = self.seconds.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


class HybridTrainer:
    def __init__(self, config: RunConfig | str | Path | dict[str, Any], actor_model: Any = None,
                 reward_model: Any = None, run_dir: str | Path | None = None, overrides: list[str] | None = None):
        if isinstance(config, RunConfig):
            self.config = config if not overrides else load_config(data=config.model_dump(by_alias=True),
                                                                   overrides=overrides)
        elif isinstance(config, dict):
            self.config = load_config(data=config, overrides=overrides)
        else:
            self.config = load_config(config, overrides=overrides)
        self._actor_model, self._reward_model = actor_model, reward_model
        self.run_dir = prepare_run_dir(run_dir or self.config.run_dir, self.config)
        self.step = 0
        self.policy_version = 0
        self.last_sync_bytes = 0  # bytes of the latest weight update into a separate engine

    def train(self) -> TrainResult:
        cfg = self.config
        setup_logging(self.run_dir / "logs", "trainer", 0, cfg.logging.level)
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        seed_all(cfg.trainer.seed)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        comps = build_components(cfg, self.run_dir, self._actor_model, self._reward_model)
        self.components = comps
        comps.actor.allocator = ResourceAllocator(comps.device, cfg.trainer.min_micro_batch_size, cfg.trainer.oom_retry)
        prompts_per_step = cfg.trainer.batch_size // cfg.algorithm.sampling.n
        self.sampler = PromptSampler(len(comps.dataset), prompts_per_step, cfg.trainer.seed, cfg.data.shuffle)
        self.checkpointer = RunCheckpointer(cfg, self.run_dir, build_manager(cfg, self.run_dir), {"trainer": 1}, True)
        self.resume(comps)
        logger = MetricsLogger(self.run_dir / "tensorboard", cfg.logging.tensorboard, purge_step=self.step + 1)
        progress = Progress(cfg.trainer.total_steps, self.step, cfg.logging.progress)
        log.info("training %s for %d steps in %s", cfg.algorithm.name, cfg.trainer.total_steps, self.run_dir)
        metrics: dict[str, float] = {}
        stop = StopFlag().install()
        try:
            while self.step < cfg.trainer.total_steps:
                self.step += 1
                reseed(cfg.trainer.seed, self.step)
                metrics = self.train_step(comps, logger)
                self.checkpointer.requested = self.checkpointer.requested or stop.agreed() is not None
                if self.checkpointer.due(self.step):
                    final = self.step == cfg.trainer.total_steps or self.checkpointer.requested
                    self.checkpointer.save(self.step, self.policy_version, self.sampler, comps.actor,
                                           comps.critic, block=True if final else None)
                    metrics["timing_s/save_checkpoint"] = self.checkpointer.save_seconds
                if self.step % cfg.logging.log_every == 0 or self.step == cfg.trainer.total_steps:
                    logger.log_scalars(self.step, metrics)
                progress.update(self.step, {"score": metrics["critic/score/mean"],
                                            "s/step": metrics["timing_s/step"]})
                if stop.received is not None:
                    break
        finally:
            stop.restore()
            comps.rollout.close()
            self.checkpointer.manager.wait()
            progress.close()
            logger.close()
        if stop.received is not None and self.step < cfg.trainer.total_steps:  # at the last step: just finish
            log.warning("stopped by %s after step %d (checkpoint saved); %s", StopFlag.name(stop.received),
                        self.step, requeue(JobEnvironment.from_env(), cfg.slurm.max_requeues, stop.received)[1])
            return TrainResult(self.run_dir, self.step, None, metrics, StopFlag.name(stop.received))
        hf_dir = self.save_hf_model(comps) if cfg.trainer.save_hf_model else None
        log.info("done: %d steps, final score %.4f", self.step, metrics.get("critic/score/mean", float("nan")))
        return TrainResult(self.run_dir, self.step, hf_dir, metrics)

    def resume(self, comps: Components) -> None:
        path = resume_path(self.config, self.run_dir)
        if path is None:
            return
        run = self.checkpointer.restore(path, self.sampler, comps.actor, comps.critic)
        self.step, self.policy_version = run["step"], run["policy_version"]
        self.push_weights(comps)  # restored weights must reach an engine that holds its own copy

    def train_step(self, comps: Components, logger: MetricsLogger) -> dict[str, float]:
        cfg, timer = self.config, Timer()
        comps.actor.allocator.probe()
        with timer("step"):
            with timer("gen"):
                batch = self.generate(comps)
            with timer("reward"):
                batch = batch.with_columns(score=comps.reward.score(batch))
            inputs = to_device(batch.model_inputs(comps.tokenizer.pad_token_id), comps.device)
            self.add_logprobs_and_values(comps, inputs, timer)
            with timer("adv"):
                self.add_advantages(batch, inputs)
            batch = batch.with_columns(**{k: inputs[k] for k in ("advantages", "returns", "ref_logprobs",
                                                                  "old_logprobs", "values") if k in inputs})
            plan = UpdatePlan.from_config(cfg.algorithm, len(batch))
            train_metrics: dict[str, float] = {}
            if comps.critic is not None:
                with timer("update_critic"):
                    train_metrics.update(prefixed("critic", comps.critic.update(inputs, plan)))
            if self.step > cfg.algorithm.critic_warmup_steps:
                with timer("update_actor"):
                    train_metrics.update(prefixed("actor", comps.actor.update(inputs, plan)))
                with timer("update_weights"):
                    self.sync_weights(comps)
        if self.step % cfg.logging.sample_every == 0 and cfg.logging.num_samples:
            logger.log_text(self.step, "samples", self.samples_text(comps, batch))
        return {**data_metrics(batch.scores(), inputs, cfg.algorithm.sampling.max_new_tokens),
                **train_metrics, **timer.seconds, **perf_metrics(inputs, timer.seconds["timing_s/step"]),
                **memory_metrics(comps.device), **comps.actor.allocator.metrics(), **self.sync_metrics(timer),
                "actor/policy_version": float(self.policy_version)}

    def generate(self, comps: Components) -> RolloutBatch:
        n = self.config.algorithm.sampling.n
        indices = self.sampler.next_indices()
        prompt_ids = [comps.prompt_ids[i] for i in indices for _ in range(n)]
        out = generate_guarded(comps.rollout, prompt_ids, self.config.algorithm.sampling, comps.actor.allocator)
        return RolloutBatch.from_generation(
            prompt_ids, out.response_ids, out.logprobs,
            group_ids=[g for g in range(len(indices)) for _ in range(n)],
            prompt_index=[i for i in indices for _ in range(n)],
            ground_truth=[comps.dataset.answers[i] for i in indices for _ in range(n)],
            policy_version=comps.rollout.policy_version)

    def add_logprobs_and_values(self, comps: Components, inputs: dict[str, torch.Tensor], timer: Timer) -> None:
        algo = self.config.algorithm
        plan = UpdatePlan.from_config(algo, inputs["input_ids"].shape[0])
        if comps.ref_model is not None:
            with timer("ref"):
                inputs["ref_logprobs"] = batched_logprobs(comps.ref_model, inputs, algo.sampling.temperature,
                                                          plan.micro_batch_size)
        if comps.actor.old_logprobs_needed(plan, inputs["input_ids"].shape[0]):
            with timer("old_log_prob"):
                inputs["old_logprobs"] = comps.actor.compute_logprobs(inputs, plan.micro_batch_size)
        if comps.critic is not None:
            with timer("values"):
                inputs["values"] = comps.critic.compute_values(inputs, plan.micro_batch_size)

    def add_advantages(self, batch: RolloutBatch, inputs: dict[str, torch.Tensor]) -> None:
        algo, mask = self.config.algorithm, inputs["response_mask"]
        scores = batch.scores().to(mask.device)
        if algo.name == "grpo":
            group_ids = torch.tensor(batch.column("group_id").to_numpy(), dtype=torch.long).to(mask.device)
            inputs["advantages"], inputs["returns"] = grpo_advantages(scores, group_ids, mask, algo.norm_adv_by_std)
            return
        kl = None
        if algo.kl.in_reward and "ref_logprobs" in inputs:
            old = inputs.get("old_logprobs", inputs["ref_logprobs"])
            kl = kl_penalty(old, inputs["ref_logprobs"], algo.kl.estimator)
        inputs["token_rewards"] = token_level_rewards(scores, mask, kl, algo.kl.coef if kl is not None else 0.0)
        inputs["advantages"], inputs["returns"] = gae_advantages(inputs["token_rewards"], inputs["values"], mask,
                                                                 algo.gamma, algo.lam)

    def sync_weights(self, comps: Components) -> None:
        self.policy_version += 1
        self.push_weights(comps)

    def sync_metrics(self, timer: Timer) -> dict[str, float]:
        """Weight-update bytes and GB/s, for engines that take a copy (none when shared)."""
        if not self.last_sync_bytes:
            return {}
        return sync_metrics(self.last_sync_bytes, timer.seconds.get("timing_s/update_weights", 0.0))

    def push_weights(self, comps: Components) -> None:
        """An HF engine shares the actor's module, so only the version moves; vLLM takes a copy."""
        if shares_module(comps.rollout, comps.actor.model):
            comps.rollout.policy_version = self.policy_version
        else:
            self.last_sync_bytes = push_weights(comps.actor.model.named_parameters(), comps.rollout,
                                                self.policy_version)

    def samples_text(self, comps: Components, batch: RolloutBatch) -> str:
        count = min(self.config.logging.num_samples, len(batch))
        decode = comps.tokenizer.decode
        rows = [f"| `{decode(p)}` | `{decode(r, skip_special_tokens=True)}` | {s:.3f} |" for p, r, s in zip(
            batch.column("prompt_ids").to_pylist()[:count], batch.column("response_ids").to_pylist()[:count],
            batch.scores().tolist()[:count], strict=True)]
        return "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows)

    def save_hf_model(self, comps: Components) -> Path:
        from verl_hpc.checkpoint.hf_export import save_hf_directory

        return save_hf_directory(comps.actor.model, comps.tokenizer, self.run_dir / "hf_model")
