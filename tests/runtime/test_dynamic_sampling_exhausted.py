"""DAPO's dynamic sampling when its rounds run out: a smaller step, a warning and a metric
(`on_exhausted: train`, the default), or verl's error (`on_exhausted: error`).

The smaller step must still lay out like a full one (data/layout.py): whole mini-batches,
or one mini-batch of all its rows, split evenly over the trainer ranks with whole groups
on each; the split run with two FSDP actor ranks checks that both ranks train the same
number of mini-batches on equal, whole-group shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.data import RolloutBatch
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.runtime.step.dynamic_sampling import informative_rows, trainable_groups

# Scores that differ within a group only for prompts 1+b= and 2+b= (2 in 5 of the quickstart's):
# a round of 8 groups holds ~3 informative ones, fewer than the 8 a step needs.
FEW_INFORMATIVE_REWARD = '''
def score(prompt, response, ground_truth, **_):
    if prompt.strip()[:1] in ("1", "2"):
        return float(len(response) % 2)
    return 1.0
'''


def test_trainable_groups_by_hand() -> None:
    # one rank, no mini-batch cut: every group found is trained
    assert trainable_groups(5, 4, 32, 1, [], True) == 5
    # mini-batch 16 rows (4 groups of 4): 9 groups -> 2 whole mini-batches (8 groups)
    assert trainable_groups(9, 4, 16, 1, [], True) == 8
    # fewer than one mini-batch, 2 ranks, whole groups: an even number of groups (3 -> 2), 1 -> none
    assert trainable_groups(3, 4, 16, 2, [], True) == 2
    assert trainable_groups(1, 4, 16, 2, [], True) == 0
    # no whole groups needed (a critic of 3 ranks beside 2 trainers): rows divisible by 2 and 3
    assert trainable_groups(5, 2, 64, 2, [3], False) == 3


def test_on_exhausted_error_is_verls_and_default_trains(tiny_model_dir: Path) -> None:
    from verl_hpc.config import load_config

    data = quick_dict(tiny_model_dir)
    data["algorithm"]["name"] = "dapo"
    assert load_config(data=data).algorithm.filter_groups.on_exhausted == "train"
    data["algorithm"]["filter_groups"] = {"on_exhausted": "error"}
    assert load_config(data=data).algorithm.filter_groups.on_exhausted == "error"


CONSTANT_REWARD = "def score(prompt, response, ground_truth, **_):\n    return 1.0\n"


def _run(tmp_path: Path, tiny_model_dir: Path, placement: str, on_exhausted: str,
         reward_code: str = FEW_INFORMATIVE_REWARD) -> tuple[object, Path]:
    reward = tmp_path / "reward_under_test.py"
    reward.write_text(reward_code)
    data = quick_dict(tiny_model_dir, steps=2)
    data["reward"] = {"function": f"{reward}:score"}
    data["algorithm"].update(name="dapo", mini_batch_size=16,
                             filter_groups={"max_num_gen_batches": 2, "on_exhausted": on_exhausted})
    data["algorithm"]["sampling"]["n"] = 4
    data["data"]["record_rollouts"] = True
    if placement == "split":
        data["resources"].update(placement="split", actor={"device_ids": [0, 1], "strategy": "fsdp"},
                                 rollout={"device_ids": [2]})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    return run_cli("train", str(path), "--run-dir", str(run)), run


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["one_process", "split"])
def test_exhausted_rounds_train_a_smaller_evenly_laid_out_step(tmp_path: Path, tiny_model_dir: Path,
                                                              placement: str) -> None:
    proc, run = _run(tmp_path, tiny_model_dir, placement, "train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(run / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["filter_groups/exhausted"] == 1.0 and r["filter_groups/kept_groups"] < 8 for r in rows)
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "training on" in logs and "on_exhausted: train" in logs
    ranks = 2 if placement == "split" else 1
    for row in rows:
        step, kept = int(row["step"]), int(row["filter_groups/kept_groups"])
        files = sorted((run / "rollouts").glob(f"step_{step:08d}*"))
        parts = [RolloutBatch.from_ipc(f.read_bytes()) for f in files]
        assert len(parts) == ranks and sum(len(p) for p in parts) == kept * 4
        # 16-row mini-batches, or one of all rows: equal shares of whole groups on every rank
        assert kept % ranks == 0 and len({len(p) for p in parts}) == 1
        for part in parts:
            groups = part.column("group_id").to_pylist()
            assert all(groups.count(g) == 4 for g in set(groups))
            assert len(informative_rows(part)) == len(part)


@pytest.mark.slow
def test_on_exhausted_error_stops_the_run_as_verl_does(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc, _ = _run(tmp_path, tiny_model_dir, "one_process", "error")
    assert proc.returncode != 0
    assert "after 2 generation rounds" in proc.stderr and "on_exhausted: train" in proc.stderr


@pytest.mark.slow
def test_no_informative_group_at_all_trains_the_last_round_as_generated(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Every group scores all 1s: nothing to keep, so the step trains on its last round (GRPO's zero
    advantages), says so, and the run goes on instead of stopping."""
    proc, run = _run(tmp_path, tiny_model_dir, "one_process", "train", CONSTANT_REWARD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(run / "tensorboard" / "metrics.jsonl")
    assert [(r["filter_groups/exhausted"], r["filter_groups/kept_groups"]) for r in rows] == [(1.0, 0.0)] * 2
    assert all(r["filter_groups/num_gen_batches"] == 2 for r in rows)
    for step in (1, 2):
        files = sorted((run / "rollouts").glob(f"step_{step:08d}*"))
        assert sum(len(RolloutBatch.from_ipc(f.read_bytes())) for f in files) == 32  # a full batch
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "training on the last round's 8 groups as generated" in logs
