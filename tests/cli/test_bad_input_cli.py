"""Nothing silent, through the CLI as a user runs it: bad rewards, CUDA or
NCCL on a CPU machine, a vLLM build with no backend here. Each ends in one line naming the field
and the fix, leaves the user's files as they were, and leaves a run dir the fixed command reuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_cli
from tests.runtime.test_run_identity import SMALL, error_line, snapshot

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
BAD_REWARDS = {
    "nan": ("return float('nan')", "returned nan for prompt index"),
    "string": ("return 'good'", "returned str 'good', not a number"),
    "raises": ("return {}[prompt] if '+' in prompt else 1.0", "score raised KeyError"),
}


def _reward_file(folder: Path, body: str) -> Path:
    path = folder / "my_reward.py"
    path.write_text(f"def score(prompt, response, ground_truth, **kwargs):\n    {body}\n")
    path.chmod(0o644)
    return path


@pytest.mark.parametrize("kind", sorted(BAD_REWARDS))
def test_bad_reward_is_one_line_and_the_fixed_rerun_reuses_the_dir(tmp_path: Path, tiny_model_dir: Path,
                                                                   kind: str) -> None:
    body, expected = BAD_REWARDS[kind]
    reward = _reward_file(tmp_path, body)
    run_dir = tmp_path / "run"
    args = ["train", QUICKSTART, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}", *SMALL,
            "trainer.total_steps=2", f"reward.function={reward}:score"]
    user_files = snapshot(REPO / "configs")
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith("verl-hpc: error: reward.function: ") and expected in line, line
    assert "reward.on_error" in line and "Traceback" not in proc.stderr
    assert snapshot(REPO / "configs") == user_files

    _reward_file(tmp_path, "return 1.0")  # fixed: the same command continues in the same dir
    fixed = run_cli(*args)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert (run_dir / "hf_model" / "config.json").is_file()


def test_on_error_zero_trains_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    reward = _reward_file(tmp_path, BAD_REWARDS["nan"][0])
    proc = run_cli("train", QUICKSTART, "--run-dir", str(tmp_path / "run"), f"model.path={tiny_model_dir}", *SMALL,
                   "trainer.total_steps=2", f"reward.function={reward}:score", "reward.on_error=zero")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final critic/score/mean: 0.0000" in proc.stdout


needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@needs_cpu_only
@pytest.mark.parametrize(("config", "override", "field"), [
    ("quickstart.yaml", "resources.actor.device_type=cuda", "resources.actor.device_type: cuda, but this machine"),
    ("quickstart_split.yaml", "resources.device_type=cuda", "resources.actor.device_type: cuda, but this machine"),
    ("quickstart_split.yaml", "resources.comm_backend=nccl", "resources.comm_backend: nccl, but this"),
    ("quickstart.yaml", "resources.comm_backend=nccl", "resources.comm_backend: nccl, but this"),
])
def test_device_mismatch_fails_before_the_run_dir(tmp_path: Path, tiny_model_dir: Path, config: str,
                                                  override: str, field: str) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("train", str(REPO / "configs" / config), "--run-dir", str(run_dir),
                   f"model.path={tiny_model_dir}", override, "trainer.total_steps=1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    assert field in line and "(hint: " in line, line
    assert not run_dir.exists()  # so the corrected command starts clean


def test_a_vllm_build_without_a_backend_here_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A second vLLM distribution on the path (what `pip install .[vllm]` leaves on CPU) is one line."""
    pytest.importorskip("vllm")
    fake = tmp_path / "site"
    info = fake / "vllm-0.11.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.0\n")
    env = {**os.environ, "PYTHONPATH": str(fake), "TOKENIZERS_PARALLELISM": "false"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "verl_hpc", "train", str(REPO / "configs" / "quickstart_vllm.yaml"),
                           "--run-dir", str(run_dir), f"model.path={tiny_model_dir}"], cwd=REPO, env=env,
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    assert "resources.rollout.strategy: " in line and "vllm" in line and "tools/install.sh vllm" in line, line
    assert not run_dir.exists()
