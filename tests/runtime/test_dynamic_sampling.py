"""DAPO's dynamic sampling (`algorithm.filter_groups`): all-equal groups are dropped and
counted, more rounds are generated, and the trained batch is full of informative groups,
laid out like any batch, in one process and in split placement."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import run_cli
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.config import ConfigError, load_config
from verl_hpc.data import RolloutBatch
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.runtime.step.dynamic_sampling import _ordered_batch, informative_rows


def _batch(groups: list[int], scores: list[float]) -> RolloutBatch:
    n = len(groups)
    batch = RolloutBatch.from_generation([[1]] * n, [[2]] * n, None, group_ids=groups, prompt_index=groups,
                                         ground_truth=["x"] * n, policy_version=0)
    return batch.with_columns(score=np.array(scores, np.float32))


def test_groups_with_all_equal_scores_are_dropped() -> None:
    """group 0: 1, 1 (all equal: dropped); group 1: 0, 1 (kept); group 2: 0, 0 (dropped); group 3: .5, 0 (kept)."""
    batch = _batch([0, 0, 1, 1, 2, 2, 3, 3], [1, 1, 0, 1, 0, 0, 0.5, 0])
    assert informative_rows(batch).tolist() == [2, 3, 6, 7]


def test_kept_groups_are_ordered_by_round_then_group_and_renumbered() -> None:
    """Round 0 kept groups 3 and 1, round 1 kept 0 and 2; two groups are needed -> round 0's 1 and 3."""
    round0 = _batch([3, 3, 1, 1], [0, 1, 1, 0])
    round1 = _batch([0, 0, 2, 2], [0, 1, 1, 0])
    full = _ordered_batch([(1, round1.to_ipc()), (0, round0.to_ipc())], groups=2, n=2, step=7)
    assert full.column("group_id").to_pylist() == [0, 0, 1, 1]
    assert full.column("prompt_index").to_pylist() == [1, 1, 3, 3]  # old group 1 first, then 3
    assert full.column("step").to_pylist() == [7] * 4


def test_what_dynamic_sampling_cannot_do_is_refused(tiny_model_dir: Path) -> None:
    data = quick_dict(tiny_model_dir)
    data["algorithm"].update(name="dapo", adv_estimator="reinforce_pp")
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable: dynamic sampling drops groups"):
        load_config(data=data)
    data = quick_dict(tiny_model_dir)
    data["algorithm"].update(name="dapo", max_staleness=1)
    data["resources"].update(placement="split", rollout={"device_ids": [1]})
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable: the rollout cannot run ahead"):
        load_config(data=data)
    data = quick_dict(tiny_model_dir)
    data["algorithm"]["name"] = "dapo"
    data["resources"].update(placement="split", rollout={"device_ids": [1]},
                             reward={"device_ids": [2], "strategy": "none"})
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable: a reward group"):
        load_config(data=data)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["one_process", "split"])
def test_dapo_keeps_the_batch_full_of_informative_groups(tmp_path: Path, tiny_model_dir: Path,
                                                        placement: str) -> None:
    data = quick_dict(tiny_model_dir, steps=3)
    data["algorithm"]["name"] = "dapo"
    data["data"]["record_rollouts"] = True
    if placement == "split":
        data["resources"].update(placement="split", actor={"device_ids": [0, 1], "strategy": "fsdp"},
                                 rollout={"device_ids": [2]})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    proc = run_cli("train", str(path), "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(run / "tensorboard" / "metrics.jsonl")
    assert sum(r["filter_groups/dropped_groups"] for r in rows) > 0  # the untrained policy fails whole groups
    assert all(r["filter_groups/num_gen_batches"] >= 1 for r in rows)
    groups = data["trainer"]["batch_size"] // data["algorithm"]["sampling"]["n"]
    for step in (1, 2, 3):
        files = sorted((run / "rollouts").glob(f"step_{step:08d}*"))
        trained = RolloutBatch.concat([RolloutBatch.from_ipc(f.read_bytes()) for f in files])
        assert len(trained) == data["trainer"]["batch_size"]  # the batch stays full
        assert sorted(set(trained.column("group_id").to_pylist())) == list(range(groups))
        assert len(informative_rows(trained)) == len(trained)  # every trained group is informative
