"""ResourceConfig rules: the backend, world size and which roles may share which GPUs.

Split from tests/config/test_config.py (the loader, overrides and bad-input cases) to keep both short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_hpc import load_resource_config
from verl_hpc.config import ConfigError, ResourceConfig


def resources(tmp_path: Path, data: dict[str, Any]) -> ResourceConfig:
    path = tmp_path / f"resources-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_resource_config(path)


def gpu(ids: list[int], strategy: str) -> dict[str, Any]:
    return {"device_type": "cuda", "device_ids": ids, "strategy": strategy}


def test_backend_is_gloo_on_cpu_and_nccl_on_cuda(tmp_path: Path) -> None:
    cpu_only = resources(tmp_path, {"actor": {"device_type": "cpu", "device_ids": [0, 1]}})
    cuda_actor = resources(tmp_path, {"actor": gpu([0], "fsdp")})
    cuda_rollout_only = resources(tmp_path, {"rollout": gpu([0], "hf")})
    forced = resources(tmp_path, {"actor": gpu([0], "fsdp"), "comm_backend": "gloo"})

    assert cpu_only.resolved_backend() == "gloo"
    assert ResourceConfig().resolved_backend() == "gloo"
    assert cuda_actor.resolved_backend() == "nccl"
    assert cuda_rollout_only.resolved_backend() == "gloo"  # only trainer roles talk over the backend
    assert forced.resolved_backend() == "gloo"


@pytest.mark.parametrize("ids", [[0], [0, 1], [3, 1, 2, 0]])
def test_world_size_is_the_device_count(tmp_path: Path, ids: list[int]) -> None:
    cfg = resources(tmp_path, {"actor": {"device_type": "cpu", "device_ids": ids}})

    assert cfg.actor.world_size == len(ids)


def test_colocated_vllm_rollout_shares_gpus_with_the_actor(tmp_path: Path) -> None:
    cfg = resources(tmp_path, {"actor": gpu([0, 1], "fsdp"), "rollout": gpu([0, 1], "vllm"),
                               "placement": "colocated"})

    assert cfg.rollout.device_ids == cfg.actor.device_ids == [0, 1]


def test_split_vllm_rollout_cannot_share_gpus_with_the_actor(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resources(tmp_path, {"actor": gpu([0, 1], "fsdp"), "rollout": gpu([1, 2], "vllm"), "placement": "split"})

    assert info.value.path == "actor.device_ids"
    assert "GPU(s) [1]" in info.value.message and "vLLM rollout" in info.value.message
    assert resources(tmp_path, {"actor": gpu([0, 1], "fsdp"), "rollout": gpu([2, 3], "vllm"),
                                "placement": "split"}).placement == "split"


def test_split_hf_rollout_cannot_share_gpus_with_the_actor(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resources(tmp_path, {"actor": gpu([0], "fsdp"), "rollout": gpu([0], "hf"), "placement": "split"})

    assert info.value.path == "rollout.device_ids"


def test_colocated_does_not_let_the_reward_role_share_vllm_gpus(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resources(tmp_path, {"actor": gpu([0], "fsdp"), "rollout": gpu([0], "vllm"),
                             "reward": gpu([0], "hf"), "placement": "colocated"})

    assert info.value.path == "reward.device_ids"


def test_cpu_roles_may_share_ids_with_a_cuda_vllm_rollout(tmp_path: Path) -> None:
    cfg = resources(tmp_path, {"actor": {"device_type": "cpu", "device_ids": [0]}, "rollout": gpu([0], "vllm"),
                               "placement": "split"})

    assert cfg.actor.device_type == "cpu"


# ---------------------------------------------------------------------------------------------
# 6. Property: garbage anywhere either validates or raises a one-line ConfigError.
# ---------------------------------------------------------------------------------------------


def test_comm_env_accepts_only_communication_variables() -> None:
    from verl_hpc.config.loader import validate_section
    from verl_hpc.config.resources import ResourceConfig

    ok = validate_section(ResourceConfig, {"comm_env": {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5"}})
    assert ok.comm_env["NCCL_SOCKET_IFNAME"] == "ib0"
    with pytest.raises(ConfigError, match="comm_env"):
        validate_section(ResourceConfig, {"comm_env": {"LD_PRELOAD": "/tmp/evil.so"}})


@pytest.mark.parametrize(("overrides", "field", "hint"), [
    (["resources.env.num_workers=3", "resources.env.nodes=2"], "resources.env.num_workers", "multiple of 2"),
    (["rollout.multi_turn.environment=null", "rollout.multi_turn.tools=[verl_hpc.data.tasks.hidden_digit:peek]"],
     "resources.env", "rollout.multi_turn.environment"),
    (["rollout.multi_turn.environment.num_workers=3"], "rollout.multi_turn.environment.num_workers",
     "resources.env.num_workers")])
def test_environment_workers_are_checked_naming_the_field(overrides: list[str], field: str, hint: str) -> None:
    from verl_hpc.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(Path(__file__).resolve().parents[2] / "configs" / "slurm_env_box.yaml", overrides)
    message = str(err.value)
    assert f"{field}:" in message and hint in message, message
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "slurm_env_box.yaml", ["rollout.multi_turn.environment.num_workers=2"])
    assert cfg.resources.env.workers_per_node == 2
