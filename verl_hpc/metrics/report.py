"""`verl-hpc report`: one picture and one paragraph of a run, finished, running or requeued.

Why panels are plain data: what a report shows (which metrics, on which axis, where the
restarts were) is decided here, without matplotlib, so a test can ask "did the memory
panel get data, is the requeue marked" without looking at pixels; `report_render` only
draws. A panel without data is kept (and drawn with a "no data" note): a missing panel
would hide that a metric stopped being logged.

Why restarts come from `attempts.jsonl`: a resumed run truncates metrics.jsonl back to
its checkpoint, so the steps themselves never show that a job was requeued.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from verl_hpc.metrics.history import WALL_CLOCK, Attempt, RunSummary, read_history
from verl_hpc.metrics.tensorboard import read_jsonl_metrics

Rows = list[dict[str, float]]
RUN_DIR_MARKERS = ("config.yaml", "attempts.jsonl", "tensorboard/metrics.jsonl")
SCORE = "critic/score/mean"


class NotARunDir(ValueError):
    """The directory holds none of a run's files (a typo, or the parent of the run dirs)."""


@dataclass
class Series:
    label: str
    x: list[float]
    y: list[float]
    style: str = "line"  # line | points | stack (stacked areas, drawn together per panel)


@dataclass
class Marker:
    x: float
    label: str


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)

    @property
    def has_data(self) -> bool:
        return any(s.y for s in self.series)


@dataclass
class RunData:
    """What the report reads from a run dir, and the x axis every panel shares."""

    run_dir: Path
    rows: Rows
    rollout: dict[str, Rows]     # "rollout_rank0" -> that process's rows
    attempts: list[Attempt]
    t0: float | None             # None: no wall clock in the rows, x is the step
    unit: tuple[str, float]      # the x axis' label and seconds per unit

    def x_of(self, row: dict[str, float]) -> float | None:
        if self.t0 is None:
            return float(row["step"])
        return (row[WALL_CLOCK] - self.t0) / self.unit[1] if WALL_CLOCK in row else None


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in RUN_DIR_MARKERS)


def load_run(run_dir: str | Path) -> RunData:
    """Read the trainer's and the rollout processes' rows and the attempts; pick the x axis.

    Wall-clock time only if every trainer row has it (rows of an older revision do not):
    a half wall-clock, half step axis would be meaningless. Zero is the first attempt's
    start, so start-up time shows as the gap before the first point.
    """
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise NotARunDir(f"{run_dir} is not a run directory (none of {', '.join(RUN_DIR_MARKERS)} in it)")
    tb = run_dir / "tensorboard"
    rows = read_jsonl_metrics(tb / "metrics.jsonl") if (tb / "metrics.jsonl").exists() else []
    rollout = {p.parent.name: read_jsonl_metrics(p) for p in sorted(tb.glob("rollout_rank*/metrics.jsonl"))}
    attempts = read_history(run_dir)
    t0 = None
    if rows and all(WALL_CLOCK in r for r in rows):
        first = rows[0][WALL_CLOCK] - float(rows[0].get("timing_s/step", 0.0))
        t0 = min([first, *(a.started for a in attempts[:1])])
    span = max((r[WALL_CLOCK] for r in rows), default=0.0) - t0 if t0 is not None else 0.0
    unit = ("step", 1.0) if t0 is None else next(u for u in (("hours", 3600.0), ("minutes", 60.0), ("seconds", 1.0))
                                                  if span >= 3 * u[1] or u[1] == 1.0)
    return RunData(run_dir, rows, rollout, attempts, t0, unit)


def restart_markers(run: RunData) -> list[Marker]:
    """One marker per attempt after the first: where on the x axis the run came back."""
    markers = []
    for a in run.attempts[1:]:
        label = f"restart {a.number - 1} (job {a.job_id}, from step {a.resumed_at})"
        if run.t0 is not None:
            markers.append(Marker((a.started - run.t0) / run.unit[1], label))
        else:
            markers.append(Marker(a.resumed_at + 0.5, label))
    return markers


def series(run: RunData, rows: Rows, key: str, label: str | None = None, style: str = "line",
           rollout_steps: bool = False) -> Series:
    """`key` over the shared x axis; rows without it are skipped (validation runs on some steps only).

    `rollout_steps`: rows of a rollout process without a wall clock are placed at the x of the
    trainer's row of the same step.
    """
    by_step = {r["step"]: run.x_of(r) for r in run.rows} if rollout_steps else {}
    xs, ys = [], []
    for row in rows:
        if key not in row:
            continue
        x = run.x_of(row) if not rollout_steps or WALL_CLOCK in row or run.t0 is None else by_step.get(row["step"])
        if x is not None:
            xs.append(x)
            ys.append(float(row[key]))
    return Series(label or key, xs, ys, style)


def _keys(rows: Rows, prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix)})


def _panels_learning(run: RunData) -> list[Panel]:
    val = [series(run, run.rows, k, k.removeprefix("val-core/"), "points") for k in _keys(run.rows, "val-core/")]
    return [
        Panel("Score (reward)", "score", [series(run, run.rows, SCORE, "train score"), *val]),
        Panel("KL and entropy", "nats", [series(run, run.rows, "actor/kl_loss", "KL loss"),
                                         series(run, run.rows, "actor/entropy", "entropy")]),
        Panel("Response length", "tokens", [series(run, run.rows, "response_length/mean", "mean length")]),
    ]


def _panels_system(run: RunData) -> list[Panel]:
    stages = [k for k in _keys(run.rows, "timing_s/") if k != "timing_s/step"]
    memory = [series(run, run.rows, k, f"trainer {k.removeprefix('memory/')}")
              for k in ("memory/rss_gb", "memory/peak_rss_gb", "memory/max_allocated_gb")]
    bandwidth = [series(run, run.rows, "perf/weight_sync_gbps", "weight sync (trainer)")]
    for name, rows in run.rollout.items():
        memory.append(series(run, rows, "memory/rss_gb", f"{name} rss_gb", rollout_steps=True))
        bandwidth += [series(run, rows, "perf/weight_sync_gbps", f"weight sync ({name})", rollout_steps=True),
                      series(run, rows, "perf/rollout_transport_gbps", f"rollout transport ({name})",
                             rollout_steps=True)]
    bandwidth.append(series(run, run.rows, "perf/rollout_transport_gbps", "rollout transport (trainer)"))
    saves = [series(run, [r for r in run.rows if r.get(key, 0.0) > 0], key, label, "points")  # 0: no save
             for key, label in (("timing_s/save_checkpoint", "loop stall"), ("perf/checkpoint_save_s", "commit"))]
    return [
        Panel("Stage seconds per step (stacked)", "seconds",
              [series(run, run.rows, k, k.removeprefix("timing_s/"), "stack") for k in stages]),
        Panel("Throughput", "tokens/s", [series(run, run.rows, "perf/throughput", "tokens/s")]),
        Panel("Memory", "GB", [s for s in memory if s.y] or memory[:1]),
        Panel("Weight sync and rollout transport", "GB/s", [s for s in bandwidth if s.y] or bandwidth[:1]),
        Panel("Checkpoint save", "seconds", saves),
    ]


def report_panels(run_dir: str | Path) -> list[Panel]:
    """Every panel of the report, each carrying the restart markers (also those without data)."""
    return report_panels_of(load_run(run_dir))


def report_panels_of(run: RunData) -> list[Panel]:
    panels = [*_panels_learning(run), *_panels_system(run)]
    markers = restart_markers(run)
    for panel in panels:
        panel.markers = list(markers)
    return panels


def total_steps(run_dir: Path) -> int | None:
    """`trainer.total_steps` of the run's saved config, read as plain YAML (this layer loads no config)."""
    import yaml

    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
        return int(data["trainer"]["total_steps"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def summary_text(run: RunData) -> str:
    """The paragraph a person wants first: how far, how fast, how good, and what requeues cost."""
    rows, done = run.rows, (run.rows[-1]["step"] if run.rows else 0)
    total = total_steps(run.run_dir)
    lines = [f"run:          {run.run_dir}",
             f"steps:        {int(done)}" + (f" / {total}" if total else " (total unknown)")]
    speeds = [r["perf/throughput"] for r in rows if "perf/throughput" in r]
    lines.append(f"tokens/s:     {statistics.median(speeds):.1f} (median)" if speeds else "tokens/s:     -")
    scores = [r[SCORE] for r in rows if SCORE in r]
    lines.append(f"score:        {scores[-1]:.4f} (last)" if scores else "score:        -")
    for key in _keys(rows, "val-core/"):
        vals = [r[key] for r in rows if key in r]
        lines.append(f"validation:   {key} last {vals[-1]:.4f}, best {max(vals):.4f}")
    summ = RunSummary.of(run.attempts)
    state = (run.attempts[-1].reason or "running (or killed)") if run.attempts else "unknown (no attempts.jsonl)"
    lines.append(f"attempts:     {summ.attempts} ({summ.requeues} requeues/restarts); last: {state}")
    lines.append(f"lost time:    {_duration(summ.lost_s)} (preemption and redone steps)")
    lines.append(f"wall time:    {_duration(wall_seconds(run))}")
    return "\n".join(lines)


def wall_seconds(run: RunData) -> float:
    """First attempt's start to the latest thing known: last step, or an attempt's end."""
    ends = [r[WALL_CLOCK] for r in run.rows if WALL_CLOCK in r] + [a.ended for a in run.attempts if a.ended]
    starts = [a.started for a in run.attempts[:1]] + ([run.t0] if run.t0 is not None else [])
    return max(ends) - min(starts) if ends and starts else 0.0


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(round(seconds)), 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"
