"""The RL loop across processes: one torch.distributed world, a process group per role.

Every rank runs the same step in lockstep; what it does depends on its group:
- generators (the rollout group when `split`, the trainer ranks when `colocated`) sample
  responses for their slice of the step's prompts and score them with the rule reward;
- the batches reach trainer rank 0 as Arrow record batches (Arrow Flight from a separate
  rollout group; a gather inside the trainer group when colocated);
- trainer rank 0 computes GRPO advantages (they need whole groups) and hands each trainer
  rank its contiguous shard; the FSDP2-sharded actor (and critic/ref) update on shards;
- the new weights go back to the engines: bucketed broadcast (split) or streamed per
  parameter into the colocated engine. Each rollout is stamped with the policy version.
The prompt order is computed identically on every rank from the seed, so no rank needs
to be told which prompts come next.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - registers pa.compute
import torch
import torch.distributed as dist

from verl_hpc.algo import grpo_advantages
from verl_hpc.config import RunConfig
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.metrics import MetricsLogger, Progress, memory_metrics
from verl_hpc.roles.actor import UpdatePlan
from verl_hpc.roles.allocator import generate_guarded
from verl_hpc.roles.forward import to_device
from verl_hpc.roles.weight_sync import (
    STOP_VERSION,
    iter_full_params,
    push_weights,
)
from verl_hpc.runtime.checkpointing import reseed, seed_all
from verl_hpc.runtime.dist import DistContext, default_store
from verl_hpc.runtime.dist_intake import RolloutIntake
from verl_hpc.runtime.dist_lifecycle import DistLifecycle
from verl_hpc.runtime.dist_roles import STOP_PAYLOAD, build_roles
from verl_hpc.runtime.heartbeat import (
    PULSE_SECONDS,
    STALE_PULSES,
    Heartbeat,
    StallError,
    is_peer_lost,
    is_timeout,
)
from verl_hpc.runtime.signals import REQUEUE_SIGNALS, StopFlag, requeue
from verl_hpc.runtime.step_metrics import data_metrics, perf_metrics, sync_metrics
from verl_hpc.runtime.trainer import Timer
from verl_hpc.utils.logging import get_logger

log = get_logger("dist_trainer")


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous [start, end) of `total` items for part `index` of `parts` (sizes differ by ≤ 1)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class DistributedTrainer(DistLifecycle, RolloutIntake):
    def __init__(self, cfg: RunConfig, ctx: DistContext, run_dir: Path, stop: StopFlag | None = None):
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        self.step, self.policy_version, self.resume_step = 0, 0, 0
        self.last_sync_bytes = 0  # rollout ranks: bytes of the latest weight update received
        self.stopping = False
        # The worker installs the flag before anything slow: a USR1 during start-up must not kill it.
        self.stop, self._own_stop = (stop, False) if stop is not None else (StopFlag(), True)
        self.requeued = False  # leader: whether a stop ended in `scontrol requeue`
        self.wanted_requeue = False  # leader: whether the stop signal asked for one (USR1/USR2)
        self.pending: dict[int, list[RolloutBatch]] = {}  # leader: rollouts filed by step
        self.buffered_steps = 0  # after a resume: steps whose rollouts came from the checkpoint
        self.is_leader = ctx.env.rank == ctx.plan.group_ranks("trainer")[0]

    def train(self) -> str | None:
        """Run to the end, or until a stop signal; returns the signal's name if stopped."""
        cfg, ctx = self.cfg, self.ctx
        seed_all(cfg.trainer.seed + ctx.env.rank)
        self.roles = build_roles(cfg, ctx, self.run_dir)
        self.allocator = self.make_allocators()
        prompts_per_step = cfg.trainer.batch_size // cfg.algorithm.sampling.n
        self.sampler = PromptSampler(len(self.roles.dataset), prompts_per_step, cfg.trainer.seed, cfg.data.shuffle)
        self.rollout_logger = MetricsLogger(self.run_dir / "tensorboard" / f"rollout_rank{ctx.env.rank}",
                                            cfg.logging.tensorboard) \
            if self.split and ctx.is_role("rollout") and ctx.rank_in_group == 0 else None
        self.heartbeat = Heartbeat(ctx.plan, ctx.env.rank, default_store())
        self.heartbeat.start()
        self.checkpointer = self.make_checkpointer() if ctx.is_role("actor") else None
        if self._own_stop:
            self.stop.install()
        ctx.barrier("start")
        self.resume_step = self.resume()
        logger = MetricsLogger(self.run_dir / "tensorboard", cfg.logging.tensorboard,
                               purge_step=self.resume_step + 1) if self.is_leader else None
        progress = Progress(cfg.trainer.total_steps, self.step, cfg.logging.progress) if self.is_leader else None
        try:
            stopped_by = self.loop(logger, progress)
            if self.checkpointer is not None:
                self.checkpointer.manager.wait()
            if stopped_by is None:
                ctx.barrier("end")
                if cfg.trainer.save_hf_model and ctx.is_role("actor"):
                    self.save_hf_model()
            return stopped_by
        finally:
            self.heartbeat.close()
            if self._own_stop:  # a worker keeps ignoring late signals (a second TERM) until it exits
                self.stop.restore()
            for sink in (progress, logger, self.rollout_logger):
                if sink is not None:
                    sink.close()
            self.roles.close()

    def loop(self, logger: MetricsLogger | None, progress: Progress | None) -> str | None:
        cfg, ctx = self.cfg, self.ctx
        while self.step < cfg.trainer.total_steps:
            self.step += 1
            reseed(cfg.trainer.seed, self.step, ctx.env.rank if not ctx.is_role("rollout") else
                   1000 + ctx.rank_in_group)
            metrics, signum, resizing = self.guarded_step()
            if self.stopping:  # a rollout or reward rank was told to stop by the trainer
                return "stop requested by the trainer"
            if logger is not None and progress is not None:
                logger.log_scalars(self.step, metrics)
                progress.update(self.step, {"score": metrics["critic/score/mean"],
                                            "s/step": metrics["timing_s/step"]})
            if resizing:
                return self.stop_for_resize()
            if signum:
                self.stop_others()
                if self.is_leader:
                    self.requeued, message = requeue(ctx.env, cfg.slurm.max_requeues, signum)
                    self.wanted_requeue = signum in REQUEUE_SIGNALS
                    log.warning("stopped by %s after step %d (checkpoint saved); %s", StopFlag.name(signum),
                                self.step, message)
                    print(f"verl-hpc: {message}", file=sys.stderr, flush=True)
                return StopFlag.name(signum)
        return None

    @property
    def has_reward_group(self) -> bool:
        return any(g.name == "reward" for g in self.ctx.plan.groups)

    @property
    def split(self) -> bool:
        return "rollout" not in self.ctx.plan.groups[0].roles

    def guarded_step(self) -> tuple[dict[str, float], int | None, bool]:
        """`step_and_agree`, with a timeout or a lost peer turned into an error naming the suspect."""
        try:
            return self.step_and_agree()
        except (RuntimeError, TimeoutError, ConnectionError) as err:
            if not (is_timeout(err) or is_peer_lost(err)):
                raise
            what = "timed out" if is_timeout(err) else "lost a peer"
            settle = 0.0 if is_timeout(err) else STALE_PULSES * PULSE_SECONDS + 1.0  # let its pulse go stale
            raise StallError(f"step {self.step} {what} on {self.ctx.group.name} rank {self.ctx.env.rank}: "
                             f"{str(err).splitlines()[0][:300]} -- {self.heartbeat.describe_stall(settle)}") from err

    def step_and_agree(self) -> tuple[dict[str, float], int | None, bool]:
        """One step, then the collectives that close it: stop and resize agreement, checkpoint."""
        metrics = self.train_step()
        ctx = self.ctx
        if self.stopping or not ctx.is_role("actor"):
            return metrics, None, False
        self.heartbeat.enter(f"step {self.step} agree")
        signum = self.stop.agreed(ctx.process_group)
        resizing = not signum and self.resize_agreed()
        if self.checkpointer is not None and (signum or resizing):
            self.checkpointer.requested = True
        self.maybe_save(metrics)
        return metrics, signum, resizing

    def train_step(self) -> dict[str, float]:
        """One step of this rank's part; returns metrics on trainer rank 0 (else {})."""
        timer, roles, ctx = Timer(on_enter=lambda name: self.heartbeat.enter(f"step {self.step} {name}")), \
            self.roles, self.ctx
        with timer("step"):
            indices = self.sampler.next_indices()
            if self.split and ctx.is_role("rollout"):
                return self.rollout_step(indices, timer)
            local = None
            if roles.engine is not None:  # colocated: the engine wakes for generation only
                with timer("gen"):
                    roles.engine.wake_up()
                    local = self.generate(indices)
                    roles.engine.sleep()
            full = None
            if ctx.is_role("actor"):
                with timer("wait_rollout"):
                    full = self.collect(local)
            if self.has_reward_group or roles.scorer is not None:
                with timer("reward"):
                    full = roles.score_batch(full, ctx, self.is_leader)
                if full is STOP_PAYLOAD:
                    self.stopping = True
                    return {}
            if not ctx.is_role("actor"):
                return {}
            metrics = self.train_on(full, timer)
            with timer("update_weights"):
                sync_bytes = self.send_weights()
        if self.is_leader:
            metrics.update(timer.seconds)
            metrics.update(sync_metrics(sync_bytes, timer.seconds.get("timing_s/update_weights", 0.0)))
            metrics["perf/throughput"] = metrics.get("perf/total_num_tokens", 0.0) / timer.seconds["timing_s/step"]
        return metrics

    def rollout_step(self, indices: list[int], timer: Timer) -> dict[str, float]:
        """Split placement: take the weights of version step-k-1, generate, send the batch.

        With `max_staleness: k` the rollout runs k batches ahead of the trainer, so step
        s's batch comes from weights s-1-k versions old while the trainer is at s-1: the
        generation of batch s+1 overlaps the trainer's update on batch s.
        """
        lag = self.cfg.algorithm.max_staleness
        if self.step <= self.resume_step + self.buffered_steps:
            return {}  # this step's rollouts were restored from the checkpoint
        if self.step > self.resume_step + lag + 1:
            with timer("update_weights"):
                self.receive_weights()
            if self.stopping:
                return {}
        with timer("gen"):
            batch = self.generate(indices)
        with timer("send"):
            try:
                self.roles.flight_client.put(batch)
            except Exception:  # the trainer shut its server down: a stop, unless no stop was asked
                if self.stop.received is None:
                    raise
                self.stopping = True
                return {}
        if self.rollout_logger is not None:
            synced = sync_metrics(self.last_sync_bytes, timer.seconds.get("timing_s/update_weights", 0.0))
            self.rollout_logger.log_scalars(self.step, {**timer.seconds, **synced, "rollout/policy_version":
                                                        float(self.roles.engine.policy_version)})
        return {}

    def generate(self, indices: list[int]) -> RolloutBatch:
        """This generator's slice of the step's prompts, n samples each, scored by the rule reward."""
        roles, n = self.roles, self.cfg.algorithm.sampling.n
        generators = self.ctx.group.size
        start, end = shard_range(len(indices), generators, self.ctx.rank_in_group)
        mine = indices[start:end]
        prompt_ids = [roles.prompt_ids[i] for i in mine for _ in range(n)]
        out = generate_guarded(roles.engine, prompt_ids, self.cfg.algorithm.sampling, self.allocator) \
            if prompt_ids else None
        batch = RolloutBatch.from_generation(
            prompt_ids, out.response_ids if out else [], out.logprobs if out else [],
            group_ids=[start + g for g in range(len(mine)) for _ in range(n)],
            prompt_index=[i for i in mine for _ in range(n)],
            ground_truth=[roles.dataset.answers[i] for i in mine for _ in range(n)],
            policy_version=roles.engine.policy_version, step=self.step)
        if roles.rule_reward is not None and len(batch):
            batch = batch.with_columns(score=roles.rule_reward.score(batch))
        return batch

    def collect(self, local: RolloutBatch | None) -> RolloutBatch | None:
        """All generators' batches, concatenated in group order, on trainer rank 0."""
        ctx, roles = self.ctx, self.roles
        if ctx.plan.groups[0].roles.count("rollout"):  # colocated: gather inside the trainer group
            parts: list[bytes | None] = [None] * ctx.group.size if self.is_leader else []
            dist.gather_object(local.to_ipc() if local is not None else b"", parts if self.is_leader else None,
                               dst=ctx.plan.group_ranks("trainer")[0], group=ctx.process_group)
            if not self.is_leader:
                return None
            batches = [RolloutBatch.from_ipc(p) for p in parts if p]
        elif ctx.is_role("rollout"):
            roles.flight_client.put(local)
            return None
        elif self.is_leader:
            batches = self.receive_rollouts()
        else:
            return None
        return _sorted_by_group(RolloutBatch.concat(batches))

    def train_on(self, full: RolloutBatch | None, timer: Timer) -> dict[str, float]:
        """Advantages on rank 0, shards to every trainer rank, then the sharded updates."""
        ctx, roles, cfg = self.ctx, self.roles, self.cfg
        payload: list[object] = [None]
        if self.is_leader:
            with timer("adv"):
                full = self.add_grpo_advantages(full) if cfg.algorithm.name == "grpo" else full
            payload = [full.to_ipc()]
        dist.broadcast_object_list(payload, src=ctx.plan.group_ranks("trainer")[0], group=ctx.process_group)
        batch = RolloutBatch.from_ipc(payload[0])  # type: ignore[arg-type]
        start, end = shard_range(len(batch), ctx.group.size, ctx.rank_in_group)
        shard = batch.take(list(range(start, end)))
        inputs = to_device(shard.model_inputs(roles.pad_id), roles.device)
        if cfg.algorithm.name == "grpo":
            width = inputs["response_mask"].shape[1]
            inputs["advantages"] = shard.token_tensor("advantages", width).to(roles.device)
        metrics = roles.update(inputs, shard, UpdatePlan.from_config(cfg.algorithm, len(shard)), timer, ctx)
        if self.is_leader:
            metrics.update(data_metrics(batch.scores(), batch.model_inputs(roles.pad_id),
                                        cfg.algorithm.sampling.max_new_tokens))
            metrics.update(perf_metrics(batch.model_inputs(roles.pad_id), 1.0))
            metrics.update(memory_metrics(roles.device))
            roles.actor.allocator.probe()  # free memory between steps, logged with the degrade events
            metrics.update(roles.actor.allocator.metrics())
            metrics["actor/policy_version"] = float(self.policy_version + 1)
            metrics["rollout/policy_lag"] = float(self.check_staleness(batch))
        return metrics

    def check_staleness(self, batch: RolloutBatch) -> int:
        """How many versions behind the actor the oldest rollout is; never above the limit."""
        lag = self.policy_version - min(batch.column("policy_version").to_pylist())
        if lag > self.cfg.algorithm.max_staleness:
            raise RuntimeError(f"step {self.step}: a rollout is {lag} policy versions old, above "
                               f"algorithm.max_staleness={self.cfg.algorithm.max_staleness}")
        return lag

    def add_grpo_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        scores = batch.scores()
        group_ids = torch.tensor(batch.column("group_id").to_numpy(), dtype=torch.long)
        mask = batch.model_inputs(self.roles.pad_id)["response_mask"]
        adv, _ = grpo_advantages(scores, group_ids, mask, self.cfg.algorithm.norm_adv_by_std)
        return batch.with_columns(advantages=adv, returns=adv)

    def send_weights(self) -> int:
        """Trainer side: new actor weights into the engines; returns the bytes this rank moved."""
        roles = self.roles
        self.policy_version += 1
        if not self.split:
            return push_weights(iter_full_params(roles.actor.model), roles.engine, self.policy_version)
        last_needed = self.cfg.trainer.total_steps - self.cfg.algorithm.max_staleness - 1
        if self.step > last_needed:
            return 0  # the rollout has generated its last batch: nobody is listening
        return self.send_split()

    def receive_weights(self) -> None:
        version, received = self.receive_split()
        if version == STOP_VERSION:
            self.stopping = True
        else:
            self.last_sync_bytes = received


def _sorted_by_group(batch: RolloutBatch) -> RolloutBatch:
    order = pa.compute.sort_indices(batch.record_batch, sort_keys=[("group_id", "ascending")])
    return batch.take(order.to_numpy())

