"""`Dataflow` (`add_stage` / `connect`): a declared stage graph as a facade over `ResourceConfig`.

Why a facade and not a graph executor: verl-hpc's stages are fixed by the algorithm
(generate -> reward -> ref/old/values -> advantages -> update -> sync) and executed by
the `ProcessPlan` that `config/placement.py` derives from `resources`. A declared graph
therefore tells the runtime only two things it can use: how many workers of which kind
each role gets, and whether the rollout shares the actor's devices. This module turns
exactly that into a validated `ResourceConfig`, and rejects what the fixed pipeline
cannot execute (unknown stages, edges against the pipeline order) instead of silently
ignoring it.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field
from typing import Any

from verl_hpc.config.loader import load_config, validate_section
from verl_hpc.config.resources import ROLE_NAMES, VALID_STRATEGIES, ResourceConfig, RoleResources
from verl_hpc.config.schema import RunConfig

# Device ids are handed out in this order, so the trainer's devices come first (GPU 0, 1, ...)
# as in the shipped configs; a colocated stage takes no ids of its own.
DEVICE_ORDER = ("actor", "critic", "ref", "rollout", "reward")

PIPELINE = ("generate (rollout) -> reward -> ref/old/values (ref, actor, critic) -> advantages "
            "-> update (actor, critic) -> sync (actor -> rollout)")

# Every edge the fixed pipeline executes, and what travels along it.
EDGES: dict[tuple[str, str], str] = {
    ("rollout", "reward"): "generated responses, to be scored",
    ("reward", "actor"): "the scored batch, for advantages and the update",
    ("rollout", "actor"): "the batch, scored by a rule reward beside the rollouts",
    ("actor", "rollout"): "weight sync after every update",
    ("ref", "actor"): "reference logprobs for the KL term",
    ("critic", "actor"): "values for the advantages",
    ("rollout", "ref"): "responses, for reference logprobs",
    ("rollout", "critic"): "responses, for values",
}

# RoleResources' Slurm request fields: the only extra keyword arguments `add_stage` takes.
SLURM_FIELDS = ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "mem", "partition",
                "account", "qos", "constraint")

# Stages that may share the actor's processes: the hybrid-engine rollout, and a critic or
# ref that should sit in the trainer group rather than on devices of its own.
COLOCATABLE = ("rollout", "critic", "ref")


@dataclass(frozen=True)
class Stage:
    """One declared stage, kept as given; `to_resources` resolves devices and defaults."""

    name: str
    num_workers: int | None
    num_gpus_per_worker: int
    strategy: str | None
    colocate_with: str | None
    slurm: dict[str, Any] = field(default_factory=dict)


class Dataflow:
    """A declared stage graph, validated against verl-hpc's fixed pipeline.

    Declare stages and edges, then `to_resources()` (the `resources:` section) or
    `apply(config)` (a whole validated `RunConfig`). Every mistake raises `ValueError`
    naming the stage or edge and the valid choices.
    """

    def __init__(self) -> None:
        self._stages: dict[str, Stage] = {}
        self._edges: list[tuple[str, str]] = []

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(self._stages.values())

    @property
    def edges(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._edges)

    @property
    def placement(self) -> str:
        """colocated iff the rollout shares the actor's devices (the hybrid engine)."""
        rollout = self._stages.get("rollout")
        return "colocated" if rollout is not None and rollout.colocate_with == "actor" else "split"

    def __repr__(self) -> str:
        edges = ", ".join(f"{a}->{b}" for a, b in self._edges)
        return f"Dataflow(stages=[{', '.join(self._stages)}], edges=[{edges}])"

    def add_stage(self, name: str, num_workers: int | None = None, num_gpus_per_worker: int = 0,
                  strategy: str | None = None, colocate_with: str | None = None, **slurm: Any) -> Dataflow:
        """Declare one role's workers; returns self so declarations chain.

        `num_workers` defaults to 1, or for a colocated stage to the actor's count (one
        engine per actor process). `num_gpus_per_worker` is 0 (a CPU worker) or 1; more
        only for a vLLM rollout, where it becomes `vllm_args.tensor_parallel_size`.
        Extra keywords are the role's Slurm request (nodes, partition, account, ...).
        """
        _check_name(name)
        if name in self._stages:
            raise ValueError(f"stage {name!r} is already declared; each role is one stage, "
                             "so give all its workers in one add_stage call (num_workers)")
        _check_counts(name, num_workers, num_gpus_per_worker, strategy, colocate_with)
        _check_strategy(name, strategy)
        _check_colocation(name, colocate_with)
        _check_slurm(name, slurm)
        self._stages[name] = Stage(name, num_workers, num_gpus_per_worker, strategy, colocate_with, dict(slurm))
        return self

    def connect(self, src: str, dst: str) -> Dataflow:
        """Record an edge; only edges the fixed pipeline executes are accepted."""
        for end in (src, dst):
            _check_name(end)
            if end not in self._stages:
                raise ValueError(f"connect({src!r}, {dst!r}): stage {end!r} is not declared; "
                                 f"call add_stage({end!r}, ...) first")
        if (src, dst) not in EDGES:
            flipped = f"; did you mean connect({dst!r}, {src!r})?" if (dst, src) in EDGES else ""
            valid = ", ".join(f"{a}->{b}" for a, b in EDGES)
            raise ValueError(f"connect({src!r}, {dst!r}): the runtime executes a fixed pipeline, {PIPELINE}, "
                             f"which has no {src} -> {dst} step{flipped} (valid edges: {valid})")
        if (src, dst) not in self._edges:
            self._edges.append((src, dst))
        return self

    def to_resources(self, device_type: str | None = None) -> ResourceConfig:
        """The `resources:` section this graph implies, validated by `ResourceConfig`.

        GPU stages get consecutive GPU ids and CPU stages consecutive CPU slot ids, each
        counted from 0 in the order actor, critic, ref, rollout, reward; a colocated stage
        reuses the actor's ids. `device_type="cpu"` puts every stage on CPU (one slot per
        GPU it declared) so a GPU flow runs unchanged on a laptop with the same processes.
        """
        if device_type not in (None, "cpu"):
            raise ValueError(f"device_type must be None (as declared) or 'cpu' (force CPU), got {device_type!r}")
        missing = [name for name in ("actor", "rollout") if name not in self._stages]
        if missing:
            raise ValueError(f"the pipeline always runs an actor and a rollout stage; missing: "
                             f"{', '.join(missing)} (add_stage({missing[0]!r}, ...))")
        layout = self._layout(device_type)
        data: dict[str, Any] = {"placement": self.placement}
        for name, (kind, ids) in layout.items():
            data[name] = self._role_data(self._stages[name], kind, ids)
        return validate_section(ResourceConfig, data, prefix="resources.")

    def apply(self, config: RunConfig | dict[str, Any], device_type: str | None = None) -> RunConfig:
        """`config` with its `resources` replaced by this graph's, validated as a whole.

        The graph does not declare the communication settings, so `comm_backend` and
        `timeout_seconds` stay as the config had them. The `reward` section is kept as is:
        it says *what* scores (a rule `reward.function` or `reward.model_path`), the graph
        says *where*. With a reward stage the plan gives it a group of its own that runs
        either of them (data-parallel over its workers); without one, a rule runs beside
        the rollouts.
        """
        if isinstance(config, RunConfig):
            data = config.model_dump(mode="json", by_alias=True)
        else:
            data = copy.deepcopy(dict(config))
        resources = self.to_resources(device_type).model_dump(mode="json", by_alias=True)
        old = data.get("resources")
        if isinstance(old, dict):
            for key in ("comm_backend", "timeout_seconds"):
                if key in old:
                    resources[key] = old[key]
        data["resources"] = resources
        return load_config(data=data)

    def describe(self, device_type: str | None = None) -> str:
        """A readable summary: stages with their devices, placement, edges, the pipeline."""
        try:
            layout: dict[str, tuple[str, list[int]]] | None = self._layout(device_type)
            problem = ""
        except ValueError as err:
            layout, problem = None, str(err)
        lines = [f"Dataflow: {len(self._stages)} stage(s), placement {self.placement}"]
        for name in DEVICE_ORDER:
            stage = self._stages.get(name)
            if stage is not None:
                lines.append(self._stage_line(stage, layout))
        if problem:
            lines.append(f"  devices not assigned: {problem}")
        missing = [name for name in ("actor", "rollout") if name not in self._stages]
        if missing:
            lines.append(f"  missing (required by the pipeline): {', '.join(missing)}")
        lines.append("edges:" if self._edges else "edges: none declared")
        width = max((len(a) + len(b) for a, b in self._edges), default=0) + 4
        lines.extend(f"  {f'{a} -> {b}':<{width}}  {EDGES[(a, b)]}" for a, b in self._edges)
        lines.append(f"pipeline (fixed, run by the runtime): {PIPELINE}")
        return "\n".join(lines)

    def _workers(self, stage: Stage) -> int:
        """Processes of a stage: as declared, else the actor's count when colocated, else 1."""
        if stage.num_workers is not None:
            return stage.num_workers
        actor = self._stages.get("actor")
        if stage.colocate_with == "actor" and actor is not None:
            return self._workers(actor)
        return 1

    def _layout(self, device_type: str | None) -> dict[str, tuple[str, list[int]]]:
        """Device type and ids of every stage, in DEVICE_ORDER (see `to_resources`)."""
        next_id = {"cuda": 0, "cpu": 0}
        layout: dict[str, tuple[str, list[int]]] = {}
        for name in DEVICE_ORDER:
            stage = self._stages.get(name)
            if stage is None or stage.colocate_with is not None:
                continue
            kind = "cuda" if stage.num_gpus_per_worker > 0 and device_type is None else "cpu"
            count = self._workers(stage) * max(1, stage.num_gpus_per_worker)
            layout[name] = (kind, list(range(next_id[kind], next_id[kind] + count)))
            next_id[kind] += count
        for name in DEVICE_ORDER:
            stage = self._stages.get(name)
            if stage is not None and stage.colocate_with is not None:
                layout[name] = self._colocated(stage, layout, device_type)
        return {name: layout[name] for name in DEVICE_ORDER if name in layout}

    def _colocated(self, stage: Stage, layout: dict[str, tuple[str, list[int]]],
                   device_type: str | None) -> tuple[str, list[int]]:
        """The actor's devices, after checking the stage agrees with them."""
        if "actor" not in layout:
            raise ValueError(f"stage {stage.name!r} is colocated with the actor, but no actor stage is "
                             "declared; add_stage('actor', ...) first")
        kind, ids = layout["actor"]
        actor_workers = len(ids)
        if stage.num_workers is not None and stage.num_workers != actor_workers:
            raise ValueError(f"stage {stage.name!r}: num_workers={stage.num_workers}, but a colocated stage "
                             f"runs one worker in each of the actor's {actor_workers} process(es); use "
                             f"num_workers={actor_workers} or leave it out")
        if device_type is None and stage.num_gpus_per_worker == 1 and kind != "cuda":
            raise ValueError(f"stage {stage.name!r}: num_gpus_per_worker=1, but it is colocated with an "
                             "actor on CPU; give the actor num_gpus_per_worker=1 or this stage 0")
        return kind, list(ids)

    def _role_data(self, stage: Stage, kind: str, ids: list[int]) -> dict[str, Any]:
        """The stage as a `RoleResources` mapping (strategy defaults resolved here)."""
        role: dict[str, Any] = {"device_type": kind, "device_ids": ids,
                                "strategy": _strategy(stage, self._workers(stage)), **stage.slurm}
        if stage.num_gpus_per_worker > 1:
            role["vllm_args"] = {"tensor_parallel_size": stage.num_gpus_per_worker}
        return role

    def _stage_line(self, stage: Stage, layout: dict[str, tuple[str, list[int]]] | None) -> str:
        workers = self._workers(stage)
        gpus = stage.num_gpus_per_worker
        per_worker = "CPU" if gpus == 0 else f"{gpus} GPU" + ("s (tensor parallel)" if gpus > 1 else "")
        text = f"  {stage.name:<8} {workers} worker(s) x {per_worker}"
        if layout is not None and stage.name in layout:
            kind, ids = layout[stage.name]
            forced = " (forced)" if kind == "cpu" and gpus > 0 else ""
            text += f", {kind}{forced} {ids}"
        text += f", strategy {_strategy(stage, workers)}"
        if stage.colocate_with is not None:
            text += f", colocated with the {stage.colocate_with}"
        if stage.slurm:
            text += ", slurm: " + " ".join(f"{k}={v}" for k, v in stage.slurm.items())
        return text


def _strategy(stage: Stage, workers: int) -> str:
    """The declared strategy, else the default: shard (fsdp) or replicate when > 1 worker."""
    if stage.strategy is not None:
        return stage.strategy
    if stage.name in ("actor", "critic"):
        return "fsdp" if workers > 1 else "hf"
    if stage.name == "reward":
        return "data_parallel" if workers > 1 else "none"
    return "hf"


def _check_name(name: str) -> None:
    if name not in ROLE_NAMES:
        close = difflib.get_close_matches(str(name), ROLE_NAMES, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown stage {name!r}: stages are the RL loop's roles, "
                         f"{', '.join(ROLE_NAMES)}{hint}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_counts(name: str, num_workers: int | None, gpus: int, strategy: str | None,
                  colocate_with: str | None) -> None:
    """Workers >= 1; 0 or 1 GPU per worker, except a vLLM rollout's tensor-parallel engine."""
    if num_workers is not None and (not _is_int(num_workers) or num_workers < 1):
        raise ValueError(f"stage {name!r}: num_workers must be an integer >= 1, got {num_workers!r}")
    if not _is_int(gpus) or gpus < 0:
        raise ValueError(f"stage {name!r}: num_gpus_per_worker must be 0 (a CPU worker) or 1, got {gpus!r}")
    if gpus <= 1:
        return
    if name != "rollout" or strategy != "vllm":
        raise ValueError(f"stage {name!r}: num_gpus_per_worker={gpus}, but each {name} worker is one process "
                         "on one device (multi-GPU roles shard over workers); use num_gpus_per_worker=1 and "
                         f"num_workers={gpus * (num_workers or 1)}. Only a rollout with strategy='vllm' spans "
                         "several GPUs per worker (tensor parallel)")
    if colocate_with is not None:
        raise ValueError(f"stage {name!r}: a colocated rollout runs inside the actor's one-GPU processes, so "
                         f"num_gpus_per_worker={gpus} (tensor parallel) is not possible; use split placement")


def _check_strategy(name: str, strategy: str | None) -> None:
    if strategy is not None and strategy not in VALID_STRATEGIES[name]:
        raise ValueError(f"stage {name!r}: strategy {strategy!r} is not valid for the {name} role; use one "
                         f"of {', '.join(VALID_STRATEGIES[name])} (or leave it out for the default)")


def _check_colocation(name: str, colocate_with: str | None) -> None:
    if colocate_with is None:
        return
    if colocate_with != "actor" or name not in COLOCATABLE:
        raise ValueError(f"stage {name!r}: colocate_with={colocate_with!r} is not supported; only "
                         f"{', '.join(COLOCATABLE)} may be colocated, and only with 'actor'")


def _check_slurm(name: str, slurm: dict[str, Any]) -> None:
    """Extra keywords must be Slurm fields of `RoleResources`, with valid values."""
    for key in slurm:
        if key not in SLURM_FIELDS:
            close = difflib.get_close_matches(key, SLURM_FIELDS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"stage {name!r}: unknown keyword {key!r}; {hint}extra keywords are the role's "
                             f"Slurm request: {', '.join(SLURM_FIELDS)} (devices are assigned by to_resources)")
    validate_section(RoleResources, dict(slurm), prefix=f"resources.{name}.")
