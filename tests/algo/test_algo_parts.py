"""The registered estimators and losses against numbers worked out by hand (in the comments),
with ragged lengths, holes in the mask and garbage in the padding; and Dr. GRPO's
length normalisation next to the other aggregation modes on one batch."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.runtime.test_runtime_embedded import _random_batch, quick_dict, updates_at_micro_sizes
from verl_hpc.algo import AdvantageInputs, aggregate_loss, get_estimator, get_policy_loss
from verl_hpc.config import load_config

G = 9.0  # garbage in padded slots: must never reach a result


def _inputs(token_rewards: list[list[float]], lengths: list[int], groups: list[int], gamma: float = 1.0,
            mask: torch.Tensor | None = None) -> AdvantageInputs:
    width = len(token_rewards[0])
    if mask is None:
        mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).float()
    return AdvantageInputs(scores=torch.zeros(len(lengths)), group_ids=torch.tensor(groups), response_mask=mask,
                           token_rewards=torch.tensor(token_rewards), values=None,
                           algo=SimpleNamespace(gamma=gamma, norm_adv_by_std=True))


def test_rloo_is_the_reward_minus_the_mean_of_the_others() -> None:
    """Rewards are the rows' token rewards summed (a KL in the reward is part of them).

    group 7: R = 1.0, 0.0, 0.5  -> 1 - (0 + .5)/2 = .75;  0 - (1 + .5)/2 = -.75;  .5 - (1 + 0)/2 = 0
    group 2: R = 0.2, 0.6       -> .2 - .6 = -.4;  .6 - .2 = .4
    group 5: R = 0.9 (alone)    -> .9 (no other sample to compare with: baseline 0, as verl's rloo)
    """
    inputs = _inputs([[0.5, 0.0, 0.5], [0.2, G, G], [0.0, 0.0, G], [0.3, 0.3, G], [0.25, 0.25, 0.0], [0.9, G, G]],
                     lengths=[3, 1, 2, 2, 3, 1], groups=[7, 2, 7, 2, 7, 5])
    adv, returns = get_estimator("rloo").compute(inputs)
    expected = torch.tensor([[.75, .75, .75], [-.4, 0, 0], [-.75, -.75, 0], [.4, .4, 0], [0, 0, 0], [.9, 0, 0]])
    assert torch.allclose(adv.float(), expected, atol=1e-6) and torch.equal(adv, returns)
    spec = get_estimator("rloo")
    assert (spec.whole_groups, spec.min_group_size, spec.token_rewards, spec.needs_critic) == (True, 2, True, False)


def test_reinforce_pp_discounts_then_whitens_over_the_batch() -> None:
    """gamma = 0.5. Row a [0, 0, 1] -> returns 0.25, 0.5, 1.
    Row b has a hole (mask 1 0 1), rewards .2 _ -1 -> -1 at t2; the hole carries it: t0 = .2 + .5 * -1 = -.3.
    Row c [2] (length 1) -> 2.
    The six valid returns .25 .5 1 -.3 -1 2: sum 2.45, sum of squares 6.4025, so
    mean = 2.45 / 6 and unbiased var = (6.4025 - 2.45**2 / 6) / 5 = 1.0804166...
    """
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 1], [1, 0, 0]])
    inputs = _inputs([[0.0, 0.0, 1.0], [0.2, G, -1.0], [2.0, G, G]], [3, 3, 1], [0, 1, 2], gamma=0.5, mask=mask)
    adv, returns = get_estimator("reinforce_pp").compute(inputs)
    raw = torch.tensor([[0.25, 0.5, 1.0], [-0.3, 0.0, -1.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(returns, raw, atol=1e-6)
    mean, var = 2.45 / 6, (6.4025 - 2.45 ** 2 / 6) / 5
    assert abs(var - 1.0804166666) < 1e-6
    expected = torch.where(mask != 0, (raw - mean) / math.sqrt(var + 1e-8), torch.zeros_like(raw))
    assert torch.allclose(adv.double(), expected, atol=1e-6)
    # Two ranks: each whitens its rows with the other's [sum, sum of squares, count] arriving through reduce_sum.
    other = torch.tensor([2.0, 4.0, 1.0], dtype=torch.float64)  # row c alone: sum 2, squares 4, one token
    half = AdvantageInputs(inputs.scores[:2], inputs.group_ids[:2], mask[:2], inputs.token_rewards[:2], None,
                           inputs.algo, reduce_sum=lambda t: t + other)
    assert torch.allclose(get_estimator("reinforce_pp").compute(half)[0].double(), expected[:2], atol=1e-6)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens() -> None:
    """Rewards (token sums): group 0: 1.0 (len 2), 0.0 (len 1); group 1: 0.5 (len 3), 0.5 (len 1).
    Minus the group mean: +.5, -.5, 0, 0 -> on the tokens .5 .5 | -.5 | 0 0 0 | 0: seven entries,
    sum .5, squares .75: mean = .5 / 7, unbiased var = (.75 - .25 / 7) / 6.
    """
    inputs = _inputs([[-0.1, 1.1, G], [0.0, G, G], [0.2, 0.2, 0.1], [0.5, G, G]], [2, 1, 3, 1], [0, 0, 1, 1])
    adv, returns = get_estimator("reinforce_pp_baseline").compute(inputs)
    centered = torch.tensor([[.5, .5, 0], [-.5, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.float64)
    mean, var = 0.5 / 7, (0.75 - 0.25 / 7) / 6
    mask = inputs.response_mask
    expected = torch.where(mask != 0, (centered - mean) / math.sqrt(var + 1e-8), torch.zeros_like(centered))
    assert torch.allclose(adv.double(), expected, atol=1e-6) and torch.equal(adv, returns)


def _algo(**kw: object) -> SimpleNamespace:
    base = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1, "loss_agg_mode": "seq-mean-token-mean",
            "sampling": SimpleNamespace(max_new_tokens=3)}
    return SimpleNamespace(**{**base, **kw})


def test_gspo_clips_one_ratio_per_sequence() -> None:
    """Clip range 0.1 each side, seq-mean-token-mean.

    seq 1 (2 tokens, log-ratios .2 0): s = exp(.1) = 1.10517 > 1.1 with A = +1 -> clipped: -1.1 per token,
    no gradient. seq 2 (3 tokens, -.3 .1 .05): s = exp(-.05) = .951229, A = -2 -> 2s = 1.902459, inside the
    range. loss = (-1.1 + 1.902459) / 2 = .4012294. d loss / d logp_t (seq 2) = (1/2) * 2 * s / 3 = s / 3.
    clipfrac: seq 1's 2 tokens of 5; approx_kl = -(.2 + 0 - .3 + .1 + .05) / 5 = -.01.
    """
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[0.2, 0.0, 50.0], [-0.3, 0.1, 0.05]], requires_grad=True)  # 50: padding garbage
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0, 1, 0], [-2, -2, -2]])
    loss, stats = get_policy_loss("gspo").compute(logprobs, old, adv, mask, _algo())
    s2 = math.exp(-0.05)
    assert abs(float(loss.detach()) - (-1.1 + 2 * s2) / 2) < 1e-6
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0, 0], [s2 / 3] * 3]), atol=1e-6)
    assert abs(float(stats["clipfrac"]) - 0.4) < 1e-6 and abs(float(stats["approx_kl"]) + 0.01) < 1e-6


def test_dr_grpo_normalises_by_a_constant_unlike_the_other_modes() -> None:
    """Token losses 1 2 3 | 4 (1 token) | an empty row; max response length 4.

    token-mean: 10 / 4 = 2.5.  seq-mean-token-mean: (2 + 4) / 2 = 3 (the empty row left out).
    seq-mean-token-sum: (6 + 4) / 2 = 5.  seq-mean-token-sum-norm: (6/4 + 4/4) / 2 = 5/4: the empty row
    left out (as verl 0.9.1) and no row up- or down-weighted by its own length.
    """
    loss = torch.tensor([[1.0, 2, 3], [4, G, G], [7, 7, 7]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [0, 0, 0]])
    got = {mode: float(aggregate_loss(loss, mask, mode, 4)) for mode in
           ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")}
    assert got == pytest.approx({"token-mean": 2.5, "seq-mean-token-mean": 3.0, "seq-mean-token-sum": 5.0,
                                 "seq-mean-token-sum-norm": 5 / 4}, abs=1e-6)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo"])
def test_norm_mode_micro_batches_accumulate_to_the_full_batch(tiny_model_dir: Path, loss_name: str) -> None:
    """4 micro-batches of 4 give the gradient of one batch of 16 (KL term included)."""

    algorithm = {"loss_agg_mode": "seq-mean-token-sum-norm", "policy_loss": loss_name}
    cfg = load_config(data={**quick_dict(tiny_model_dir), "algorithm": algorithm})
    inputs = _random_batch(tiny_model_dir)
    inputs["old_logprobs"] = -torch.rand_like(inputs["ref_logprobs"]) * 3  # ratios != 1: the clip matters
    (s1, g1), (s2, g2) = updates_at_micro_sizes(tiny_model_dir, cfg, inputs)
    assert abs(s1["pg_loss"] - s2["pg_loss"]) < 1e-6 and abs(s1["kl_loss"] - s2["kl_loss"]) < 1e-6
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6, rtol=1e-4), name
