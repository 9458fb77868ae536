"""`algorithm.name` presets: each fills only the fields the user left out,
`config show` prints the expansion, and each trains two steps in one process with its
estimator's or loss's signature in what it trained on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest

from tests.conftest import REPO
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.presets import PRESETS
from verl_hpc.config.schema import AlgorithmConfig
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.launch.train import train
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.roles.rollout.replay import record_file


def _base(tmp_path: Path, **algorithm: Any) -> dict:
    data = {**quick_dict(tmp_path / "m", 1), "model": {"path": str(tmp_path / "m"), "init_preset": "tiny"}}
    data["algorithm"] = algorithm
    return data


def test_every_preset_name_is_in_the_table_and_the_schema() -> None:
    names = set(get_args(AlgorithmConfig.model_fields["name"].annotation))
    assert names == set(PRESETS) >= {"grpo", "ppo", "dr_grpo", "dapo", "rloo", "reinforce_pp",
                                     "reinforce_pp_baseline", "gspo", "remax"}


@pytest.mark.parametrize(("name", "expected"), [
    ("grpo", {"adv_estimator": "grpo", "policy_loss": "vanilla", "loss_agg_mode": "token-mean"}),
    ("ppo", {"adv_estimator": "gae", "policy_loss": "vanilla"}),
    ("dr_grpo", {"adv_estimator": "grpo", "norm_adv_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"}),
    ("rloo", {"adv_estimator": "rloo", "kl.in_reward": True, "kl.estimator": "k1"}),
    ("reinforce_pp", {"adv_estimator": "reinforce_pp", "kl.in_reward": True, "kl.estimator": "k1"}),
    ("reinforce_pp_baseline", {"adv_estimator": "reinforce_pp_baseline", "kl.in_reward": True}),
    ("gspo", {"policy_loss": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
              "loss_agg_mode": "seq-mean-token-mean"}),
    ("dapo", {"adv_estimator": "grpo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean",
              "filter_groups.enable": True, "kl.coef": 0.0}),
    ("remax", {"adv_estimator": "remax", "kl.in_reward": True, "kl.estimator": "k1"}),
])
def test_a_preset_expands_to_its_building_blocks(tmp_path: Path, name: str, expected: dict[str, Any]) -> None:
    algo = load_config(data=_base(tmp_path, name=name)).algorithm.model_dump()
    got = {key: algo[key.split(".")[0]][key.split(".")[1]] if "." in key else algo[key] for key in expected}
    assert got == expected


def test_fields_the_user_sets_win_over_the_preset(tmp_path: Path) -> None:
    algo = load_config(data=_base(tmp_path, name="gspo", clip_ratio_low=0.2, loss_agg_mode="token-mean")).algorithm
    assert (algo.clip_ratio_low, algo.clip_ratio_high, algo.loss_agg_mode) == (0.2, 4e-4, "token-mean")
    algo = load_config(data=_base(tmp_path, name="rloo", kl={"estimator": "k3"})).algorithm
    assert (algo.kl.estimator, algo.kl.in_reward) == ("k3", True)
    # A KL the user turns off is no KL at all, not a refused in-reward penalty.
    algo = load_config(data=_base(tmp_path, name="reinforce_pp", kl={"coef": 0})).algorithm
    assert (algo.kl.in_reward, algo.needs_ref) == (False, False)
    cfg = load_config(data=_base(tmp_path, name="dr_grpo"), overrides=["algorithm.norm_adv_by_std=true"])
    assert cfg.algorithm.norm_adv_by_std and cfg.algorithm.loss_agg_mode == "seq-mean-token-sum-norm"


def test_bad_names_and_combinations_fail_in_one_line_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^algorithm\.name: .*'dr_grpo'") as err:
        load_config(data=_base(tmp_path, name="dpo_typo"))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^algorithm\.sampling\.n: the rloo estimator needs at least 2"):
        load_config(data=_base(tmp_path, name="rloo", sampling={"n": 1}), overrides=["trainer.batch_size=8"])
    with pytest.raises(ConfigError, match=r"^algorithm\.kl\.in_reward: .*the grpo estimator"):
        load_config(data=_base(tmp_path, name="gspo", kl={"in_reward": True}))
    with pytest.raises(ConfigError, match=r"^algorithm\.loss_agg_mode"):
        load_config(data=_base(tmp_path, loss_agg_mode="seq-sum"))


def test_config_show_prints_the_expansion(tmp_path: Path) -> None:
    """`verl-hpc config show` dumps the resolved config: the preset's fields appear written out."""
    import yaml

    out = subprocess.run([sys.executable, "-m", "verl_hpc", "config", "show", "configs/quickstart.yaml",
                          "algorithm.name=gspo", f"model.path={tmp_path / 'm'}"], cwd=REPO, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    algo = yaml.safe_load(out.stdout)["algorithm"]
    assert (algo["policy_loss"], algo["clip_ratio_low"], algo["loss_agg_mode"]) == ("gspo", 3e-4, "seq-mean-token-mean")


def test_the_preset_table_imports_without_torch() -> None:
    code = "import sys, verl_hpc.config.presets; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr


def length_score(prompt: str, response: str, **_: object) -> float:
    """A reward that differs within a group from the first step (the arithmetic score is ~0 at first)."""
    return len(response) % 3 / 2


def _rows(run_dir: Path, step: int) -> list[dict[str, Any]]:
    batch = RolloutBatch.from_ipc(record_file(run_dir, step, 0).read_bytes())
    cols = {name: batch.column(name).to_pylist() for name in ("group_id", "score", "advantages", "returns")}
    return [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]


def _run(tmp_path: Path, model_dir: Path, name: str, **algorithm: Any) -> tuple[list[dict], list[dict]]:
    data = quick_dict(model_dir, steps=2)
    data["trainer"]["batch_size"] = 16
    data["data"]["record_rollouts"] = True
    data["reward"] = {"function": f"{__name__}:length_score"}
    data["algorithm"].update(name=name, **algorithm)
    data["algorithm"]["sampling"]["n"] = 4
    result = train(load_config(data=data), tmp_path / name)
    metrics = read_jsonl_metrics(result.run_dir / "tensorboard" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    return metrics, _rows(result.run_dir, 2)


def _groups(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(row["group_id"], []).append(row)
    return out


def _whitened(rows: list[dict]) -> tuple[float, float]:
    tokens = [a for row in rows for a in row["advantages"]]
    mean = sum(tokens) / len(tokens)
    return mean, sum((a - mean) ** 2 for a in tokens) / (len(tokens) - 1)


@pytest.mark.slow
def test_presets_train_with_their_signature(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two steps each (batch 16, n 4), one process; ~2 s a run on an idle CPU."""
    metrics, rows = _run(tmp_path, tiny_model_dir, "rloo")
    for group in _groups(rows).values():  # leave-one-out advantages sum to 0 in every group
        assert abs(sum(r["advantages"][0] for r in group)) < 1e-5
    assert metrics[-1]["actor/kl_loss"] == 0.0  # the KL is in the reward, not the loss
    assert metrics[-1]["critic/rewards/mean"] < metrics[-1]["critic/score/mean"]

    metrics, rows = _run(tmp_path, tiny_model_dir, "dr_grpo")
    for group in _groups(rows).values():  # score minus the group mean, not divided by the std
        mean = sum(r["score"] for r in group) / len(group)
        assert all(abs(r["advantages"][0] - (r["score"] - mean)) < 1e-5 for r in group)

    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        metrics, rows = _run(tmp_path, tiny_model_dir, name)
        mean, var = _whitened(rows)  # the step's one rank holds the whole batch: whitened over it
        assert abs(mean) < 1e-5 and abs(var - 1) < 1e-4, name
        same = all(r["advantages"] == r["returns"] for r in rows)
        assert same == (name == "reinforce_pp_baseline"), name  # reinforce_pp keeps raw returns for the record

    metrics, _ = _run(tmp_path, tiny_model_dir, "gspo", mini_batch_size=8)
    # The second mini-batch's sequence ratios have moved by more than the 3e-4 / 4e-4 clip range.
    assert max(m["actor/pg_clipfrac"] for m in metrics) > 0
