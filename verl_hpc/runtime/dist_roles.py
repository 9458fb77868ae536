"""What each process of the distributed runtime holds, by the roles of its group.

Why one object per process: a trainer rank holds the sharded actor (and ref, critic)
and, when colocated, its own rollout engine; a rollout rank holds only an engine, the
rule reward and a Flight client; a reward rank holds only the reward model. Building
that here keeps the step loop free of "if I am ..." branches about construction.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.algo import gae_advantages, token_level_rewards
from verl_hpc.config import RunConfig
from verl_hpc.config.checks import expand_path, resolve_function
from verl_hpc.data.prompts import PromptDataset
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.actor import Actor, UpdatePlan
from verl_hpc.roles.critic import Critic, ValueModel
from verl_hpc.roles.forward import batched_logprobs
from verl_hpc.roles.fsdp import shard_model
from verl_hpc.roles.reward import ModelReward, RuleReward
from verl_hpc.roles.rollout import HFRolloutEngine, RolloutEngine, build_engine
from verl_hpc.roles.weight_sync import stream_into
from verl_hpc.runtime.components import DTYPES, prompt_files, tokenize_prompts
from verl_hpc.runtime.dist import DistContext
from verl_hpc.runtime.step_metrics import prefixed

STOP_PAYLOAD = "stop"  # sent instead of a batch: the reward ranks leave their loop


@dataclass
class RoleSet:
    tokenizer: Any
    device: torch.device
    dataset: PromptDataset
    prompt_ids: list[list[int]]
    pad_id: int
    actor: Actor | None = None
    ref_model: torch.nn.Module | None = None
    critic: Critic | None = None
    engine: RolloutEngine | None = None
    rule_reward: RuleReward | None = None
    scorer: ModelReward | RuleReward | None = None  # what scores batches on this rank (reward group)
    flight_server: Any = None
    flight_client: Any = None
    num_generators: int = 0

    def update(self, inputs: dict[str, torch.Tensor], shard: RolloutBatch, plan: UpdatePlan, timer,
               ctx: DistContext) -> dict[str, float]:
        """Ref/old logprobs, values, PPO advantages, critic and actor updates on this shard."""
        algo = self.actor.algo  # type: ignore[union-attr]
        temp = algo.sampling.temperature
        if self.ref_model is not None:
            with timer("ref"):
                inputs["ref_logprobs"] = batched_logprobs(self.ref_model, inputs, temp, plan.micro_batch_size)
        if self.actor.old_logprobs_needed(plan, len(shard)):  # type: ignore[union-attr]
            with timer("old_log_prob"):
                inputs["old_logprobs"] = self.actor.compute_logprobs(inputs, plan.micro_batch_size)  # type: ignore[union-attr]
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with timer("values"):
                inputs["values"] = self.critic.compute_values(inputs, plan.micro_batch_size)
            with timer("adv"):
                self._ppo_advantages(shard, inputs, ctx)
            with timer("update_critic"):
                metrics.update(prefixed("critic", self.critic.update(inputs, plan)))
        with timer("update_actor"):
            metrics.update(prefixed("actor", self.actor.update(inputs, plan)))  # type: ignore[union-attr]
        return _mean_over_group(metrics, ctx.process_group, float(inputs["response_mask"].sum()))

    def _ppo_advantages(self, shard: RolloutBatch, inputs: dict[str, torch.Tensor], ctx: DistContext) -> None:
        algo, mask = self.actor.algo, inputs["response_mask"]  # type: ignore[union-attr]
        rewards = token_level_rewards(shard.scores().to(mask.device), mask)
        adv, returns = gae_advantages(rewards, inputs["values"], mask, algo.gamma, algo.lam, whiten=False)
        stats = torch.stack([(adv * mask).sum(), (adv * adv * mask).sum(), mask.sum()]).double().cpu()
        dist.all_reduce(stats, group=ctx.process_group)  # whiten over the whole batch, not the shard
        mean = stats[0] / stats[2]
        var = stats[1] / stats[2] - mean * mean
        inputs["advantages"] = ((adv - mean.float()) * torch.rsqrt(var.float() + 1e-8)) * mask
        inputs["returns"], inputs["token_rewards"] = returns, rewards

    def score_batch(self, batch: RolloutBatch | None, ctx: DistContext, is_leader: bool) -> RolloutBatch | None:
        """Scores from the reward group (each rank a slice), or from the model on rank 0."""
        group = ctx.sync_groups.get("reward")
        if group is None:  # no reward group: a reward model, if any, sits on trainer rank 0
            if is_leader and self.scorer is not None:
                return batch.with_columns(score=self.scorer.score(batch))  # type: ignore[union-attr]
            return batch
        leader = ctx.plan.group_ranks("trainer")[0]
        payload: list[Any] = [batch.to_ipc() if is_leader and batch is not None else None]
        dist.broadcast_object_list(payload, src=leader, group=group)
        if payload[0] == STOP_PAYLOAD:
            return STOP_PAYLOAD  # type: ignore[return-value]
        scores: list[float] | None = None
        if self.scorer is not None:
            from verl_hpc.runtime.dist_trainer import shard_range

            full = RolloutBatch.from_ipc(payload[0])
            start, end = shard_range(len(full), ctx.group.size, ctx.rank_in_group)
            scores = self.scorer.score(full.take(list(range(start, end)))).tolist()
        gathered: list[Any] = [None] * dist.get_world_size(group) if is_leader else []
        dist.gather_object(scores, gathered if is_leader else None, dst=leader, group=group)
        if not is_leader:
            return batch
        merged = [x for part in gathered if part is not None for x in part]
        return batch.with_columns(score=torch.tensor(merged, dtype=torch.float32))  # type: ignore[union-attr]

    def export_model(self, model_dir: str, dtype: torch.dtype, is_leader: bool) -> torch.nn.Module | None:
        """An unsharded copy of the actor on the leader, gathered one parameter at a time.

        Every trainer rank must call it (the gathers are collectives); others get None.
        """
        if isinstance(self.engine, HFRolloutEngine):  # colocated: every engine already holds the synced weights
            return self.engine.model if is_leader else None
        target = _load_causal_lm(model_dir, dtype) if is_leader else None
        if target is not None:
            stream_into(self.actor.model, target)  # type: ignore[union-attr]
        else:
            from verl_hpc.roles.weight_sync import gather_only

            gather_only(self.actor.model)  # type: ignore[union-attr]
        return target

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.flight_client is not None:
            self.flight_client.close()
        if self.flight_server is not None:
            self.flight_server.shutdown()


def _mean_over_group(metrics: dict[str, float], group: dist.ProcessGroup, weight: float) -> dict[str, float]:
    """Token-weighted mean of per-rank metrics: the number one process would have logged."""
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] * weight for k in keys] + [weight], dtype=torch.float64)
    dist.all_reduce(values, group=group)
    total = float(values[-1]) or 1.0
    return {k: float(v) / total for k, v in zip(keys, values[:-1], strict=True)}


def _load_causal_lm(path: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def build_roles(cfg: RunConfig, ctx: DistContext, run_dir: Path) -> RoleSet:
    from transformers import AutoTokenizer

    model_dir = str(expand_path(cfg.model.path))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    device = _device_for(ctx)
    dataset = PromptDataset(prompt_files(cfg, run_dir), cfg.data.prompt_key, cfg.data.answer_key)
    roles = RoleSet(tokenizer=tokenizer, device=device, dataset=dataset, pad_id=tokenizer.pad_token_id,
                    prompt_ids=tokenize_prompts(tokenizer, dataset.prompts, cfg.data.max_prompt_length))
    if ctx.is_role("actor"):
        _build_trainer(cfg, ctx, roles, model_dir, run_dir)
    if ctx.is_role("rollout") and roles.engine is None:  # split: the rollout group's own engine
        roles.engine = _build_engine(cfg, ctx, roles, model_dir, run_dir, colocated=False)
    has_reward_group = any(g.name == "reward" for g in ctx.plan.groups)
    if has_reward_group and ctx.group.name == "reward" or cfg.reward.model_path is not None and ctx.is_role("reward") and ctx.rank_in_group == 0:
        roles.scorer = _build_scorer(cfg, tokenizer, device)
    elif cfg.reward.function is not None and ctx.is_role("rollout") and not has_reward_group:
        roles.rule_reward = RuleReward(resolve_function(cfg.reward.function, "reward.function"), tokenizer)
    _connect_rollouts(cfg, ctx, roles, run_dir)
    return roles


def _build_scorer(cfg: RunConfig, tokenizer, device: torch.device) -> ModelReward | RuleReward:
    if cfg.reward.model_path is not None:
        return ModelReward(str(expand_path(cfg.reward.model_path)), device)
    return RuleReward(resolve_function(cfg.reward.function or "", "reward.function"), tokenizer)


def _device_for(ctx: DistContext) -> torch.device:
    from verl_hpc.utils.resource import pin_to_device

    res = ctx.group.resources
    return pin_to_device(res.device_type, None, 0) if res.device_type == "cuda" else torch.device("cpu")


def _build_trainer(cfg: RunConfig, ctx: DistContext, roles: RoleSet, model_dir: str, run_dir: Path) -> None:
    algo, trainer, dtype = cfg.algorithm, cfg.trainer, DTYPES[cfg.model.dtype]
    sharded = ctx.group.size > 1 and ctx.group.resources.strategy == "fsdp"
    model = _load_causal_lm(model_dir, dtype).to(roles.device)
    if "ref" in ctx.group.roles:
        roles.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    compute = {"none": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.mixed_precision]
    if sharded:
        shard_model(model, ctx.process_group, roles.device.type, compute)
        if roles.ref_model is not None:
            shard_model(roles.ref_model, ctx.process_group, roles.device.type, compute)
    group = ctx.process_group if sharded else None
    roles.actor = Actor(model, algo, trainer.actor_optim, trainer.total_steps, dp_group=group)
    if "critic" in ctx.group.roles:
        critic_dir = str(expand_path(cfg.model.critic_path)) if cfg.model.critic_path else model_dir
        value_model = ValueModel.from_pretrained(critic_dir, dtype).to(roles.device)
        if sharded:
            shard_model(value_model, ctx.process_group, roles.device.type, compute)
        roles.critic = Critic(value_model, algo, trainer.critic_optim, trainer.total_steps, dp_group=group)
    if sharded and ctx.group.size > 1 and "rollout" not in ctx.group.roles:
        return
    if "rollout" in ctx.group.roles:  # colocated engine: its own unsharded copy, refreshed per step
        roles.engine = _build_engine(cfg, ctx, roles, model_dir, run_dir, colocated=True)


def _build_engine(cfg: RunConfig, ctx: DistContext, roles: RoleSet, model_dir: str, run_dir: Path,
                  colocated: bool) -> RolloutEngine:
    resources = cfg.resources.rollout
    hf_model = None if resources.strategy == "vllm" else \
        _load_causal_lm(model_dir, DTYPES[cfg.model.dtype]).to(roles.device)
    return build_engine(resources, model_dir, roles.tokenizer, roles.device, colocated=colocated,
                        timeout=cfg.resources.timeout_seconds, hf_model=hf_model,
                        log_file=run_dir / "logs" / f"vllm_engine_rank{ctx.env.rank}.log")


def _connect_rollouts(cfg: RunConfig, ctx: DistContext, roles: RoleSet, run_dir: Path) -> None:
    """Split placement: trainer rank 0 serves Flight; rollout ranks learn its address and connect."""
    if "rollout" in ctx.plan.groups[0].roles:
        return
    from verl_hpc.data.transport import RolloutFlightClient, RolloutFlightServer, read_run_secret

    token = read_run_secret(run_dir)
    leader = ctx.plan.group_ranks("trainer")[0]
    location: list[Any] = [None]
    if ctx.env.rank == leader:
        host = ctx.env.master_addr
        roles.flight_server = RolloutFlightServer(f"grpc://{host}:0", token=token, capacity=8)
        roles.num_generators = ctx.plan.group_of_role("rollout").size
        location = [f"grpc://{host}:{roles.flight_server.port}"]
    dist.broadcast_object_list(location, src=leader, group=ctx.control_group)
    if ctx.is_role("rollout"):
        roles.flight_client = RolloutFlightClient(location[0], token=token, producer_id=f"rollout{ctx.rank_in_group}")

