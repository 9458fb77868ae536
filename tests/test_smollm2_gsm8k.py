"""A real chat model end to end (issue 15, item 5): SmolLM2-135M-Instruct built from the PyPI wheel by
tools/make_smollm2.py (cached in ~/.cache/verl-hpc/models between runs), the GSM8K-style Parquet of
examples/gsm8k in verl's layout, verl's compute_score, 2 GRPO steps with HF rollouts through the CLI."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.slow
def test_smollm2_two_grpo_steps_with_hf_rollouts(tmp_path: Path) -> None:
    model_dir = _load(REPO / "tools" / "make_smollm2.py").build()
    data = _load(REPO / "examples" / "gsm8k" / "make_data.py").write(tmp_path / "gsm8k", count=4)
    run_dir = tmp_path / "run"
    proc = run_cli("train", str(REPO / "configs" / "smollm2_gsm8k.yaml"), "--run-dir", str(run_dir),
                   f"model.path={model_dir}", f"data.train_files=[{data}]", "algorithm.sampling.max_new_tokens=8",
                   timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for step in metrics:
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "reward/extra/formatted"):
            assert math.isfinite(step[key]), (key, step)
