"""A step's verl-style metric names as Prometheus samples: pure, so the mapping is tested alone.

Why a mapping rather than sanitized keys alone: Prometheus queries aggregate over labels, not
over name patterns. `timing_s/gen` and `timing_s/update_actor` as one family
`verl_hpc_step_seconds{stage=...}` stack in one Grafana query; `memory/rss_gb` and
`memory/allocated_gb` as `verl_hpc_memory_bytes{kind=...}` share an axis. Prometheus also wants
base units in names (seconds, bytes) and `_total` on counters, so GiB become bytes and GB/s
become bytes per second here, once, instead of in every dashboard.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from verl_hpc.metrics.history import RunSummary

PREFIX = "verl_hpc_"
GIB = float(1 << 30)
GB = 1e9  # perf/*_gbps are decimal GB/s (bytes / 1e9 / seconds)
SKIPPED = frozenset({"perf/wall_clock", "step"})  # a timestamp is not a sample; the step has its own families
LABELS = ("job_id", "run", "role", "rank")

Kind = Literal["gauge", "counter"]


@dataclass(frozen=True)
class Sample:
    """One exposed line: `name` is the name as scraped (a counter's ends in `_total`)."""

    name: str
    kind: Kind
    labels: tuple[tuple[str, str], ...]
    value: float
    help: str


HELP = {
    "verl_hpc_step": "the last completed training step",
    "verl_hpc_steps_total": "training steps completed by the run (resumed runs count from their checkpoint)",
    "verl_hpc_step_seconds": "seconds the last step spent in each stage (timing_s/<stage>)",
    "verl_hpc_memory_bytes": "process memory by kind (memory/<kind>_gb: host RSS, device allocated/reserved)",
    "verl_hpc_throughput_tokens_per_second": "tokens processed per second in the last step (perf/throughput)",
    "verl_hpc_transfer_bytes_per_second": "rate of the last step's transfer on each path (perf/<path>_gbps)",
    "verl_hpc_transfer_bytes": "bytes moved on each path in the last step (perf/<path>_bytes)",
    "verl_hpc_requeues_total": "times the run was restarted after its first attempt (attempts.jsonl)",
    "verl_hpc_attempts_total": "attempts of the run, the running one included (attempts.jsonl)",
    "verl_hpc_preemption_lost_seconds_total": "seconds lost to restarts: queue gaps plus recomputed steps",
}
# a counter `x_total` is exposed as the family `x`: a plain key must not take either name
TYPED = frozenset(HELP) | {n.removesuffix("_total") for n in HELP} | {PREFIX.rstrip("_")}


def sanitize(key: str) -> str:
    """`critic/score/mean` -> `verl_hpc_critic_score_mean`: Prometheus names allow [a-zA-Z0-9_:] only."""
    body = re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9_]", "_", key)).strip("_")
    return PREFIX + body


def _typed(key: str, value: float) -> tuple[str, tuple[tuple[str, str], ...], float] | None:
    """The families with a unit and a label of their own; None for a key that is a plain gauge."""
    group, _, rest = key.partition("/")
    if not rest:
        return None
    if group == "timing_s":
        return "verl_hpc_step_seconds", (("stage", rest),), value
    if group == "memory" and rest.endswith("_gb"):
        return "verl_hpc_memory_bytes", (("kind", rest[:-3]),), value * GIB
    if group == "perf" and rest == "throughput":
        return "verl_hpc_throughput_tokens_per_second", (), value
    if group == "perf" and rest.endswith("_gbps"):
        return "verl_hpc_transfer_bytes_per_second", (("path", rest[:-5]),), value * GB
    if group == "perf" and rest.endswith("_bytes"):
        return "verl_hpc_transfer_bytes", (("path", rest[:-6]),), value
    if group == "perf" and rest.endswith("_s"):  # perf/checkpoint_save_s -> verl_hpc_checkpoint_save_seconds
        return f"{sanitize(rest[:-2])}_seconds", (), value
    return None


def step_samples(step: int, metrics: Mapping[str, float], labels: Mapping[str, str]) -> list[Sample]:
    """Every sample of one step, each carrying `labels` (job_id, run, role, rank) first.

    A plain key whose sanitized name would shadow a typed family (or another key) keeps the
    first one seen: two values under one name and label set would make the scrape invalid.
    """
    base = tuple(labels.items())
    out = [Sample("verl_hpc_step", "gauge", base, float(step), HELP["verl_hpc_step"]),
           Sample("verl_hpc_steps_total", "counter", base, float(step), HELP["verl_hpc_steps_total"])]
    seen = {(s.name, s.labels) for s in out}
    for key, value in metrics.items():
        if key in SKIPPED:
            continue
        typed = _typed(key, float(value))
        if typed is not None:
            name, extra, number = typed
            sample = Sample(name, "gauge", base + extra, number, HELP.get(name, f"verl metric {key}"))
        else:
            name = sanitize(key)
            if name in TYPED:
                continue
            sample = Sample(name, "gauge", base, float(value), f"verl metric {key}")
        if (sample.name, sample.labels) not in seen:
            seen.add((sample.name, sample.labels))
            out.append(sample)
    return out


def summary_samples(summary: RunSummary | None, labels: Mapping[str, str]) -> list[Sample]:
    """The run's restart counters; monotonic across requeues because attempts.jsonl only grows."""
    if summary is None:
        return []
    base = tuple(labels.items())
    values = {"verl_hpc_requeues_total": float(summary.requeues), "verl_hpc_attempts_total": float(summary.attempts),
              "verl_hpc_preemption_lost_seconds_total": float(summary.lost_s)}
    return [Sample(name, "counter", base, value, HELP[name]) for name, value in values.items()]
