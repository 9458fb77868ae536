"""`python -m bench preemption --slurm --quick` on the local cluster: a real preemption, timed and split.

Times are not asserted (shared, noisy machines); what must hold is that the benchmark went
the whole way (preempted, checkpointed, requeued, restarted, stepped again), that every
phase it reports is a finite, non-negative number with min <= median <= max, that the
phases add up to the total it reports, and that at most one step was lost.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
PHASES = ["save_s", "requeue_call_s", "requeue_wait_s", "startup_s", "restore_s", "first_step_s"]


def test_preemption_bench_on_slurm_reports_ordered_phases_and_no_lost_work(slurm_cluster: SlurmCluster,
                                                                            tmp_path: Path) -> None:
    env = {**os.environ, "SLURM_CONF": str(slurm_cluster.conf), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "bench", "preemption", "--slurm", "--quick", "--out",
                           str(tmp_path / "out"), "--dir", str(tmp_path)], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "preemption_slurm-quick.json").read_text())
    assert result["benchmark"] == "preemption_slurm" and "skipped" not in result, result.get("skipped")
    assert "preemption (Slurm) benchmark:" in done.stdout and "steps lost, worst:" in done.stdout
    assert [case["config"] for case in result["cases"]] == ["configs/slurm_local.yaml"]  # quick: the hetjob
    for case in result["cases"]:
        for key, summary in case.items():
            if isinstance(summary, dict):
                values = (summary["min"], summary["median"], summary["max"])
                assert all(math.isfinite(v) and v >= 0 for v in values), (key, summary)
                assert summary["min"] <= summary["median"] <= summary["max"], (key, summary)
    for key, summary in result["ratios"].items():
        assert 0 < summary["min"] <= summary["median"] <= summary["max"], (key, summary)
    for sample in (s for done in result["samples"].values() for s in done):
        assert sample["steps_lost"] in (0.0, 1.0), sample
        assert sample["saved_step"] >= 4  # signalled after step 3 had closed: step 4 at the earliest
        assert math.isclose(sum(sample[p] for p in PHASES), sample["total_s"], abs_tol=1e-6), sample
        assert sample["write_s"] <= sample["save_s"]  # the write is part of signal -> committed
