"""CPU scaling: the same GRPO step on 1, 2 and 4 actor processes (colocated, FSDP2).

Strong scaling: the global batch (16 prompts x 8 samples x 16 tokens) is fixed, each of
the N processes generates and trains on 128/N sequences with its own colocated engine
(`configs/quickstart_colocated.yaml`, one intra-op thread per process). Runs go through
the CLI like a user's; the trainer's `timing_s/step` is read from the run's metrics
(start-up excluded, the first 2 steps dropped). The process counts alternate in a
rotating order over repetitions. Reported per N: speedup = s/step(1) / s/step(N) and
efficiency = speedup / N (median, min-max over repetitions, each paired with the
N=1 run of the same repetition).

On a 2-core machine N=4 oversubscribes the cores: what it measures there is the cost
of running more ranks than cores (gloo collectives between time-sliced processes), not
the project's scaling. docs/benchmarks.md models what the numbers imply for GPU nodes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NEW_TOKENS, THREADS = 16, 1


def _run(processes: int, steps: int, run_dir: Path, preset: str) -> float:
    """Median trainer s/step of one colocated run over `processes` actor ranks."""
    ids = "[" + ",".join(str(i) for i in range(processes)) + "]"
    model_dir = Path.home() / ".cache" / "verl-hpc" / "models" / f"{preset}-seed0"
    overrides = [f"model.path={model_dir}", f"model.init_preset={preset}", f"trainer.total_steps={steps}", f"algorithm.sampling.max_new_tokens={NEW_TOKENS}",
                 "algorithm.kl.coef=0", "algorithm.entropy_coef=0", f"trainer.torch_threads={THREADS}",
                 f"resources.actor.device_ids={ids}", f"resources.rollout.device_ids={ids}",
                 "trainer.save_hf_model=false", "logging.progress=off"]
    cmd = [sys.executable, "-m", "verl_hpc", "train", str(HERE.parent / "configs" / "quickstart_colocated.yaml"),
           "--run-dir", str(run_dir), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise RuntimeError(f"{processes}-process run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    from verl_hpc.metrics.tensorboard import read_jsonl_metrics

    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    return statistics.median(r["timing_s/step"] for r in rows[2:])


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(preset: str, counts: list[int], reps: int, steps: int, work: Path) -> dict[str, Any]:
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    for rep in range(reps):
        order = counts[rep % len(counts):] + counts[:rep % len(counts)]
        for n in order:
            seconds[n].append(_run(n, steps, work / f"{preset}-n{n}-rep{rep}", preset))
    rows = []
    for n in counts:
        speedups = [one / many for one, many in zip(seconds[1], seconds[n], strict=True)]
        rows.append({"processes": n, "step_s": _summary(seconds[n]), "speedup": _summary(speedups),
                     "efficiency": _summary([s / n for s in speedups])})
    return {"preset": preset, "reps": reps, "steps": steps, "rows": rows,
            "ratios": {f"efficiency_{r['processes']}proc_{preset}": r["efficiency"] for r in rows[1:]}}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    plan = [("tiny", [1, 2], 1, 5)] if quick else [("tiny", [1, 2, 4], 3, 10), ("small", [1, 2], 2, 6)]
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_scaling_", dir=scratch))
    try:
        cases = [measure(preset, counts, reps, steps, work) for preset, counts, reps, steps in plan]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"cpus": os.cpu_count(), "cases": cases, "ratios": {k: v for c in cases for k, v in c["ratios"].items()}}


def table(result: dict[str, Any]) -> str:
    lines = [f"scaling benchmark: colocated GRPO step, global batch 128 x {NEW_TOKENS} tokens, "
             f"rotating reps on {result['cpus']} CPUs (strong scaling)",
             f"{'model':<7}{'processes':>10}{'s/step':>9}{'speedup':>9}{'efficiency':>12}{'min':>7}{'max':>7}"]
    for case in result["cases"]:
        for row in case["rows"]:
            e = row["efficiency"]
            lines.append(f"{case['preset']:<7}{row['processes']:>10}{row['step_s']['median']:>9.3f}"
                         f"{row['speedup']['median']:>9.2f}{e['median']:>12.2f}{e['min']:>7.2f}{e['max']:>7.2f}")
    return "\n".join(lines)
