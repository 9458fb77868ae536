"""Preemption recovery: signal -> checkpointed stop -> restart -> first completed step.

What a preemption costs a run, measured through the CLI with the local launcher:
SIGUSR1 ("time is nearly up", what Slurm's `--signal` sends) reaches the `verl-hpc train`
process in the middle of a step; the trainer finishes that step, saves synchronously and
exits (128 + SIGUSR1 locally; under Slurm it would requeue itself); the same command
is then run again at once with the same --run-dir and resumes from the checkpoint. The
benchmark times, from outside: signal -> exit, exit -> relaunch (the requeue wait: 0
here, the scheduler's under Slurm), relaunch -> first completed step after the resume.
The split comes from the run's own metrics: `timing_s/save_checkpoint` of the stop step
is the save; `timing_s/step` of the first resumed step is taken off the restart time;
the rest of the restart is start-up + restore. Start-up alone is measured on the same
repetition's first launch (launch -> first step, minus that step), so restore is the
restart's excess over a cold start (an estimate: the difference of two noisy times,
floored at 0). Work lost: steps completed before the exit minus the checkpoint's step.

The baseline in the same run is that cold start: the ratio recovery / cold start says
what a preemption costs beyond starting the job at all. Targets: <= 30 s from
signal to first step excluding the scheduler's wait, <= 1 step lost. The Slurm variant
(a real preemption on the local cluster, with its requeue wait) is not part of this
module: `python -m bench preemption --slurm` (bench/preemption_slurm.py), never in `all`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "configs"
TARGET_S, TARGET_LOST = 30.0, 1
SIGNAL_AFTER = 3  # completed steps before the signal


def _launch(config: str, run_dir: Path) -> subprocess.Popen:
    model_dir = Path.home() / ".cache" / "verl-hpc" / "models" / "tiny-seed0"
    cmd = [sys.executable, "-m", "verl_hpc", "train", str(CONFIGS / config), "--run-dir", str(run_dir),
           f"model.path={model_dir}", "trainer.total_steps=200", "trainer.torch_threads=1",
           "trainer.save_hf_model=false", "logging.progress=off"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_step(popen: subprocess.Popen, run_dir: Path, step: int, timeout: float = 600) -> tuple[float, dict]:
    """Poll (20 ms) until metrics hold `step`: (time it was seen, its row)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = next((r for r in _rows(run_dir) if r["step"] == step), None)
        if row is not None:
            return time.monotonic(), row
        if popen.poll() is not None:
            raise RuntimeError(f"run exited ({popen.returncode}) before step {step}: {popen.stderr.read()[-2000:]}")
        time.sleep(0.02)
    raise RuntimeError(f"step {step} not reached in {timeout:.0f} s")


def _stop(popen: subprocess.Popen) -> None:
    popen.send_signal(signal.SIGTERM)
    popen.communicate(timeout=120)


def one_preemption(config: str, run_dir: Path) -> dict[str, float]:
    """Launch, preempt mid-step with SIGUSR1, relaunch at once, time the first resumed step."""
    t0 = time.monotonic()
    first = _launch(config, run_dir)
    t_first1, row1 = _wait_step(first, run_dir, 1)
    _, row = _wait_step(first, run_dir, SIGNAL_AFTER)
    time.sleep(0.5 * row["timing_s/step"])  # land in the middle of the next step
    t_sig = time.monotonic()
    first.send_signal(signal.SIGUSR1)
    out, err = first.communicate(timeout=300)
    t_exit = time.monotonic()
    if "stopped by SIGUSR1 after step" not in out:
        raise RuntimeError(f"SIGUSR1 did not stop the run cleanly ({first.returncode}): {err[-2000:]}")
    saved = int(out.split("stopped by SIGUSR1 after step ")[1].split(";")[0])
    before = _rows(run_dir)
    last_done = max(r["step"] for r in before)
    save_s = next(r for r in before if r["step"] == saved).get("timing_s/save_checkpoint", float("nan"))
    t1 = time.monotonic()
    second = _launch(config, run_dir)
    t_first2, row2 = _wait_step(second, run_dir, saved + 1)
    _stop(second)
    cold_startup = (t_first1 - t0) - row1["timing_s/step"]
    startup_restore = (t_first2 - t1) - row2["timing_s/step"]
    total = t_first2 - t_sig
    return {"stop_s": t_exit - t_sig, "save_s": save_s, "drain_s": t_exit - t_sig - save_s,
            "requeue_wait_s": t1 - t_exit, "startup_s": min(cold_startup, startup_restore),
            "restore_s": max(startup_restore - cold_startup, 0.0), "first_step_s": row2["timing_s/step"],
            "total_s": total, "total_excl_wait_s": total - (t1 - t_exit), "cold_start_s": t_first1 - t0,
            "recovery_over_cold": (t_first2 - t1) / (t_first1 - t0), "steps_lost": float(last_done - saved),
            "steps_after_signal": float(last_done - SIGNAL_AFTER)}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    configs = ["quickstart.yaml"] if quick else ["quickstart.yaml", "quickstart_split.yaml"]
    reps = 1 if quick else 3
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_preemption_", dir=scratch))
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    try:
        for rep in range(reps):
            for config in configs[rep % len(configs):] + configs[:rep % len(configs)]:
                samples[config].append(one_preemption(config, work / f"{Path(config).stem}-rep{rep}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cases, ratios = [], {}
    for config, reps_done in samples.items():
        fields = {k: _summary([s[k] for s in reps_done]) for k in reps_done[0]}
        name = Path(config).stem
        cases.append({"config": config, "reps": len(reps_done), **fields})
        ratios[f"recovery_over_cold_start_{name}"] = fields["recovery_over_cold"]
        ratios[f"recovery_excl_wait_over_{TARGET_S:.0f}s_target_{name}"] = {
            k: v / TARGET_S for k, v in fields["total_excl_wait_s"].items()}
    return {"cpus": os.cpu_count(), "signal_after": SIGNAL_AFTER, "cases": cases, "ratios": ratios,
            "slurm": "not measured by this module: python -m bench preemption --slurm (bench/preemption_slurm.py)"}


def table(result: dict[str, Any]) -> str:
    cols = ["save_s", "drain_s", "requeue_wait_s", "startup_s", "restore_s", "first_step_s", "total_excl_wait_s"]
    heads = ["save", "drain", "requeue", "start-up", "restore", "1st step", "total*"]
    lines = [f"preemption benchmark: SIGUSR1 mid-step after {result['signal_after']} steps -> checkpointed stop -> "
             f"immediate restart, local launcher, medians in s on {result['cpus']} CPUs",
             f"{'config':<24}" + "".join(f"{h:>10}" for h in heads) + f"{'lost':>6}{'vs cold':>9}"]
    for case in result["cases"]:
        lines.append(f"{case['config']:<24}" + "".join(f"{case[c]['median']:>10.2f}" for c in cols)
                     + f"{case['steps_lost']['max']:>6.0f}{case['recovery_over_cold']['median']:>9.2f}")
    worst = max(c["total_excl_wait_s"]["max"] for c in result["cases"])
    lost = max(c["steps_lost"]["max"] for c in result["cases"])
    lines.append(f"* signal -> first resumed step, excluding the requeue wait; worst {worst:.1f} s "
                 f"(target <= {TARGET_S:.0f} s): {'met' if worst <= TARGET_S else 'MISSED'}")
    lines.append(f"steps lost, worst: {lost:.0f} (target <= {TARGET_LOST}): {'met' if lost <= TARGET_LOST else 'MISSED'}")
    lines.append("drain = finishing the step in flight + exit; restore = restart minus a cold start (estimate)")
    return "\n".join(lines)
