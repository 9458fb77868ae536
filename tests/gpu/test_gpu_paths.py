"""The CUDA code paths, run for real where a GPU exists (the device machine), skipped elsewhere.

Why a separate folder: CI has no GPU, so these never run there; they are what a session
runs on a lent GPU machine (`bash tools/gpu_check.sh`) to exercise what the CPU suite
cannot — CUDA tensors through the actor, the engines, the DCP checkpoint and the NCCL
world. One GPU is enough for every test here: NCCL refuses two ranks on one device, so
the multi-process case keeps its second role on CPU, which also exercises the mixed
NCCL-world / gloo-sync-group path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.e2e.test_train_e2e import scalars, window_means

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ON_GPU = ["resources.actor.device_type=cuda", "resources.actor.device_ids=[0]",
          "resources.rollout.device_type=cuda", "resources.rollout.device_ids=[0]"]

# One GPU holds one trainer rank, and a group of one rank has nothing to shard: its models run
# unsharded under autocast (runtime/placement/__init__.py: build_spec). FSDP2 on CUDA is
# exercised by tests/gpu/test_param_offload_gpu.py (a one-rank CUDA mesh).
ONE_RANK_BF16 = "computes in torch.bfloat16 (model.mixed_precision: auto, autocast)"

REWARD_PROCESS = ["resources.reward.device_type=cpu", "resources.reward.device_ids=[1]",
                  "resources.reward.strategy=none"]


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").rglob("*.log")))


def test_embedded_run_on_cuda_learns_checkpoints_and_resumes(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    common = ["--run-dir", str(run_dir), f"model.path={tiny_model_dir}", "checkpoint.interval_steps=50",
              "logging.progress=off", *ON_GPU]
    first = run_cli("train", "configs/quickstart.yaml", *common, "trainer.total_steps=300")
    assert first.returncode == 0, first.stderr[-3000:]
    series = scalars(run_dir)
    early, late = window_means(series["critic/score/mean"])
    assert late > early + 0.3, (early, late)
    assert max(series["memory/max_allocated_gb"]) > 0  # the tensors really lived on the GPU
    if torch.cuda.is_bf16_supported():  # model.mixed_precision: auto = bf16 compute, fp32 weights
        assert ONE_RANK_BF16 in _logs(run_dir)
    assert (run_dir / "checkpoints" / "step_00000300" / "manifest.json").is_file()

    # More steps is a change of the run's config (runtime/state/run_dir.py): say so, as a user would.
    resumed = run_cli("train", "configs/quickstart.yaml", *common, "trainer.total_steps=320", "--allow-config-change")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [int(row["step"]) for row in _metrics(run_dir)]
    assert steps[-20:] == list(range(301, 321)), steps[-25:]  # resumed from the CUDA checkpoint, no gap


def test_colocated_fsdp_actor_on_cuda_joins_an_nccl_world(tmp_path: Path, tiny_model_dir: Path) -> None:
    # One GPU holds one NCCL rank; the reward as its own CPU process makes it a world of 2
    # (a single process would run the embedded loop, which the first test covers).
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/quickstart_colocated.yaml", "--run-dir", str(run_dir),
                   f"model.path={tiny_model_dir}", "trainer.total_steps=200", "logging.progress=off", *ON_GPU,
                   *REWARD_PROCESS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend nccl" in _logs(run_dir)
    if torch.cuda.is_bf16_supported():
        assert ONE_RANK_BF16 in _logs(run_dir)
    series = scalars(run_dir)
    early, late = window_means(series["critic/score/mean"])
    assert late > early + 0.3, (early, late)
    assert max(series["rollout/policy_lag"]) == 0.0


def test_split_cuda_actor_syncs_weights_to_a_cpu_rollout(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/quickstart_split.yaml", "--run-dir", str(run_dir),
                   f"model.path={tiny_model_dir}", "trainer.total_steps=150", "logging.progress=off",
                   "resources.actor.device_type=cuda", "resources.actor.device_ids=[0]",
                   "resources.rollout.device_ids=[1]", "resources.reward.device_ids=[2]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend nccl" in _logs(run_dir)
    if torch.cuda.is_bf16_supported():
        assert ONE_RANK_BF16 in _logs(run_dir)
    series = scalars(run_dir)
    assert max(series["rollout/policy_lag"]) == 0.0  # every batch came from the newest CUDA weights
    assert series["actor/policy_version"][-1] >= 149
    early, late = window_means(series["critic/score/mean"])
    assert late > early + 0.2, (early, late)
