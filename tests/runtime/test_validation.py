"""Validation on held-out prompts: verl's `val-core/<data_source>/reward/mean@N`, before, during and after."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.config import ConfigError, load_config
from verl_hpc.metrics import read_jsonl_metrics

KEY = "val-core/arith/reward/mean@1"


def val_file(tmp_path: Path) -> Path:
    """Held-out sums in verl's layout (a data_source column names the metric)."""
    rows = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b), "data_source": "arith"}
            for a in range(5) for b in range(5)]
    out = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def config(model: Path, val: Path, steps: int = 4) -> dict:
    data = quick_dict(model, steps=steps)
    data["data"]["val_files"] = [str(val)]
    data["trainer"].update(test_freq=2, val_before_train=True)
    return data


# Where validation generates and scores: the trainers' engines (one process, colocated), the
# rollout group with the reward beside it (split), the rollout group 2 steps ahead with the
# reward in a group of its own, which serves one exchange more for each validated step.
PLACEMENTS = {
    "one_process": {"actor": {"device_ids": [0], "strategy": "hf"}},
    "colocated_2": {"actor": {"device_ids": [0, 1], "strategy": "fsdp"}},
    "split_1_1": {"actor": {"device_ids": [0], "strategy": "hf"}, "rollout": {"device_ids": [1]},
                  "placement": "split"},
    "split_reward_group_ahead": {"actor": {"device_ids": [0, 1], "strategy": "fsdp"},
                                 "rollout": {"device_ids": [2, 3]}, "reward": {"device_ids": [4], "strategy": "none"},
                                 "placement": "split"},
}


def placed(data: dict, name: str) -> dict:
    data["resources"].update(PLACEMENTS[name])
    if name == "split_reward_group_ahead":
        data["algorithm"]["max_staleness"] = 2
    return data


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_validation_before_during_and_after(tmp_path: Path, tiny_model_dir: Path, name: str) -> None:
    import yaml

    data = placed(config(tiny_model_dir, val_file(tmp_path), steps=5), name)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run_cli("train", str(path), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(tmp_path / "run" / "tensorboard" / "metrics.jsonl")
    validated = {r["step"]: r[KEY] for r in rows if KEY in r}
    assert sorted(validated) == [0, 2, 4, 5]  # before training, every test_freq steps, after the last
    assert all(0.0 <= v <= 1.0 for v in validated.values())
    assert f"validation:    {KEY}" in proc.stdout  # the end-of-run summary


@pytest.mark.slow
def test_greedy_validation_is_the_same_on_one_process_and_two(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Before training every placement holds the same weights: greedy validation must agree exactly."""
    from verl_hpc.launch.train import train

    val = val_file(tmp_path)
    results = []
    for name in PLACEMENTS:
        data = placed(config(tiny_model_dir, val, steps=1), name)
        run_dir = tmp_path / name
        train(load_config(data=data), run_dir)
        results.append(read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")[0])
    assert [r["step"] for r in results] == [0] * len(PLACEMENTS)
    assert len({r[KEY] for r in results}) == 1, results


def test_validation_needs_readable_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = quick_dict(tiny_model_dir)
    data["trainer"]["test_freq"] = 5
    with pytest.raises(ConfigError, match="trainer.test_freq: validation needs prompts"):
        load_config(data=data)
    for name in PLACEMENTS:  # every placement validates
        load_config(data=placed(config(tiny_model_dir, val_file(tmp_path)), name))
    data = config(tiny_model_dir, tmp_path / "missing.parquet")
    with pytest.raises(ConfigError, match=r"data.val_files\[0\]: .* does not exist"):
        load_config(data=data)


@pytest.mark.slow
def test_fewer_validation_prompts_than_trainer_ranks(tmp_path: Path, tiny_model_dir: Path) -> None:
    """One held-out prompt, two trainer ranks: the producer sends it to rank 0, rank 1 validates nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    val = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+2=", "ground_truth": "3", "data_source": "arith"}]), val)
    proc = run_cli("train", "configs/quickstart_split.yaml", "--run-dir", str(tmp_path / "run"),
                   f"model.path={tiny_model_dir}", "trainer.total_steps=2", "logging.progress=off",
                   f"data.val_files=[{val}]", "trainer.test_freq=2", "trainer.val_before_train=true",
                   "trainer.save_hf_model=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(tmp_path / "run" / "tensorboard" / "metrics.jsonl")
    assert any("val-core/arith/reward/mean@1" in r for r in rows)
