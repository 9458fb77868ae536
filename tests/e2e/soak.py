"""Soak: does a long run leak? RSS, open fds, threads and child processes over thousands of steps.

Why: a leak of 30 KB per step is invisible in any test of a few steps and kills a week-long
run (the node's OOM killer, or EMFILE after a few thousand leaked sockets). Each config runs
as `verl-hpc train` in a child process, as a user runs it; a sampler polls the child's whole
process tree (the launcher and, in split placement, the actor, rollout and reward workers)
every `interval` seconds with psutil and reads the step reached from the tail of metrics.jsonl.

Reported per config: the RSS slope in MB per 1,000 steps, a least-squares fit of summed RSS
against the step over the second half of the samples (the first half covers start-up,
allocator warm-up and the first checkpoints), and the range of fds, threads and children in
that same half (targets: slope < SLOPE_TARGET_MB; no count's floor rises, see `analyse`).

Configs: configs/quickstart.yaml (one process) and configs/quickstart_split.yaml (split), both
at batch 32 so thousands of steps fit in minutes. tests/e2e/test_soak.py runs 300 steps of each in
CI; the long soak (5,000 steps, docs/benchmarks.md) is

    python -c "from tests.e2e import soak; print(soak.table(soak.run(steps=5000)))"
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"one_process": "configs/quickstart.yaml", "split": "configs/quickstart_split.yaml"}
# Checkpoints every 100 steps: their writer threads and files must not pile up either. One
# intra-op thread per process: on a shared 2-core machine OpenMP spinning makes steps 10x slower.
OVERRIDES = ["trainer.batch_size=32", "logging.progress=off", "trainer.save_hf_model=false",
             "checkpoint.interval_steps=100", "trainer.torch_threads=1"]
# A leak worth catching costs a week-long run (~10^5-10^6 steps) its node: 50 MB per 1,000
# steps is 5-50 GB there. Below it, the fit's noise (the allocator's arenas, page cache of
# the checkpoint files counted in RSS) on a few hundred steps is of the same order.
SLOPE_TARGET_MB = 50.0
STEPS, QUICK_STEPS = 5000, 300


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def sample(root: psutil.Process) -> dict[str, float] | None:
    """RSS (MB), fds, threads of the whole tree, and its number of child processes; None once it is gone."""
    rss = fds = threads = 0
    names: list[str] = []
    procs = _tree(root)
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
            names += _thread_names(proc.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return {"rss_mb": rss / 2**20, "fds": fds, "threads": threads, "children": len(procs) - 1,
            "thread_names": ",".join(sorted(names))} if procs else None


def _thread_names(pid: int) -> list[str]:
    """The names of a process's threads (Linux), so a rising thread floor says which thread stayed."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.append((task / "comm").read_text().strip())
        except OSError:
            continue
    return out


def last_step(metrics: Path) -> int:
    """The step of metrics.jsonl's last complete line (read from its tail: the file grows to MBs)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def soak(config: str, steps: int, work: Path, interval: float) -> dict[str, Any]:
    """Run `config` for `steps` steps, sampling its tree; returns the samples and the fits."""
    run_dir = work / Path(config).stem
    cmd = [sys.executable, "-m", "verl_hpc", "train", str(REPO / config), "--run-dir", str(run_dir),
           f"trainer.total_steps={steps}", *OVERRIDES]
    log = open(work / f"{run_dir.name}.log", "w")  # noqa: SIM115 - the child's output for a failure's message
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    root, samples, start = psutil.Process(proc.pid), [], time.monotonic()
    try:
        while proc.poll() is None:
            step = last_step(run_dir / "tensorboard" / "metrics.jsonl")
            if step > 0 and (now := sample(root)) is not None and proc.poll() is None:
                samples.append({"t": time.monotonic() - start, "step": step, **now})
            time.sleep(interval)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed ({proc.returncode}): {(work / f'{run_dir.name}.log').read_text()[-2000:]}")
    return {"config": config, "steps": steps, "wall_s": time.monotonic() - start, **analyse(samples, steps),
            "samples": samples}


def analyse(samples: list[dict[str, float]], final_step: int | None = None) -> dict[str, Any]:
    """The RSS slope, and the fd/thread/child ranges and floors over the second half of the samples.

    Samples at `final_step` are dropped: from there on the run is shutting down (workers exit,
    memory is freed), which is no step's steady state. Why floors: a checkpoint's writer threads
    and files come and go (a range of a few), a leak raises the count the process returns to;
    so a count is `stable` when the minimum over the window's last third is no higher than
    over its first third.
    """
    steady = [s for s in samples if final_step is None or s["step"] < final_step]
    late = steady[len(steady) // 2:]
    if len(late) < 3 or late[-1]["step"] == late[0]["step"]:
        return {"n_samples": len(samples), "rss_slope_mb_per_1k_steps": None, "ranges": {}}
    xs, ys = [s["step"] for s in late], [s["rss_mb"] for s in late]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    third = len(late) // 3
    ranges = {k: {"min": min(s[k] for s in late), "max": max(s[k] for s in late),
                  "floor_first": min(s[k] for s in late[:third]), "floor_last": min(s[k] for s in late[-third:])}
              for k in ("fds", "threads", "children")}
    if all("thread_names" in s for s in late):  # which threads each floor holds: a failure names the one that stayed
        for end, part in (("first", late[:third]), ("last", late[-third:])):
            ranges["threads"][f"names_{end}"] = min(part, key=lambda s: s["threads"])["thread_names"]
    return {"n_samples": len(samples), "window_steps": [xs[0], xs[-1]], "rss_slope_mb_per_1k_steps": slope * 1000,
            "rss_mb": {"first": samples[0]["rss_mb"], "window_start": ys[0], "last": ys[-1]}, "ranges": ranges}


def verdicts(case: dict[str, Any]) -> dict[str, bool]:
    """Which targets a case met: the RSS slope under SLOPE_TARGET_MB, no fd/thread/child floor rising."""
    slope = case["rss_slope_mb_per_1k_steps"]
    out = {"rss_slope": slope is not None and slope < SLOPE_TARGET_MB}
    for key, r in case["ranges"].items():
        out[f"{key}_stable"] = r["floor_last"] <= r["floor_first"]
    return out


def run(quick: bool = False, scratch: str | None = None, steps: int | None = None) -> dict[str, Any]:
    steps = steps or (QUICK_STEPS if quick else STEPS)
    interval = 0.25 if steps <= 1000 else 1.0  # a few hundred steps take tens of seconds: sample finer
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_soak_", dir=scratch))
    try:
        cases = [soak(config, steps, work, interval) | {"name": name} for name, config in CONFIGS.items()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for case in cases:
        case["met"] = verdicts(case)
    ratios = {f"rss_growth_{c['name']}": _ratio(c) for c in cases if c["rss_mb"]}
    return {"steps": steps, "interval_s": interval, "targets": {"rss_slope_mb_per_1k_steps": SLOPE_TARGET_MB},
            "cases": cases, "ratios": ratios}


def _ratio(case: dict[str, Any]) -> dict[str, float]:
    """RSS at the end over RSS at the window's start (1.0: flat): the growth in one number."""
    r = case["rss_mb"]["last"] / case["rss_mb"]["window_start"]
    return {"median": r, "min": r, "max": r}


def table(result: dict[str, Any]) -> str:
    lines = [f"soak: {result['steps']} steps per config, batch 32, sampled every {result['interval_s']} s; "
             "slope and ranges over the second half of the samples",
             f"{'config':<12}{'s':>7}{'samples':>8}{'RSS MB':>15}{'MB/1k steps':>13}  fds / threads / children"]
    for c in result["cases"]:
        slope, met = c["rss_slope_mb_per_1k_steps"], c["met"]
        rss = f"{c['rss_mb']['window_start']:.0f}->{c['rss_mb']['last']:.0f}" if c.get("rss_mb") else "-"
        ranges = " / ".join(f"{r['min']:.0f}-{r['max']:.0f} (floor {r['floor_first']:.0f}->{r['floor_last']:.0f})"
                            for r in c["ranges"].values()) or "-"
        lines.append(f"{c['name']:<12}{c['wall_s']:>7.0f}{c['n_samples']:>8}{rss:>15}"
                     f"{slope if slope is not None else float('nan'):>13.1f}  {ranges}")
        lines.append(f"{'':<12}RSS slope < {SLOPE_TARGET_MB:.0f} MB per 1,000 steps "
                     f"{'met' if met['rss_slope'] else 'MISSED'}; "
                     + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in met.items() if k != "rss_slope"))
    return "\n".join(lines)

