"""A real chat model end to end: SmolLM2-135M-Instruct built from the PyPI wheel by
tools/make_smollm2.py (cached in ~/.cache/verl-hpc/models between runs), the GSM8K-style Parquet of
examples/gsm8k in verl's layout, verl's compute_score, 2 GRPO steps with HF rollouts through the CLI.

Why so small: this checks that a real model runs end to end, at the cost it always had (4 short
two-step problems, 2 prompts x 2 samples); the worked example that shows learning (30 steps,
configs/smollm2_gsm8k.yaml as shipped) is measured by hand and its numbers are in docs/data.md."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests.conftest import REPO, load_module, run_cli, smollm2_dir

SMOKE = ["trainer.total_steps=2", "trainer.batch_size=4", "algorithm.sampling.n=2",  # 2 prompts x 2 samples
         "trainer.val_before_train=false"]
VLLM_ROLLOUT = ("resources.rollout={device_type: cpu, device_ids: [0], strategy: vllm, "
                "vllm_args: {dtype: float32, enforce_eager: true, kv_cache_space_gb: 1}}")


def train(tmp_path: Path, *overrides: str) -> list[dict]:
    model_dir = smollm2_dir()
    make = load_module(REPO / "examples" / "gsm8k" / "make_data.py")
    data = make.write(tmp_path / "gsm8k", count=4, steps=2)
    val = make.write(tmp_path / "gsm8k_val", count=2, steps=2)
    run_dir = tmp_path / "run"
    proc = run_cli("train", str(REPO / "configs" / "smollm2_gsm8k.yaml"), "--run-dir", str(run_dir),
                   f"model.path={model_dir}", f"data.train_files=[{data}]", f"data.val_files=[{val}]",
                   "trainer.test_freq=2", "algorithm.sampling.max_new_tokens=8", *SMOKE, *overrides, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation:    val-core/" in proc.stdout
    return [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_smollm2_two_grpo_steps_with_hf_rollouts(tmp_path: Path) -> None:
    metrics = train(tmp_path)
    assert len(metrics) == 2
    for step in metrics:
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "reward/extra/formatted"):
            assert math.isfinite(step[key]), (key, step)
    assert any(k.startswith("val-core/") and k.endswith("/reward/mean@1") for k in metrics[-1])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_smollm2_under_vllm_follows_every_update(tmp_path: Path) -> None:
    """Tied embeddings: after each in-place reload the engine's probabilities are still the trainer's."""
    metrics = train(tmp_path, VLLM_ROLLOUT, "trainer.total_steps=3", "trainer.actor_optim.lr=1e-5")
    assert len(metrics) == 3
    diffs = [step["training/rollout_probs_diff_max"] for step in metrics]
    assert all(d < 1e-2 for d in diffs), diffs
    assert all(math.isfinite(step["actor/pg_loss"]) for step in metrics)
