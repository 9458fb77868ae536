"""`python -m bench preemption --slurm` without Slurm: a clean skip that says why, not a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_slurm_preemption_bench_skips_without_slurm(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "VERL_HPC_SLURM_CONF")}
    env["PATH"] = str(tmp_path / "no-slurm-here")  # no sbatch: the bench must not try to start a cluster
    done = subprocess.run([sys.executable, "-m", "bench", "preemption", "--slurm", "--out", str(tmp_path),
                           "--dir", str(tmp_path)],
                          cwd=REPO, env=env, text=True, capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "preemption_slurm.json").read_text())
    assert "sbatch" in result["skipped"]
    assert f"skipped: {result['skipped']}" in done.stdout
    assert not list(tmp_path.glob("verl_hpc_bench_*"))  # nothing left behind


def test_slurm_flag_belongs_to_the_preemption_bench_only() -> None:
    done = subprocess.run([sys.executable, "-m", "bench", "checkpoint", "--slurm"], cwd=REPO, text=True,
                          capture_output=True, timeout=120, check=False)
    assert done.returncode == 2 and "--slurm goes with the preemption benchmark only" in done.stderr
