"""The memory plan: which switches a process turns on so its estimated peak fits its budget.

Why a ladder, cheapest first: every switch here keeps the run's numbers (to float
rounding) and costs something else. Chunked log-probs cost one head matmul per chunk;
padding removal and token-budget micro-batches cost nothing (they skip pad tokens);
activation checkpointing costs about one more forward per update; offloading the
reference costs a host-to-device copy per pass; smaller micro-batches and smaller log-prob
chunks cost parallel efficiency; generating in chunks of prompts costs the same samples an undisturbed run
would draw. The plan takes them in that order and stops as soon as the estimate fits
`budget x (1 - headroom)`. A switch the config sets is never touched: the plan only says
that it kept it.

Why one switch also goes on when nothing is short: on a host (a CPU device) memory is
shared with the operating system, the page cache and other jobs, and a run's footprint is
what decides whether the next allocation anywhere on the node succeeds. Activation
checkpointing there is also chosen when it at least halves what the step holds beyond the
runtime and saves at least 1 GiB: one more forward of the update for half the memory. A
GPU's memory is the job's own, and there only the fit counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl_hpc.roles.memory.budget import Budget
from verl_hpc.roles.memory.estimate import Estimate, estimate
from verl_hpc.roles.memory.shapes import ModelShape, Switches, Workload

GIB = float(1 << 30)
DEFAULT_CHUNK = 1024
MIN_CHUNK = 128  # smaller chunks of log-probs save little more and cost a head matmul each
ECONOMY_MIN_SAVING = 1 << 30  # bytes: below this, no recompute is worth it when memory is not short


@dataclass(frozen=True)
class Decision:
    """One switch: its config field, the value the process runs with, whether the plan set it, and why."""

    role: str
    field: str
    value: Any
    by_plan: bool
    why: str


@dataclass
class MemoryPlan:
    """The switches a process runs with, its estimate, its budget and a line per role saying why."""

    switches: Switches
    estimate: Estimate
    budget: Budget
    headroom: float
    decisions: list[Decision] = field(default_factory=list)
    process: str = "trainer"
    engine: str | None = None  # what generates here (roles/memory/shapes.py: Workload.engine)

    @property
    def target(self) -> int:
        return int(self.budget.bytes * (1.0 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.estimate.peak <= self.target

    def changed(self) -> dict[str, Any]:
        """Config field -> value for every switch the plan set."""
        return {d.field: d.value for d in self.decisions if d.by_plan}

    def lines(self) -> list[str]:
        """A header for the process, then one line per role: its switches and why."""
        est = self.estimate
        phases = ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.phases.items())
        verdict = "fits" if self.fits else "DOES NOT FIT (the per-step probe and OOM retries take over)"
        resident = ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.resident.items() if v)
        out = [f"memory plan, {self.process}: estimated peak {est.peak / GIB:.2f} GiB at {est.peak_phase} of "
               f"{self.target / GIB:.2f} GiB ({self.budget.bytes / GIB:.2f} GiB from {self.budget.source}, "
               f"{self.headroom:.0%} headroom): {verdict}; GiB resident: {resident}"
               + (f"; on top, per phase: {phases}" if phases else "")]
        if self.engine is not None:
            gen = est.phases.get("gen")
            held = f", {gen / GIB:.2f} GiB while it generates" if gen else " (its memory is its own process's)"
            out.append(f"  rollout: {self.engine} engine{held}")
        for role in dict.fromkeys(d.role for d in self.decisions):
            parts = [f"{d.field.split('.', 1)[1]}={_show(d.value)} ({'auto: ' if d.by_plan else ''}{d.why})"
                     for d in self.decisions if d.role == role]
            out.append(f"  {role}: " + "; ".join(parts))
        return out


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Step:
    """One rung of the ladder: the config field it sets, the role it concerns, and the change."""

    field: str
    role: str
    change: Callable[[Switches], Switches | None]  # None: nothing to change (already on, or not possible)
    value: Callable[[Switches], Any]


def _smaller_micro(mini_rows: int, width: int) -> Callable[[Switches], Switches | None]:
    """Halve the rows per forward (or the token budget), to a divisor of the per-rank mini-batch."""
    def change(s: Switches) -> Switches | None:
        if s.token_budget is not None:
            return s.with_(token_budget=s.token_budget // 2) if s.token_budget // 2 >= width else None
        smaller = [d for d in range(1, s.micro_batch_rows // 2 + 1) if mini_rows % d == 0]
        return s.with_(micro_batch_rows=max(smaller)) if smaller else None
    return change


def ladder(work: Workload, mini_rows: int, generate_chunks: bool, budget_tokens: int | None = None) -> list[Step]:
    """The switches in the order of what they cost (module docstring). `budget_tokens`: the token
    budget the config gives (`max_token_len_per_gpu`), else what an average micro-batch costs (the
    longest rows then go in smaller groups, the short ones in larger: about as many forwards)."""
    width = work.width
    steps = [
        Step("model.logprob_chunk_tokens", "actor",
             lambda s: s.with_(logprob_chunk_tokens=DEFAULT_CHUNK) if s.logprob_chunk_tokens <= 0 else None,
             lambda s: s.logprob_chunk_tokens),
        Step("model.remove_padding", "actor", lambda s: None if s.remove_padding else s.with_(remove_padding=True),
             lambda s: s.remove_padding),
        Step("algorithm.use_dynamic_bsz", "actor",
             lambda s: None if s.token_budget is not None else
             s.with_(token_budget=budget_tokens or max(width, int(s.micro_batch_rows * (work.mean_tokens or width)))),
             lambda s: s.token_budget is not None),
        Step("model.gradient_checkpointing", "actor",
             lambda s: None if s.gradient_checkpointing else s.with_(gradient_checkpointing=True),
             lambda s: s.gradient_checkpointing),
    ]
    if work.ref and work.device == "cuda":
        steps.append(Step("model.param_offload.ref", "ref",
                          lambda s: None if s.ref_offload else s.with_(ref_offload=True), lambda s: s.ref_offload))
    if work.trains or work.ref or work.critic:
        steps.append(Step("algorithm.micro_batch_size", "actor", _smaller_micro(mini_rows, width),
                          lambda s: s.micro_batch_rows))
        steps.append(Step("model.logprob_chunk_tokens", "actor",  # the head's share, once the layers are bounded
                          lambda s: s.with_(logprob_chunk_tokens=s.logprob_chunk_tokens // 2)
                          if s.logprob_chunk_tokens // 2 >= MIN_CHUNK else None, lambda s: s.logprob_chunk_tokens))
    if generate_chunks and work.generate_rows > 1:
        steps.append(Step("rollout.generate_rows", "rollout",
                          lambda s: s.with_(generate_rows=max(1, (s.generate_rows or work.generate_rows) // 2))
                          if (s.generate_rows or work.generate_rows) > 1 else None,
                          lambda s: s.generate_rows or work.generate_rows))
    return steps


def locked(step_field: str, switches: Switches, explicit: frozenset[str]) -> bool:
    """Whether the config set what this rung would change (smaller micro-batches: the token budget
    when micro-batches go by tokens, else the rows)."""
    if step_field == "algorithm.micro_batch_size" and switches.token_budget is not None:
        return "algorithm.max_token_len_per_gpu" in explicit
    return step_field in explicit


def plan_memory(model: ModelShape, work: Workload, start: Switches, explicit: frozenset[str], budget: Budget,
                headroom: float, *, mini_rows: int, economy: bool | None = None, generate_chunks: bool = False,
                budget_tokens: int | None = None, process: str = "trainer") -> MemoryPlan:
    """The switches `work` runs with: `start` (the config's), then the ladder until the estimate fits.

    `explicit`: config fields the user set (never changed). `economy`: also take activation
    checkpointing when it halves the step (default: on a CPU). `generate_chunks`: generation
    may be cut into chunks of prompts as a last resort (the OOM retry's way).
    """
    economy = work.device == "cpu" if economy is None else economy
    plan = MemoryPlan(start, estimate(model, work, start), budget, headroom, process=process)
    changed: dict[str, str] = {}
    steps = ladder(work, mini_rows, generate_chunks, budget_tokens)
    while not plan.fits and _climb(plan, steps, model, work, explicit, changed):
        pass
    if economy and work.trains and not plan.switches.gradient_checkpointing \
            and "model.gradient_checkpointing" not in explicit:
        candidate = plan.switches.with_(gradient_checkpointing=True)
        after = estimate(model, work, candidate)
        saving = plan.estimate.peak - after.peak
        if saving >= ECONOMY_MIN_SAVING and 2 * saving >= plan.estimate.peak - work.floor_bytes:
            changed["model.gradient_checkpointing"] = (f"halves the step on shared host memory, "
                                                       f"{plan.estimate.peak / GIB:.2f} -> {after.peak / GIB:.2f} GiB")
            plan.switches, plan.estimate = candidate, after
    plan.decisions = _decisions(work, start, plan.switches, explicit, changed) if work.trains or work.ref or \
        work.critic else []
    plan.engine = work.engine
    return plan


def _climb(plan: MemoryPlan, steps: list[Step], model: ModelShape, work: Workload, explicit: frozenset[str],
           changed: dict[str, str]) -> bool:
    """Take the cheapest rung that lowers the estimate (each time from the bottom: a rung taken may let a
    cheaper one help again, as a smaller log-prob chunk lets smaller micro-batches); False when none does."""
    for step in steps:
        if locked(step.field, plan.switches, explicit):
            continue
        candidate = step.change(plan.switches)
        after = estimate(model, work, candidate) if candidate is not None else None
        if after is not None and after.peak < plan.estimate.peak:
            first = changed.get(step.field, f"{plan.estimate.peak / GIB:.2f}").split(" ->")[0]
            changed[step.field] = f"{first} -> {after.peak / GIB:.2f} GiB to fit"
            plan.switches, plan.estimate = candidate, after
            return True
    return False


def _decisions(work: Workload, start: Switches, final: Switches, explicit: frozenset[str],
               changed: dict[str, str]) -> list[Decision]:
    """What each switch ends up as, and why: set by the plan, set in the config, or not needed."""
    trainer = "actor" if work.trains else "critic" if work.critic else "ref"
    fields: list[tuple[str, str, Any, Any]] = [
        (trainer, "model.logprob_chunk_tokens", start.logprob_chunk_tokens, final.logprob_chunk_tokens),
        (trainer, "model.remove_padding", start.remove_padding, final.remove_padding),
        (trainer, "algorithm.use_dynamic_bsz", start.token_budget is not None, final.token_budget is not None),
        (trainer, "algorithm.max_token_len_per_gpu", start.token_budget, final.token_budget),
        (trainer, "model.gradient_checkpointing", start.gradient_checkpointing, final.gradient_checkpointing),
        (trainer, "algorithm.micro_batch_size", start.micro_batch_rows, final.micro_batch_rows),
    ]
    if work.ref:
        fields.append(("ref", "model.param_offload.ref", start.ref_offload, final.ref_offload))
    if final.generate_rows is not None:
        fields.append(("rollout", "rollout.generate_rows", start.generate_rows, final.generate_rows))
    out = []
    for role, name, before, after in fields:
        if (name == "algorithm.max_token_len_per_gpu" and after is None) or \
                (name == "model.gradient_checkpointing" and not (work.trains or work.critic)):
            continue
        if name in explicit:
            out.append(Decision(role, name, after, False, "set in the config"))
        elif before != after:
            source = "algorithm.micro_batch_size" if name.endswith("token_len_per_gpu") and \
                start.token_budget is not None else "algorithm.use_dynamic_bsz" if name.endswith("token_len_per_gpu") \
                else name
            out.append(Decision(role, name, after, True, changed.get(source, "with the token budget")))
        elif name == "model.param_offload.ref" and work.device != "cuda":
            out.append(Decision(role, name, after, False, "a CPU has nowhere to offload to"))
        else:
            out.append(Decision(role, name, after, False, "not needed"))
    return out
