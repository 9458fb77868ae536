"""The estimator registry: what an estimator declares drives validation and the process plan,
and an estimator registered outside the package runs end to end without editing it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.algo import ESTIMATORS, AdvantageInputs, get_estimator, register_estimator
from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.placement import plan_for_config
from verl_hpc.launch.train import train
from verl_hpc.metrics import read_jsonl_metrics

PLUGIN = str(REPO / "tests" / "plugins" / "constant_estimator.py")


def test_builtin_estimators_declare_what_they_need() -> None:
    grpo, gae = get_estimator("grpo"), get_estimator("gae")
    assert (grpo.needs_critic, grpo.whole_groups, grpo.min_group_size) == (False, True, 2)
    assert (gae.needs_critic, gae.token_rewards) == (True, True)
    with pytest.raises(KeyError, match="registered: .*gae.*grpo"):
        get_estimator("nope")


def test_gae_whitening_is_the_same_over_one_rank_or_two() -> None:
    """Batch whitening as a sum reduced over ranks equals whitening the whole batch on one."""
    torch.manual_seed(0)
    mask = (torch.arange(6) < torch.randint(1, 7, (8, 1))).float()
    rewards, values = torch.randn(8, 6) * mask, torch.randn(8, 6) * mask
    algo = load_config(data={**quick_dict(Path("/unused"), 1), "model": {"path": "x", "init_preset": "tiny"}},
                       overrides=["algorithm.name=ppo"]).algorithm

    def inputs(rows: slice, reduce_sum) -> AdvantageInputs:
        return AdvantageInputs(torch.zeros(8)[rows], torch.arange(8)[rows], mask[rows], rewards[rows], values[rows],
                               algo, reduce_sum)

    whole, _ = get_estimator("gae").compute(inputs(slice(0, 8), lambda t: t))
    halves = [inputs(slice(0, 4), None), inputs(slice(4, 8), None)]
    pending: list[torch.Tensor] = []
    from verl_hpc.algo.advantages import gae_advantages
    from verl_hpc.algo.estimators.gae import whiten_over_ranks

    raw = [gae_advantages(h.token_rewards, h.values, h.response_mask, algo.gamma, algo.lam, whiten=False)[0]
           for h in halves]
    for h, adv in zip(halves, raw, strict=True):  # the other half's sums arrive through the reduction
        other = raw[1] if adv is raw[0] else raw[0]
        other_mask = halves[1].response_mask if adv is raw[0] else halves[0].response_mask

        def reduce_sum(t: torch.Tensor, other=other, other_mask=other_mask) -> torch.Tensor:
            o = other.double() * other_mask.double()
            return t + torch.stack([o.sum(), (o * o).sum(), other_mask.double().sum()])

        pending.append(whiten_over_ranks(adv, h.response_mask, reduce_sum))
    assert torch.allclose(torch.cat(pending), whole, atol=1e-6)


def test_validation_and_plan_ask_the_registry(tmp_path: Path) -> None:
    @register_estimator("test_needs_critic", needs_critic=True, min_group_size=3)
    def _critic_est(inputs: AdvantageInputs):  # pragma: no cover - never computed here
        raise AssertionError

    try:
        base = {**quick_dict(tmp_path / "m", 1), "model": {"path": str(tmp_path / "m"), "init_preset": "tiny"}}
        with pytest.raises(ConfigError, match="algorithm.sampling.n: the test_needs_critic estimator needs at least 3"):
            load_config(data=base, overrides=["algorithm.adv_estimator=test_needs_critic", "algorithm.sampling.n=2",
                                              "trainer.batch_size=8"])
        cfg = load_config(data=base, overrides=["algorithm.adv_estimator=test_needs_critic"])
        assert cfg.algorithm.needs_critic
        assert "critic" in plan_for_config(cfg).groups[0].roles
        with pytest.raises(ConfigError, match="algorithm.adv_estimator: no estimator 'nope'"):
            load_config(data=base, overrides=["algorithm.adv_estimator=nope"])
    finally:
        ESTIMATORS.pop("test_needs_critic")


@pytest.mark.slow
@pytest.mark.parametrize("devices", [[0], [0, 1]], ids=["one_process", "colocated_2"])
def test_a_plugin_estimator_runs_end_to_end(tmp_path: Path, tiny_model_dir: Path, devices: list[int]) -> None:
    data = quick_dict(tiny_model_dir, steps=2)
    data["plugins"] = [PLUGIN]
    data["algorithm"]["adv_estimator"] = "test_constant"
    data["resources"]["actor"] = {"device_ids": devices, "strategy": "fsdp" if len(devices) > 1 else "hf"}
    result = train(load_config(data=data), tmp_path / "run")
    rows = read_jsonl_metrics(result.run_dir / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["critic/advantages/mean"] == 1.0 for r in rows)  # the plugin's advantages were trained on
    assert "test_constant" in (result.run_dir / "config.yaml").read_text()


def test_every_builtin_part_has_a_docs_row() -> None:
    from verl_hpc.algo import POLICY_LOSSES

    text = (REPO / "docs" / "algorithms.md").read_text()
    builtin = [name for name, spec in ESTIMATORS.items() if spec.compute.__module__.startswith("verl_hpc.")]
    for name in [*builtin, *POLICY_LOSSES]:
        assert f"| `{name}` |" in text, f"docs/algorithms.md has no row for {name}"
