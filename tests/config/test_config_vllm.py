"""`strategy: vllm` is checked before anything starts: installed, devices divisible, sleep only on GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import run_cli
from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.placement import plan_for_config


def _rollout(**fields: object) -> str:
    inner = ", ".join(f"{k}: {v}" for k, v in fields.items())
    return f"resources.rollout={{{inner}}}"


def test_vllm_without_vllm_installed_is_a_config_error(tmp_path, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart_vllm.yaml")
    text = str(err.value)
    assert "resources.rollout.strategy" in text and "vllm is not installed" in text and "strategy: hf" in text


def test_cli_refuses_vllm_without_vllm_before_starting(tmp_path) -> None:
    """Through the real CLI with vllm hidden: a one-line error, exit 2, no run directory."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import importlib.util, sys\n_real = importlib.util.find_spec\n"
                       "importlib.util.find_spec = lambda n, *a: None if n == 'vllm' else _real(n, *a)\n")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}:{env_path}" if env_path else str(tmp_path)
    try:
        proc = run_cli("train", "configs/quickstart_vllm.yaml", "--run-dir", str(tmp_path / "run"))
    finally:
        os.environ["PYTHONPATH"] = env_path
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "resources.rollout.strategy" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_tensor_parallel_size_must_divide_the_devices() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.vllm_args\.tensor_parallel_size.*does not divide"):
        load_config("configs/quickstart_split.yaml", overrides=[
            _rollout(device_type="cpu", device_ids="[2, 3, 4]", strategy="vllm",
                     vllm_args="{tensor_parallel_size: 2}")])


def test_tensor_parallel_engines_take_several_devices_per_process() -> None:
    cfg = load_config("configs/quickstart_split.yaml", overrides=[
        _rollout(device_type="cpu", device_ids="[2, 3, 4, 5]", strategy="vllm",
                 vllm_args="{tensor_parallel_size: 2}")])
    plan = plan_for_config(cfg)
    assert [g.size for g in plan.groups if g.name == "rollout"] == [2]  # 4 slots / TP 2 = 2 engines


def test_sleep_mode_is_refused_on_cpu() -> None:
    with pytest.raises(ConfigError, match=r"enable_sleep_mode.*GPU memory"):
        load_config("configs/quickstart_vllm.yaml", overrides=[
            _rollout(device_type="cpu", device_ids="[0]", strategy="vllm", vllm_args="{enable_sleep_mode: true}")])
