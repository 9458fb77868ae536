"""Every estimator, policy loss (value and gradient), aggregation mode and KL kind against
verl 0.9.1 from PyPI, on the same random float64 inputs, to 1e-6.

The batch is ragged the way rollouts are: rows end at EOS mid-response and are padded
after it (the padding holds random numbers, not zeros, so a leak would show), one row
has no valid token at all, and the multi-turn cases have holes in the mask where tool
output sat. verl's numbers come from a process of its own (tests/algo/verl_reference.py,
one import of verl for the whole module); ours are computed here through the registry,
exactly as the trainer calls them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.algo.verl_ref_env import verl_numbers
from verl_hpc.algo import (
    AGG_MODES,
    KL_KINDS,
    AdvantageInputs,
    aggregate_loss,
    entropy_from_logits,
    get_estimator,
    get_policy_loss,
    kl_penalty,
    value_loss,
)

B, R, V = 12, 7, 11
LENGTHS = [7, 5, 3, 1, 0, 6, 2, 7, 4, 3, 5, 1]  # EOS mid-response, padding after it, one empty row
GROUPS = [0] * 4 + [1] * 4 + [2] * 4
WITH_SINGLETON = [0] * 4 + [1] * 4 + [2] * 3 + [3]
ATOL = 1e-6
GEN = torch.Generator().manual_seed(20261204)


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=torch.float64) * scale


MASK = (torch.arange(R) < torch.tensor(LENGTHS)[:, None]).to(torch.float64)
HOLES = MASK.clone()
HOLES[0] = torch.tensor([1.0, 1, 0, 0, 1, 1, 1])  # tool output at positions 2-3
HOLES[7] = torch.tensor([1.0, 0, 1, 1, 0, 1, 1])


def _outcome(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The score on each row's last valid token, 0 elsewhere (what the reward gives)."""
    last = torch.where(mask != 0, torch.arange(R, dtype=torch.float64), -1.0).amax(dim=1)
    return torch.where(torch.arange(R) == last[:, None], scores[:, None], torch.zeros(()))


SCORES = _randn(B)
OUTCOME = _outcome(MASK, SCORES)
DENSE = OUTCOME + _randn(B, R, scale=0.1) * MASK  # a KL penalty in the reward: every token counts
DENSE_HOLES = _outcome(HOLES, SCORES) + _randn(B, R, scale=0.1) * HOLES
VALUES = _randn(B, R)
BASELINES = _randn(B)

# name -> (our estimator, verl's, rewards, mask, groups, gamma, lam, norm_adv_by_std)
ESTIMATOR_CASES: dict[str, tuple[str, str, torch.Tensor, torch.Tensor, list[int], float, float, bool]] = {
    "gae": ("gae", "gae", DENSE, MASK, GROUPS, 0.9, 0.8, True),
    "gae_holes": ("gae", "gae", DENSE_HOLES, HOLES, GROUPS, 0.95, 0.9, True),
    "grpo": ("grpo", "grpo", OUTCOME, MASK, GROUPS, 1.0, 1.0, True),
    "dr_grpo": ("grpo", "grpo", OUTCOME, MASK, GROUPS, 1.0, 1.0, False),
    "grpo_singleton": ("grpo", "grpo", OUTCOME, MASK, WITH_SINGLETON, 1.0, 1.0, True),
    "grpo_vectorized_singleton": ("grpo", "grpo_vectorized", OUTCOME, MASK, WITH_SINGLETON, 1.0, 1.0, True),
    "rloo": ("rloo", "rloo", DENSE, MASK, GROUPS, 1.0, 1.0, True),
    "rloo_singleton": ("rloo", "rloo", DENSE, MASK, WITH_SINGLETON, 1.0, 1.0, True),
    "reinforce_pp": ("reinforce_pp", "reinforce_plus_plus", DENSE, MASK, GROUPS, 0.9, 1.0, True),
    "reinforce_pp_holes": ("reinforce_pp", "reinforce_plus_plus", DENSE_HOLES, HOLES, GROUPS, 0.9, 1.0, True),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", "reinforce_plus_plus_baseline", DENSE, MASK, GROUPS,
                              1.0, 1.0, True),
    "reinforce_pp_baseline_singleton": ("reinforce_pp_baseline", "reinforce_plus_plus_baseline", DENSE, MASK,
                                        WITH_SINGLETON, 1.0, 1.0, True),
    "remax": ("remax", "remax", DENSE, MASK, GROUPS, 1.0, 1.0, True),
}
LOSS_MODES = ("vanilla", "gspo")
OLD_LOGP = -_randn(B, R).abs() - 0.5
LOGP = OLD_LOGP + _randn(B, R, scale=0.9)  # ratios from ~0.1 to ~10: both clips and the dual clip act
ADVANTAGES = _randn(B, R)  # per token (GAE-like): GSPO-token's gradient differs from plain GSPO here
LOGP[1, :2] = OLD_LOGP[1, :2] + 3.0  # ratio e^3 ~ 20 with A < 0: past a dual-clip bound of 10 too
ADVANTAGES[1, :2] = -ADVANTAGES[1, :2].abs()
VPREDS, OLD_VALUES, RETURNS = _randn(B, R), _randn(B, R), _randn(B, R)
LOGITS = _randn(B, R, V, scale=3.0)
KL_LOGP = -_randn(B, R).abs() * 3
KL_REF = KL_LOGP + _randn(B, R, scale=4.0)
KL_REF[0, :3] = KL_LOGP[0, :3] + torch.tensor([30.0, -30.0, 25.0])  # the clamps of k3
KL_WEIGHTS = _randn(B, R)
LOSS_MAT = _randn(B, R)


def _verl_estimator_case(verl_name: str, rewards: torch.Tensor, mask: torch.Tensor, groups: list[int],
                         gamma: float, lam: float, norm: bool) -> dict[str, Any]:
    index = [f"uid-{g}" for g in groups]
    kwargs: dict[str, Any] = {"token_level_rewards": rewards, "response_mask": mask}
    case: dict[str, Any] = {"kind": "estimator", "name": verl_name, "kwargs": kwargs}
    if verl_name == "gae":
        kwargs.update(values=VALUES, gamma=gamma, lam=lam)
    elif verl_name in ("grpo", "grpo_vectorized"):
        kwargs.update(index=index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm)
    elif verl_name == "remax":
        kwargs.update(reward_baselines=BASELINES)
    elif verl_name == "reinforce_plus_plus":
        case["gamma_config"] = gamma
    else:
        kwargs.update(index=index)
    return case


def _policy_case(loss_mode: str, mode: str, clip_ratio_c: float = 3.0) -> dict[str, Any]:
    return {"kind": "policy_loss", "loss_mode": loss_mode, "mode": mode, "old_log_prob": OLD_LOGP, "log_prob": LOGP,
            "advantages": ADVANTAGES, "mask": MASK, "clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": clip_ratio_c}


def all_cases() -> dict[str, dict[str, Any]]:
    cases = {f"est/{name}": _verl_estimator_case(*spec[1:]) for name, spec in ESTIMATOR_CASES.items()}
    for mode in AGG_MODES:
        cases[f"agg/{mode}"] = {"kind": "agg", "loss_mat": LOSS_MAT, "mask": MASK, "mode": mode}
        for loss_mode in LOSS_MODES:
            cases[f"pg/{loss_mode}/{mode}"] = _policy_case(loss_mode, mode)
        cases[f"vf/{mode}"] = {"kind": "value_loss", "vpreds": VPREDS, "values": OLD_VALUES, "returns": RETURNS,
                               "mask": MASK, "clip": 0.5, "mode": mode}
        cases[f"ent/{mode}"] = {"kind": "entropy", "logits": LOGITS, "mask": MASK, "mode": mode}
    cases["pg/vanilla/token-mean/c10"] = _policy_case("vanilla", "token-mean", clip_ratio_c=10.0)
    for kind in KL_KINDS:
        cases[f"kl/{kind}"] = {"kind": "kl", "kl_kind": kind, "logprob": KL_LOGP, "ref_logprob": KL_REF,
                               "weights": KL_WEIGHTS}
    return cases


@pytest.fixture(scope="module")
def verl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return verl_numbers(all_cases(), tmp_path_factory.mktemp("verl"))


def close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(ours.detach().to(torch.float64), theirs.detach().to(torch.float64), atol=ATOL,
                               rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", sorted(ESTIMATOR_CASES))
def test_estimator_matches_verl(verl: dict, name: str) -> None:
    ours_name, _, rewards, mask, groups, gamma, lam, norm = ESTIMATOR_CASES[name]
    inputs = AdvantageInputs(scores=rewards.sum(-1), group_ids=torch.tensor(groups), response_mask=mask,
                             token_rewards=rewards, values=VALUES, baselines=BASELINES,
                             algo=SimpleNamespace(gamma=gamma, lam=lam, norm_adv_by_std=norm))
    advantages, returns = get_estimator(ours_name).compute(inputs)
    theirs = verl[f"est/{name}"]
    close(advantages * mask, theirs["advantages"] * mask, f"{name} advantages")
    close(returns * mask, theirs["returns"] * mask, f"{name} returns")


def _algo(mode: str, clip_ratio_c: float = 3.0) -> SimpleNamespace:
    return SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c, loss_agg_mode=mode,
                           sampling=SimpleNamespace(max_new_tokens=R))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", LOSS_MODES)
def test_policy_loss_value_gradient_and_stats_match_verl(verl: dict, loss_mode: str, mode: str) -> None:
    _check_policy_loss(verl[f"pg/{loss_mode}/{mode}"], loss_mode, _algo(mode))


def test_dual_clip_bound_is_configurable_like_verls(verl: dict) -> None:
    _check_policy_loss(verl["pg/vanilla/token-mean/c10"], "vanilla", _algo("token-mean", clip_ratio_c=10.0))
    assert verl["pg/vanilla/token-mean/c10"]["pg_clipfrac_lower"] != verl["pg/vanilla/token-mean"]["pg_clipfrac_lower"]


def _check_policy_loss(theirs: dict[str, torch.Tensor], loss_mode: str, algo: SimpleNamespace) -> None:
    logp = LOGP.clone().requires_grad_(True)
    loss, stats = get_policy_loss(loss_mode).compute(logp, OLD_LOGP, ADVANTAGES, MASK, algo)
    loss.backward()
    what = f"{loss_mode}/{algo.loss_agg_mode}/c={algo.clip_ratio_c}"
    close(loss, theirs["loss"], f"{what} loss")
    close(logp.grad, theirs["grad"], f"{what} gradient")
    close(stats["clipfrac"], theirs["pg_clipfrac"], f"{what} pg_clipfrac")
    close(stats["clipfrac_lower"], theirs["pg_clipfrac_lower"], f"{what} pg_clipfrac_lower")
    close(stats["approx_kl"], theirs["ppo_kl"], f"{what} ppo_kl")


def test_the_dual_clip_acts_in_these_inputs(verl: dict) -> None:
    """Not vacuous: some negative-advantage tokens have ratios above 3 (and some above 10)."""
    assert float(verl["pg/vanilla/token-mean"]["pg_clipfrac_lower"]) > 0.02
    assert float(verl["pg/vanilla/token-mean/c10"]["pg_clipfrac_lower"]) > 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_matches_verl(verl: dict, mode: str) -> None:
    close(aggregate_loss(LOSS_MAT, MASK, mode, R), verl[f"agg/{mode}"]["loss"], f"agg {mode}")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_matches_verl(verl: dict, mode: str) -> None:
    vpreds = VPREDS.clone().requires_grad_(True)
    loss, stats = value_loss(vpreds, OLD_VALUES, RETURNS, MASK, 0.5, mode, R)
    loss.backward()
    theirs = verl[f"vf/{mode}"]
    close(loss, theirs["loss"], f"value loss {mode}")
    close(vpreds.grad, theirs["grad"], f"value loss gradient {mode}")
    close(stats["vf_clipfrac"], theirs["clipfrac"], f"vf_clipfrac {mode}")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_entropy_bonus_is_aggregated_like_verls(verl: dict, mode: str) -> None:
    logits = LOGITS.clone().requires_grad_(True)
    loss = aggregate_loss(entropy_from_logits(logits), MASK, mode, R)
    loss.backward()
    close(loss, verl[f"ent/{mode}"]["loss"], f"entropy {mode}")
    close(logits.grad, verl[f"ent/{mode}"]["grad"], f"entropy gradient {mode}")


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_kind_value_and_gradient_match_verl(verl: dict, kind: str) -> None:
    logp = KL_LOGP.clone().requires_grad_(True)
    kl = kl_penalty(logp, KL_REF, kind)
    (kl * KL_WEIGHTS).sum().backward()
    close(kl, verl[f"kl/{kind}"]["kl"], f"kl {kind}")
    close(logp.grad, verl[f"kl/{kind}"]["grad"], f"kl {kind} gradient")


def test_every_registered_part_is_compared() -> None:
    """A new estimator or loss mode must join this suite (or say here why verl has none)."""
    from verl_hpc.algo import ESTIMATORS, POLICY_LOSSES

    def shipped(registry: dict) -> set[str]:  # the package's own; other tests register plugins in-process
        return {name for name, spec in registry.items() if spec.compute.__module__.startswith("verl_hpc.")}

    assert {spec[0] for spec in ESTIMATOR_CASES.values()} == shipped(ESTIMATORS)
    assert set(LOSS_MODES) == shipped(POLICY_LOSSES)


def test_cases_exercise_padding_holes_and_an_empty_row() -> None:
    assert (MASK.sum(-1) == 0).any() and ((MASK.sum(-1) > 0) & (MASK.sum(-1) < R)).sum() >= 6
    assert (HOLES[:, 1:] > HOLES[:, :-1]).any()  # a mask that comes back on after a gap
