"""The seeds' placement comparison, on CPU processes: crowded vs hand-isolated vs the project's.

Three placements of the same GRPO job (model, prompts, batch of 16 prompts x 8 samples,
steps), each run through the CLI like a user's:
- crowded: every role in one process on one device slot (`configs/quickstart.yaml`, the
  embedded loop: actor, rollout and reference share device 0);
- isolated: each role hand-placed on its own slot, the way the seeds split devices
  (`configs/quickstart_split.yaml` with actor [0], rollout [1], reward [2]);
- project: the project's default for a multi-process run, the hybrid engine
  (`configs/quickstart_colocated.yaml`: actor FSDP2 over 2 processes, each hosting a
  rollout engine).
Throughput is sequences/s from the trainer's `timing_s/step` (start-up excluded, the
first steps dropped). Peak memory is the largest sum of RSS over the run's whole process
tree, sampled with psutil every 0.1 s while it runs: the per-rank `memory/peak_rss_gb`
metric sees only the trainer leader. OOM count: the runtime's `resource/degrade_events`
(out-of-memory retries at a smaller micro-batch) plus runs that failed. The placements
alternate in a rotating order; ratios are paired within a repetition, against crowded.

On CPU there is no device memory wall, so "OOM" here can only be host memory; the
comparison the seeds made on GPUs (where crowding is what runs out of memory) needs a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "configs"
BATCH, NEW_TOKENS = 128, 16
PLACEMENTS: dict[str, tuple[str, list[str]]] = {
    "crowded": ("quickstart.yaml", []),
    "isolated": ("quickstart_split.yaml", ["resources.actor.device_ids=[0]", "resources.rollout.device_ids=[1]",
                                           "resources.reward.device_ids=[2]"]),
    "project": ("quickstart_colocated.yaml", []),
}


def _tree_rss(root: psutil.Process) -> int:
    """RSS of `root` and every descendant, bytes (processes that vanish mid-read count 0)."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


def _watch_peak(popen: subprocess.Popen, peak: list[int], period: float = 0.1) -> None:
    try:
        root = psutil.Process(popen.pid)
    except psutil.Error:
        return
    while popen.poll() is None:
        try:
            peak[0] = max(peak[0], _tree_rss(root))
        except psutil.Error:
            return
        time.sleep(period)


def _run(placement: str, preset: str, steps: int, run_dir: Path,
         placements: dict[str, tuple[str, list[str]]] = PLACEMENTS) -> dict[str, Any]:
    """One run of `placement`: {ok, seq_per_s, peak_rss_gb, peak_gpu_gb, degrade_events}."""
    config, extra = placements[placement]
    model_dir = Path.home() / ".cache" / "verl-hpc" / "models" / f"{preset}-seed0"
    overrides = [f"model.path={model_dir}", f"model.init_preset={preset}", f"trainer.total_steps={steps}",
                 f"trainer.batch_size={BATCH}", f"algorithm.sampling.max_new_tokens={NEW_TOKENS}",
                 "trainer.torch_threads=1", "trainer.save_hf_model=false", "logging.progress=off", *extra]
    cmd = [sys.executable, "-m", "verl_hpc", "train", str(CONFIGS / config), "--run-dir", str(run_dir), *overrides]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    peak, gpu_peak = [0], [0]
    watchers = [threading.Thread(target=_watch_peak, args=(popen, peak), daemon=True),
                threading.Thread(target=_watch_gpu_peak, args=(popen, gpu_peak), daemon=True)]
    for watcher in watchers:
        watcher.start()
    _, err = popen.communicate(timeout=1800)
    for watcher in watchers:
        watcher.join()
    metrics = run_dir / "tensorboard" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    ok = popen.returncode == 0 and len(rows) == steps
    if not ok:
        print(f"[placement] {placement} run failed ({popen.returncode}): {err[-1500:]}", file=sys.stderr, flush=True)
    kept = rows[min(2, len(rows) - 1):] if rows else []
    step_s = statistics.median(r["timing_s/step"] for r in kept) if kept else float("nan")
    return {"ok": ok, "seq_per_s": BATCH / step_s, "peak_rss_gb": peak[0] / 2**30, "peak_gpu_gb": gpu_peak[0] / 2**30,
            "degrade_events": sum(r.get("resource/degrade_events", 0.0) for r in rows)}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _watch_gpu_peak(popen: subprocess.Popen, peak: list[int], period: float = 0.1) -> None:
    """Device memory used on GPU 0 by everything (CUDA contexts too), through NVML; no-op without it."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no NVML library or no GPU: CPU runs report 0
        return
    while popen.poll() is None:
        peak[0] = max(peak[0], int(pynvml.nvmlDeviceGetMemoryInfo(handle).used))
        time.sleep(period)


def measure(preset: str, reps: int, steps: int, work: Path,
            placements: dict[str, tuple[str, list[str]]] = PLACEMENTS) -> dict[str, Any]:
    names = list(placements)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            runs[name].append(_run(name, preset, steps, work / f"{preset}-{name}-rep{rep}", placements))
    rows, ratios = [], {}
    for name in names:
        good = [r for r in runs[name] if r["ok"]]
        ooms = sum(int(r["degrade_events"]) for r in runs[name]) + len(runs[name]) - len(good)
        row: dict[str, Any] = {"placement": name, "config": placements[name][0], "runs": len(runs[name]),
                               "oom_count": ooms}
        if good:
            row["seq_per_s"] = _summary([r["seq_per_s"] for r in good])
            row["peak_rss_gb"] = _summary([r["peak_rss_gb"] for r in good])
            row["peak_gpu_gb"] = _summary([r["peak_gpu_gb"] for r in good])
        rows.append(row)
        pairs = [(c, r) for c, r in zip(runs["crowded"], runs[name], strict=True) if c["ok"] and r["ok"]]
        if name != "crowded" and pairs:
            ratios[f"throughput_{name}_over_crowded_{preset}"] = _summary([r["seq_per_s"] / c["seq_per_s"] for c, r in pairs])
            ratios[f"peak_rss_{name}_over_crowded_{preset}"] = _summary([r["peak_rss_gb"] / c["peak_rss_gb"] for c, r in pairs])
            if all(c["peak_gpu_gb"] > 0 for c, _ in pairs):
                ratios[f"peak_gpu_{name}_over_crowded_{preset}"] = _summary([r["peak_gpu_gb"] / c["peak_gpu_gb"]
                                                                            for c, r in pairs])
    return {"preset": preset, "reps": reps, "steps": steps, "rows": rows, "ratios": ratios}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    plan = [("tiny", 1, 3)] if quick else [("tiny", 3, 10)]
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_placement_", dir=scratch))
    try:
        cases = [measure(preset, reps, steps, work) for preset, reps, steps in plan]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"cpus": os.cpu_count(), "batch": BATCH, "new_tokens": NEW_TOKENS, "cases": cases,
            "ratios": {k: v for c in cases for k, v in c["ratios"].items()}}


def table(result: dict[str, Any]) -> str:
    lines = [f"placement benchmark: GRPO, batch {result['batch']} x {result['new_tokens']} tokens, "
             f"rotating reps on {result['cpus']} CPUs (crowded vs isolated vs project)",
             f"{'model':<7}{'placement':<10}{'seq/s':>8}{'min':>8}{'max':>8}{'peak RSS GB':>13}{'OOM':>5}"]
    for case in result["cases"]:
        for row in case["rows"]:
            if "seq_per_s" not in row:
                lines.append(f"{case['preset']:<7}{row['placement']:<10}{'(all runs failed)':>37}{row['oom_count']:>5}")
                continue
            t, m = row["seq_per_s"], row["peak_rss_gb"]
            lines.append(f"{case['preset']:<7}{row['placement']:<10}{t['median']:>8.1f}{t['min']:>8.1f}{t['max']:>8.1f}"
                         f"{m['median']:>13.2f}{row['oom_count']:>5}")
    ooms = sum(row["oom_count"] for case in result["cases"] for row in case["rows"])
    lines.append(f"OOM count over all runs: {ooms} (target 0 on CPU): {'met' if ooms == 0 else 'MISSED'}")
    for key, s in result["ratios"].items():
        lines.append(f"  {key}: {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
    return "\n".join(lines)
