"""The quickstart with `algorithm.name=dapo` for 300 steps finishes and its score rises.

As the policy learns the addition task, more prompt groups score all-right and carry no
group-relative signal; DAPO's rounds then find fewer informative groups than a step needs.
That used to stop the run (at ~step 166 of 200); now such a step trains on the groups it
found (`filter_groups.on_exhausted: train`, docs/algorithms.md). Rounds are capped at 3 per
step (the preset allows 10): once the policy has learned, most steps run out, and 10 rounds
each made this one test take a quarter of CI's hour; 3 exercise the same path, more often.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli
from verl_hpc.metrics import read_jsonl_metrics

STEPS = 300


@pytest.mark.slow
def test_quickstart_with_dapo_runs_its_300_steps_and_learns(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/quickstart.yaml", "algorithm.name=dapo", f"trainer.total_steps={STEPS}",
                   "algorithm.filter_groups.max_num_gen_batches=3",
                   f"model.path={tiny_model_dir}", "trainer.save_hf_model=false", "logging.sample_every=1000",
                   "--run-dir", str(run_dir), timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    score = [r["critic/score/mean"] for r in rows]
    first, last = sum(score[:20]) / 20, sum(score[-20:]) / 20
    assert last > first + 0.3, (first, last)
    exhausted = [r for r in rows if r["filter_groups/exhausted"]]
    # every step that ran out trained on fewer groups than the 16 a full step holds, and said so
    assert all(r["filter_groups/kept_groups"] < 16 for r in exhausted)
    assert all(r["filter_groups/kept_groups"] == 16 for r in rows if not r["filter_groups/exhausted"])
