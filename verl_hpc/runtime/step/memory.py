"""The memory plan of one process, before its first step and at every step boundary after.

Why here, between the roles and the loop: the plan (roles/memory/) is a pure function of
shapes, switches and a budget; this module reads those from the run config and the
process's place in it (which roles it hosts, over how many ranks, on which device), turns
the plan into the config the process runs with, and after each step sets the plan's
estimate for the step's real shape beside the measured peak (`memory/plan_estimate_gb`,
`memory/step_peak_gb`). A step that needed more than the estimate plus its headroom, or a
budget that shrank (another job on the node), re-plans with what was learned, and the new
switches take effect at once, on the live roles: the next step runs under them instead of
running out of memory. Switches only ever go on during a run, never off again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from verl_hpc.config import RunConfig
from verl_hpc.config.explicit import MEMORY_SWITCHES
from verl_hpc.roles.memory.budget import Budget, device_budget, runtime_floor
from verl_hpc.roles.memory.estimate import RUNTIME_GROWTH_CPU
from verl_hpc.roles.memory.plan import GIB, MemoryPlan, plan_memory
from verl_hpc.roles.memory.shapes import ModelShape, Switches, Workload
from verl_hpc.utils.fs import expand_path
from verl_hpc.utils.host_allocator import allocator_line, own_allocator
from verl_hpc.utils.logging import get_logger

log = get_logger("memory")
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemorySeat:
    """Where this process sits: the roles it hosts, its device, its group's size and sharding."""

    hosted: tuple[str, ...]
    device: torch.device
    group_size: int = 1          # processes in its group (trainer ranks, or a serving group's)
    sharded: bool = False        # FSDP2 over the group
    processes: int = 1           # processes sharing this memory (a node's ranks on a CPU)
    name: str = "trainer"


def model_shape(cfg: RunConfig, actor_model: Any = None) -> ModelShape | None:
    """The policy's shape from its `config.json` (or a model object's config, or the `init_preset` a
    model not built yet will have); None if none of them can be read."""
    config = getattr(actor_model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        return ModelShape.from_hf_config(config.to_dict())
    path = expand_path(cfg.model.path) / "config.json"
    try:
        return ModelShape.from_hf_config(json.loads(path.read_text()))
    except (OSError, KeyError, ValueError, TypeError):
        pass
    from verl_hpc.models.tiny import PRESETS

    preset = PRESETS.get(cfg.model.init_preset or "")
    if preset is None:
        return None
    heads = preset.num_heads
    return ModelShape(hidden=preset.hidden_size, layers=preset.num_layers, heads=heads, kv_heads=preset.num_kv_heads,
                      head_dim=preset.hidden_size // heads, intermediate=preset.intermediate_size,
                      vocab=preset.vocab_size, tied=preset.tie_word_embeddings, qkv_bias=preset.family == "qwen2")


def config_switches(cfg: RunConfig, mini_rows: int) -> Switches:
    """The switches as the config writes them, for a rank whose mini-batch has `mini_rows` rows."""
    model, algo = cfg.model, cfg.algorithm
    return Switches(logprob_chunk_tokens=model.logprob_chunk_tokens, remove_padding=model.remove_padding,
                    token_budget=algo.token_budget, gradient_checkpointing=model.gradient_checkpointing,
                    ref_offload=model.param_offload.ref,
                    micro_batch_rows=max(1, min(algo.micro_batch_size or mini_rows, mini_rows)))


def _judge_bytes(cfg: RunConfig) -> int:
    judge = cfg.reward.judge if cfg.reward is not None else None
    if judge is None:
        return 0
    try:
        shape = ModelShape.from_hf_config(json.loads((expand_path(judge.model_path) / "config.json").read_text()))
    except (OSError, KeyError, ValueError, TypeError):
        return 0
    return shape.params * 4


def workload(cfg: RunConfig, seat: MemorySeat, shape: ModelShape, floor: int) -> Workload:
    """What `seat` computes in a step of `cfg` (the rows, passes and engine its memory follows)."""
    algo, batch = cfg.algorithm, cfg.trainer.batch_size
    trains = "actor" in seat.hosted
    rows = batch // max(1, seat.group_size)
    dpo = algo.step_kind == "dpo"
    engine = None
    if "rollout" in seat.hosted and not dpo:
        engine = "vllm" if cfg.resources.rollout.strategy == "vllm" else \
            "hf_shared" if trains and not seat.sharded else "hf"
    mini = (algo.mini_batch_size or batch) // max(1, seat.group_size)
    lora = cfg.model.lora
    trainable = None if lora is None else shape.lora_params(lora.rank, lora.target_modules)
    compute = BYTES[cfg.model.dtype]
    if seat.device.type == "cuda" and cfg.model.mixed_precision != "none":
        compute = 2
    extra = {"judge": _judge_bytes(cfg)} if "reward" in seat.hosted else {}
    return Workload(rows=rows * (2 if dpo else 1), prompt_tokens=cfg.data.max_prompt_length,
                    response_tokens=algo.sampling.max_new_tokens, trains=trains,
                    ref="ref" in seat.hosted and algo.needs_ref, critic="critic" in seat.hosted and algo.needs_critic,
                    engine=engine, generate_rows=rows if engine else 0,
                    old_pass=trains and (algo.kl.in_reward or algo.ppo_epochs > 1 or mini < rows),
                    shards=seat.group_size if seat.sharded else 1, param_bytes=BYTES[cfg.model.dtype],
                    compute_bytes=compute, trainable=trainable, device=seat.device.type, floor_bytes=floor,
                    extra_bytes={k: v for k, v in extra.items() if v})


def set_field(cfg: RunConfig, path: str, value: Any) -> None:
    """`cfg.<path> = value` on a nested config (validated: the config's own types hold)."""
    *parents, leaf = path.split(".")
    node: Any = cfg
    for part in parents:
        node = getattr(node, part)
    setattr(node, leaf, value)


def apply_switches(cfg: RunConfig, switches: Switches) -> None:
    """Write `switches` into `cfg` in place (the process's own copy: config.yaml keeps the user's)."""
    set_field(cfg, "model.logprob_chunk_tokens", switches.logprob_chunk_tokens)
    set_field(cfg, "model.remove_padding", switches.remove_padding)
    set_field(cfg, "model.gradient_checkpointing", switches.gradient_checkpointing)
    set_field(cfg, "model.param_offload.ref", switches.ref_offload)
    set_field(cfg, "algorithm.use_dynamic_bsz", switches.token_budget is not None)
    if switches.token_budget is not None:
        set_field(cfg, "algorithm.max_token_len_per_gpu", switches.token_budget)
    if cfg.algorithm.micro_batch_size is not None or switches.micro_batch_rows < _mini_rows(cfg, 1):
        set_field(cfg, "algorithm.micro_batch_size", switches.micro_batch_rows)


def _mini_rows(cfg: RunConfig, world: int) -> int:
    return (cfg.algorithm.mini_batch_size or cfg.trainer.batch_size) // max(1, world)


def plan_process(cfg: RunConfig, seat: MemorySeat, explicit: frozenset[str], actor_model: Any = None,
                 agree: Callable[[int], int] | None = None,
                 budget: Budget | None = None) -> tuple[RunConfig, MemoryWatch | None]:
    """The config this process runs with under `model.memory_plan`, and the watch that keeps its plan
    (None when the model's shape cannot be read). With the plan off the config is returned as it is,
    and the watch only logs the estimate.

    `agree`: the smallest of a number over the process's group (every rank must cut its
    micro-batches alike under FSDP, so every rank plans for the group's smallest budget).
    `budget`: instead of measuring this process's device (`verl-hpc plan` for another machine).
    """
    off = cfg.model.memory_plan == "off"  # the estimate is still logged beside the measured peak
    shape = model_shape(cfg, actor_model)
    if shape is None:
        log.warning("memory plan: cannot read %s/config.json; the switches stay as configured", cfg.model.path)
        return cfg, None
    if budget is None:
        budget = seat_budget(seat, cfg.model.memory_budget_gb)
    if agree is not None:
        budget = Budget(agree(budget.bytes), budget.source)
    work = workload(cfg, seat, shape, runtime_floor() + RUNTIME_GROWTH_CPU if seat.device.type == "cpu" else 0)
    mini = _mini_rows(cfg, seat.group_size)
    locked = explicit | ({"algorithm.use_dynamic_bsz", "algorithm.micro_batch_size"}
                         if cfg.algorithm.step_kind == "dpo" else frozenset())
    locked = locked | frozenset(MEMORY_SWITCHES) if off else locked
    budget_tokens = cfg.algorithm.max_token_len_per_gpu if "algorithm.max_token_len_per_gpu" in explicit else None
    plan = plan_memory(shape, work, config_switches(cfg, mini), locked, budget, cfg.model.memory_headroom,
                       mini_rows=mini, budget_tokens=budget_tokens, generate_chunks=cfg.trainer.oom_retry and not off,
                       economy=False if off else None, process=f"{seat.name} on {seat.device}")
    if off:
        plan.decisions, plan.process = [], f"{plan.process} (model.memory_plan: off, the switches as configured)"
    for line in plan.lines():
        log.info("%s", line)
    log.info("%s", allocator_line(own_allocator(), seat.device.type, cfg.resources.host_allocator))
    watch = MemoryWatch(plan, shape, work, locked, mini, cfg.model.memory_budget_gb, seat.device, seat.processes,
                        replan=not off)
    if off:
        return cfg, watch
    planned = cfg.model_copy(deep=True)
    apply_switches(planned, plan.switches)
    return planned, watch


def seat_budget(seat: MemorySeat, override_gb: float | None) -> Budget:
    """The process's budget: `model.memory_budget_gb`, else its device's, shared with the node's
    other processes on a CPU."""
    budget = device_budget(seat.device.type, seat.device.index or 0, override_gb)
    return budget if override_gb is not None else budget.share(seat.processes)


def plan_run(cfg: RunConfig, explicit: frozenset[str]) -> list[MemoryPlan]:
    """Every process group's plan, as `cfg` would run on this machine (`verl-hpc plan`): one per group.

    A group on CUDA with no GPU here and no `model.memory_budget_gb` is estimated against an
    unbounded budget (the header says so): its estimate is still what it would hold.
    """
    from verl_hpc.config.placement import plan_for_config

    process_plan = plan_for_config(cfg)
    plans = []
    for group in process_plan.groups:
        res = group.resources
        cuda_here = res.device_type == "cuda" and torch.cuda.is_available()
        device = torch.device("cuda", 0) if cuda_here else torch.device("cpu")
        seat = MemorySeat(group.roles, device if res.device_type == "cpu" or cuda_here else torch.device("cuda"),
                          group_size=group.size, sharded=group.size > 1 and res.strategy == "fsdp",
                          processes=process_plan.world_size if res.device_type == "cpu" else 1,
                          name=f"{group.name} ({group.size} process{'es' if group.size > 1 else ''})")
        budget = None
        if res.device_type == "cuda" and not cuda_here and cfg.model.memory_budget_gb is None:
            budget = Budget(1 << 50, "no CUDA device here: set model.memory_budget_gb")
        _, watch = plan_process(cfg, seat, explicit, budget=budget)
        if watch is not None:
            plans.append(watch.plan)
    return plans


@dataclass
class Observed:
    """The shape of the step that just ran: its longest prompt and response, its mean row."""

    prompt_tokens: int
    response_tokens: int
    mean_tokens: float


def has_optimizer_state(actor: Any) -> bool:
    """Whether the actor's optimizer holds state (AdamW's moments); True where there is no optimizer to ask."""
    optimizer = getattr(actor, "optimizer", None)
    return True if optimizer is None else bool(optimizer.state)


def observed_shape(inputs: dict[str, torch.Tensor]) -> Observed:
    attention, response = inputs["attention_mask"], inputs["response_mask"]
    width = response.shape[1]
    prompts = attention[:, :-width].sum(dim=1) if width else attention.sum(dim=1)
    responses = response.sum(dim=1)
    return Observed(int(prompts.max()), int(responses.max()), float((prompts + responses).float().mean()))


class MemoryWatch:
    """At each step boundary: the estimate for the step's real shape beside its measured peak; a re-plan
    when the step needed more than estimate + headroom, or the budget no longer holds the plan."""

    def __init__(self, plan: MemoryPlan, shape: ModelShape, work: Workload, explicit: frozenset[str],
                 mini_rows: int, override_gb: float | None, device: torch.device, processes: int = 1,
                 replan: bool = True):
        self.plan, self.shape, self.work, self.explicit, self.replan = plan, shape, work, explicit, replan
        self.mini_rows, self.override_gb, self.device, self.processes = mini_rows, override_gb, device, processes
        self.correction = 1.0  # measured / estimated, once a step needed more than planned
        self.replans = 0
        # Whether AdamW's moments existed when this step started (set by the stages as each step begins):
        # a fresh run's first step holds neither them nor gradients until its update.
        self.optimizer_state = True

    def step_work(self, seen: Observed) -> Workload:
        """The planned workload with the step's real shape and optimizer state."""
        return replace(self.work, prompt_tokens=seen.prompt_tokens, response_tokens=max(1, seen.response_tokens),
                       mean_tokens=seen.mean_tokens, optimizer_state=self.optimizer_state)

    def estimate_for(self, seen: Observed) -> int:
        from verl_hpc.roles.memory.estimate import estimate

        return estimate(self.shape, self.step_work(seen), self.plan.switches).peak

    def estimate_metrics(self, seen: Observed) -> dict[str, float]:
        """`memory/plan_estimate_gb` for the step's real shape, and each phase's (resident + phase)."""
        from verl_hpc.roles.memory.estimate import estimate

        est = estimate(self.shape, self.step_work(seen), self.plan.switches)
        out = {"memory/plan_estimate_gb": est.peak / GIB, "memory/plan_budget_gb": self.plan.budget.bytes / GIB}
        out.update({f"memory/plan_gb/{name}": (est.resident_bytes + value) / GIB
                    for name, value in est.phases.items()})
        return out

    def check(self, seen: Observed, measured_peak: float, agree_max: Callable[[float], float]) -> Switches | None:
        """New switches when the plan must change (every trainer rank gets the same answer), else None."""
        if not self.replan:
            return None
        estimated = self.estimate_for(seen)
        ratio = agree_max(measured_peak / max(estimated, 1))
        budget = seat_budget(MemorySeat((), self.device, processes=self.processes), self.override_gb)
        budget = Budget(int(-agree_max(-float(budget.bytes))), budget.source)
        wrong = ratio > 1.0 + self.plan.headroom
        if wrong:
            self.correction = max(self.correction, ratio)
        target_now = budget.bytes * (1.0 - self.plan.headroom)
        if not wrong and self.plan.estimate.peak * self.correction <= target_now:
            return None
        scaled = Budget(int(budget.bytes / self.correction), f"{budget.source}, estimate x{self.correction:.2f}")
        plan = plan_memory(self.shape, self.work, self.plan.switches, self.explicit,
                           scaled, self.plan.headroom, mini_rows=self.mini_rows, process=self.plan.process)
        if plan.switches == self.plan.switches:
            return None
        why = f"step peak {measured_peak / GIB:.2f} GiB against {estimated / GIB:.2f} estimated" if wrong else \
            f"budget now {budget.bytes / GIB:.2f} GiB ({budget.source})"
        log.warning("memory plan: re-planned at the step boundary (%s)", why)
        for line in plan.lines():
            log.warning("%s", line)
        self.plan, self.replans = plan, self.replans + 1
        return plan.switches



def apply_live(cfg: RunConfig, roles: Any, update_plan: Any, switches: Switches) -> None:
    """New switches on a running process: its config copy, the actor and critic, the update plan.

    Activation checkpointing is transformers' per-layer switch, which may be set on a
    module that is already sharded; a reference offload can start later only unsharded.
    """
    from verl_hpc.roles.fsdp import checkpoint_activations
    from verl_hpc.roles.offload import ParamOffload

    before = config_switches(cfg, update_plan.mini_batch_size)
    apply_switches(cfg, switches)
    actor, critic = roles.actor, roles.critic
    if actor is not None:
        actor.chunk_tokens, actor.remove_padding = switches.logprob_chunk_tokens, switches.remove_padding
        if switches.gradient_checkpointing and not before.gradient_checkpointing:
            checkpoint_activations(actor.model)
    if critic is not None:
        critic.model.remove_padding = switches.remove_padding
        if switches.gradient_checkpointing and not before.gradient_checkpointing:
            checkpoint_activations(critic.model)
    if switches.ref_offload and not before.ref_offload and roles.ref_model is not None \
            and getattr(actor, "dp_group", None) is None:
        roles.ref_offload = ParamOffload(roles.ref_model, roles.device, True, name="ref")
    update_plan.micro_batch_size = min(switches.micro_batch_rows, update_plan.mini_batch_size)
    update_plan.token_budget = switches.token_budget
    if switches.generate_rows is not None:
        sizes = roles.allocator.sizes
        sizes["generate"] = min(sizes.get("generate", switches.generate_rows), switches.generate_rows)


def attach_watch(placement: Any, watch: MemoryWatch | None) -> None:
    """Give a trainer rank's stages the watch, and the roles the plan's generation chunks."""
    stages = placement.stages
    if watch is None or stages is None or not hasattr(stages, "memory_watch"):
        return
    stages.memory_watch = watch
    rows = watch.plan.switches.generate_rows
    if rows is not None:
        placement.roles.allocator.sizes["generate"] = rows


def live_switches(roles: Any, update_plan: Any) -> dict[str, float]:
    """The memory switches this step ran with, read from the roles themselves (`memory/switch/*`)."""
    from verl_hpc.roles.fsdp import activation_checkpointing_on

    actor = roles.actor
    out = {"memory/switch/micro_batch_size": float(update_plan.micro_batch_size),
           "memory/switch/token_budget": float(update_plan.token_budget or 0)}
    if actor is not None:
        out.update({"memory/switch/gradient_checkpointing": float(activation_checkpointing_on(actor.model)),
                    "memory/switch/remove_padding": float(actor.remove_padding),
                    "memory/switch/logprob_chunk_tokens": float(actor.chunk_tokens)})
    return out
