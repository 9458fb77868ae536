"""Partial rollouts: a split run's episodes take the trainer's newer weights between two rounds.

The rollout rank runs one step ahead (`max_staleness: 1`). Its episodes wait 0.4 s on the
environment at each of their three turns, longer than the tiny model's trainer step, so the
weights of the step being trained arrive while the next step's episodes are still in flight:
with `partial_rollouts` their later turns are sampled from those weights, each turn stamped
with its version, and the bound holds per turn.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.conftest import REPO, run_cli
from verl_hpc.config import load_config
from verl_hpc.config.errors import ConfigError
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.step.metrics import turn_versions, version_metrics

SLOW_ENV = f"{REPO / 'tests' / 'plugins' / 'agent_envs.py'}:CountdownEnv"
STEPS = 4


def write_config(tmp_path: Path, partial: bool = True, **algorithm: object) -> Path:
    cfg = {"model": {"path": str(tmp_path / "model"), "init_preset": "tiny-agent"},
           "data": {"task": {"name": "hidden_digit", "num_prompts": 32, "seed": 0}, "record_rollouts": True},
           "reward": {"function": "verl_hpc.data.trajectory:environment_score"},
           "rollout": {"multi_turn": {"enable": True, "max_assistant_turns": 3, "max_tokens_per_turn": 2,
                                      "partial_rollouts": partial,
                                      "environment": {"source": "python", "id": SLOW_ENV,
                                                      "kwargs": {"mode": "slow"}, "timeout_seconds": 10}}},
           "algorithm": {"name": "grpo", "sampling": {"n": 2, "max_new_tokens": 6}, "kl": {"coef": 0.0},
                         "max_staleness": 1, **algorithm},
           "trainer": {"total_steps": STEPS, "batch_size": 8, "seed": 0, "torch_threads": 1,
                       "save_hf_model": False},
           "resources": {"actor": {"device_ids": [0]}, "rollout": {"device_ids": [1]}, "placement": "split",
                         "timeout_seconds": 120},
           "logging": {"progress": "off"}}
    path = tmp_path / "partial.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_episodes_in_flight_take_newer_weights_and_each_turn_keeps_its_version(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("train", str(write_config(tmp_path)), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["rollout/policy_lag"] <= 1 for m in metrics)  # the bound, per turn
    assert any(m["rollout/spanning_episodes"] > 0 for m in metrics)
    spanning = 0
    for step in range(1, STEPS + 1):
        batch = RolloutBatch.from_ipc((run_dir / "rollouts" / f"step_{step:08d}_rank0000.arrow").read_bytes())
        for row_version, turns in zip(batch.column("policy_version").to_pylist(), turn_versions(batch), strict=True):
            assert turns == sorted(turns) and turns[0] == row_version  # a row's version is its first turn's
            assert step - 1 - turns[0] <= 1  # trained at version step - 1: no turn older than one version
            spanning += len(set(turns)) > 1
    assert spanning > 0  # some episode's later turns came from newer weights than its first


def test_turn_versions_give_the_oldest_turns_lag_and_the_share_of_spanning_episodes() -> None:
    out = version_metrics([[3, 3], [3, 4], [4]], policy_version=4)
    assert out == {"rollout/policy_lag": 1.0, "rollout/turn_policy_lag_mean": pytest.approx(0.6),
                   "rollout/spanning_episodes": pytest.approx(1 / 3)}
    assert version_metrics([], policy_version=2) == {}


@pytest.mark.parametrize(("override", "named"), [("algorithm.max_staleness=0", "max_staleness"),
                                                  ("resources.rollout.strategy=vllm", "strategy: hf")])
def test_partial_rollouts_are_refused_where_no_round_can_take_new_weights(tmp_path: Path, override: str,
                                                                          named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path), [override])
    assert "rollout.multi_turn.partial_rollouts" in str(err.value) and named in str(err.value)


class _Weights:
    def __init__(self, arrived: bool):
        self.is_in, self.asked = arrived, 0

    def arrived(self) -> bool:
        self.asked += 1
        return self.is_in


def _service(tmp_path: Path, arrived: bool, version_received: int, **state: object) -> SimpleNamespace:
    """What `RolloutService.between_rounds` reads, around a real config: 8 steps, validated every 4."""
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": [{"role": "user", "content": "x"}], "extra_info": {"env_seed": 0}}) + "\n")
    cfg = load_config(write_config(tmp_path), ["trainer.total_steps=8", "trainer.test_freq=4",
                                               f"data.val_files=[{val}]"])
    service = SimpleNamespace(cfg=cfg, weights=_Weights(arrived), engine=SimpleNamespace(policy_version=1),
                              stopped=False, validating=False, next_sync=2, **state)

    def receive() -> int:
        service.engine.policy_version = version_received
        return version_received

    service.receive = receive
    return service


def test_between_rounds_takes_weights_only_when_they_are_in_and_no_validation_needs_these(tmp_path: Path) -> None:
    from verl_hpc.runtime.placement.rollout_service import RolloutService
    from verl_hpc.transport.weights.bucketed import STOP_VERSION

    taken = _service(tmp_path, arrived=True, version_received=2)
    assert RolloutService.between_rounds(taken, 1) == 2 and taken.next_sync == 3
    waiting = _service(tmp_path, arrived=False, version_received=2)
    assert RolloutService.between_rounds(waiting, 1) == 1 and waiting.next_sync == 2
    held = _service(tmp_path, arrived=True, version_received=2)
    held.validating = True  # validation rows in progress: all from the weights they started with
    assert RolloutService.between_rounds(held, 1) == 1 and held.weights.asked == 0
    validated = _service(tmp_path, arrived=True, version_received=4)
    validated.next_sync = 4  # step 4 is validated: its weights are taken at the boundary, with its rows
    assert RolloutService.between_rounds(validated, 3) == 3 and validated.weights.asked == 0
    beyond = _service(tmp_path, arrived=True, version_received=7)
    beyond.next_sync = 7  # past the last step whose weights generate a batch (8 - 1 - 1): none will come
    assert RolloutService.between_rounds(beyond, 6) == 6 and beyond.weights.asked == 0
    stop = _service(tmp_path, arrived=True, version_received=STOP_VERSION)
    assert RolloutService.between_rounds(stop, 1) == 1 and stop.stopped and stop.next_sync == 2
