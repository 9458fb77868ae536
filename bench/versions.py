"""This tree against an earlier revision, in one sitting: `bench step` and `bench step_overlap`, alternated.

Why: a rewrite of the loop (issue 13) must not make the step slower. Both trees run the
same benchmark code paths on the same machine, interleaved (base, new, base, new, ...),
and what is compared is each run's own ratio to the floor it measured in the same
process — so load drifting during the sitting moves both sides alike. The base revision
is checked out into a scratch git worktree (`BENCH_BASE_REV`, default the main this
wave started from) and run with its own package on PYTHONPATH.

    python -m bench versions            # 3 alternations; step_overlap over 12-step split runs
    BENCH_VERSIONS_REPS=6 BENCH_VERSIONS_OVERLAP_STEPS=20 python -m bench versions
    BENCH_BASE_REV=<rev> python -m bench versions --quick
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BASE_REV = os.environ.get("BENCH_BASE_REV", "9df6ccd")
# (benchmark, the ratio it reports that measures the step; higher is better when `higher`)
MEASURES = {"step": ("verl_hpc_vs_floor_tiny", False), "step_overlap": ("throughput_overlapped_vs_floor_tiny", True)}
# Without --quick the overlapped step is compared as seconds per step (lower is better).
LONG_MEASURES = {**MEASURES, "step_overlap": ("split max_staleness 1 s/step", False)}


# The quick step_overlap (one split run of 3 timed steps) spread 0.85-1.99 over three
# repetitions, and its floor, measured in another process, alone varies by +-30% from one
# process to the next (1 Dec): too noisy to tell a 10% change. So the overlapped step is
# compared directly: each tree's own split run (`bench.step._split_run`, the same in both)
# of this many timed steps, alternated base/new, its median `timing_s/step`; the
# alternation is what cancels the load's drift.
OVERLAP_STEPS = int(os.environ.get("BENCH_VERSIONS_OVERLAP_STEPS", "12"))
REPS = int(os.environ.get("BENCH_VERSIONS_REPS", "3"))
_OVERLAP_DRIVER = """
import json, statistics, sys
from pathlib import Path
from bench.step import _split_run
from verl_hpc.models.tiny import init_model
model = Path.home() / ".cache" / "verl-hpc" / "models" / "tiny-seed0"
init_model(model, preset="tiny", seed=0)
steps = _split_run("tiny", model, int(sys.argv[1]) + 2, Path(sys.argv[2]) / "run")
print("STEP_S", json.dumps(statistics.median(steps[2:])))
"""


def _run_bench(tree: Path, name: str, scratch: Path, quick: bool = True) -> float:
    """One run of benchmark `name` in `tree` (quick, or the longer overlap run); its median ratio."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    if name == "step_overlap" and not quick:
        work = Path(tempfile.mkdtemp(prefix=f"overlap-{tree.name}-", dir=scratch))
        proc = subprocess.run([sys.executable, "-c", _OVERLAP_DRIVER, str(OVERLAP_STEPS), str(work)], cwd=tree,
                              env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"step_overlap in {tree} failed: {proc.stderr[-2000:]}")
        return float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("STEP_S")))
    out = scratch / f"results-{tree.name}"
    proc = subprocess.run([sys.executable, "-m", "bench", name, "--quick", "--dir", str(scratch), "--out", str(out)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench {name} in {tree} failed: {proc.stderr[-2000:]}")
    result = json.loads((out / f"{name}-quick.json").read_text())
    return float(result["ratios"][MEASURES[name][0]]["median"])


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(where), rev], check=True)
    return where


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    reps = 1 if quick else REPS
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_versions_", dir=scratch))
    base = _worktree(BASE_REV, work / "base")
    rows: dict[str, dict[str, list[float]]] = {name: {"base": [], "new": []} for name in MEASURES}
    try:
        for _ in range(reps):
            for name in MEASURES:
                rows[name]["base"].append(_run_bench(base, name, work, quick))
                rows[name]["new"].append(_run_bench(REPO, name, work, quick))
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    ratios = {}
    measures = MEASURES if quick else LONG_MEASURES
    for name, (_measure, higher_is_better) in measures.items():
        pairs = zip(rows[name]["new"], rows[name]["base"], strict=True)
        # > 1 means the new tree is better: faster step (lower vs floor) or more throughput (higher)
        gains = [n / b if higher_is_better else b / n for n, b in pairs]
        ratios[f"{name}_new_vs_base"] = {"median": statistics.median(gains), "min": min(gains), "max": max(gains)}
    return {"base_rev": BASE_REV, "measures": {k: v[0] for k, v in measures.items()}, "raw": rows, "ratios": ratios,
            "overlap_steps": None if quick else OVERLAP_STEPS, "reps": reps}


def table(result: dict[str, Any]) -> str:
    overlap = f", step_overlap over {result['overlap_steps']} steps" if result.get("overlap_steps") else ""
    lines = [f"this tree vs {result['base_rev']} ({result.get('reps', '?')} alternations of the quick step "
             f"benchmarks{overlap}; > 1 = this tree better)"]
    for name, measure in result["measures"].items():
        raw = result["raw"][name]
        r = result["ratios"][f"{name}_new_vs_base"]
        lines.append(f"  {name:<13} {measure}: base {statistics.median(raw['base']):.3f}  new "
                     f"{statistics.median(raw['new']):.3f}  ->  {r['median']:.3f}x ({r['min']:.3f}-{r['max']:.3f})")
    return "\n".join(lines)
