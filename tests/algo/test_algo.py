"""Tests for verl_hpc.algo against hand-computed values (derivations in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from verl_hpc.algo import (
    aggregate_loss,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    token_level_rewards,
    value_loss,
)

SQRT3 = math.sqrt(3.0)
SQRT2 = math.sqrt(2.0)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-5) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, atol=atol, rtol=1e-5)


def with_garbage(x: torch.Tensor, mask: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Copy of ``x`` whose masked positions hold large, finite random values."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) * 1e3
    return torch.where(mask.bool(), x, noise)


# --------------------------------------------------------------------------- masked helpers


def test_masked_reductions_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, -7.0, -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    close(masked_sum(x, mask), 10.0)  # 1+2+3+4
    close(masked_mean(x, mask), 2.5)  # 10/4
    close(masked_sum(x, mask, dim=1), [6.0, 4.0])
    close(masked_mean(x, mask, dim=1), [2.0, 4.0])
    # valid values 1,2,3,4: mean 2.5, squared deviations 2.25+0.25+0.25+2.25 = 5
    close(masked_var(x, mask, unbiased=True), 5.0 / 3.0)
    close(masked_var(x, mask, unbiased=False), 5.0 / 4.0)


def test_masked_mean_empty_is_zero_and_float_mask_weights() -> None:
    x = torch.tensor([1.0, 2.0])
    close(masked_mean(x, torch.zeros(2)), 0.0)
    # weights 1 and 3: (1*1 + 2*3) / 4 = 1.75
    close(masked_mean(x, torch.tensor([1.0, 3.0])), 1.75)


def test_masked_var_single_element_is_zero() -> None:
    close(masked_var(torch.tensor([5.0, 8.0]), torch.tensor([1.0, 0.0])), 0.0)


def test_masked_whiten_by_hand() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 50.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2, unbiased var 1 -> (x - 2) / 1, masked slot zeroed
    close(masked_whiten(x, mask, eps=0.0), [-1.0, 0.0, 1.0, 0.0])
    close(masked_whiten(x, mask, shift_mean=False, eps=0.0), [1.0, 2.0, 3.0, 0.0])


# --------------------------------------------------------------------------- GRPO


def test_grpo_two_groups_of_three() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 4.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1, 1, 0]] * 3 + [[1, 0, 0]] * 3, dtype=torch.float32)
    adv, ret = grpo_advantages(scores, group_ids, mask, eps=0.0)
    # group 0: mean 2, std sqrt((1+0+1)/2) = 1 -> -1, 0, 1
    # group 1: mean 4/3, deviations -4/3, -4/3, 8/3, var (16+16+64)/9/2 = 16/3,
    #          std 4/sqrt(3) -> -1/sqrt(3), -1/sqrt(3), 2/sqrt(3)
    per_seq = torch.tensor([-1.0, 0.0, 1.0, -1 / SQRT3, -1 / SQRT3, 2 / SQRT3])
    close(adv, per_seq.unsqueeze(1) * mask)
    close(ret, adv)


def test_grpo_interleaved_noncontiguous_ids_and_singleton() -> None:
    scores = torch.tensor([1.0, 10.0, 3.0, 20.0, 5.0])
    group_ids = torch.tensor([7, 3, 7, 3, 42], dtype=torch.int64)
    mask = torch.ones(5, 2)
    adv, _ = grpo_advantages(scores, group_ids, mask, eps=0.0)
    # group 7: {1, 3} mean 2, std sqrt(2) -> -1/sqrt2, 1/sqrt2
    # group 3: {10, 20} mean 15, std sqrt(50) -> -5/sqrt50 = -1/sqrt2, 1/sqrt2
    # group 42: singleton -> mean 0, std 1 (verl's grpo): its own score, 5
    expected = torch.tensor([-1 / SQRT2, -1 / SQRT2, 1 / SQRT2, 1 / SQRT2, 5.0])
    close(adv, expected.unsqueeze(1).expand(5, 2))


def test_grpo_contiguous_non_zero_based_ids() -> None:
    adv, _ = grpo_advantages(
        torch.tensor([1.0, 3.0, 10.0, 20.0]), torch.tensor([7, 7, 3, 3]), torch.ones(4, 1), eps=0.0
    )
    close(adv[:, 0], [-1 / SQRT2, 1 / SQRT2, -1 / SQRT2, 1 / SQRT2])


def test_grpo_without_std_and_identical_scores() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1])
    adv, _ = grpo_advantages(scores, group_ids, torch.ones(5, 1), norm_by_std=False)
    close(adv[:, 0], [-1.0, 0.0, 1.0, 0.0, 0.0])
    adv_std, _ = grpo_advantages(scores, group_ids, torch.ones(5, 1))
    # identical scores: std 0, eps keeps it finite and the advantage is exactly 0
    close(adv_std[3:, 0], [0.0, 0.0])


def test_grpo_large_batch_matches_reference_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(4000, generator=gen, dtype=torch.float64)
    group_ids = torch.randint(0, 500, (4000,), generator=gen) * 13
    adv, _ = grpo_advantages(scores, group_ids, torch.ones(4000, 1, dtype=torch.float64))
    for gid in group_ids.unique()[:20]:
        sel = group_ids == gid
        group = scores[sel]
        if group.numel() > 1:
            expected = (group - group.mean()) / (group.std() + 1e-6)
            torch.testing.assert_close(adv[sel, 0], expected)


# --------------------------------------------------------------------------- token rewards


def test_token_level_rewards_by_hand() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
    kl = torch.full((3, 3), 0.5)
    plain = token_level_rewards(scores, mask)
    close(plain, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    # penalty 0.1 * 0.5 = 0.05 on every valid token
    penalised = token_level_rewards(scores, mask, kl=with_garbage(kl, mask), kl_coef=0.1)
    close(penalised, [[-0.05, 0.95, 0.0], [-0.05, -0.05, 1.95], [0.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- GAE


def test_gae_single_sequence_by_hand() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # gamma * lam = 0.72
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3,        A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03,     A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04,     A0 = 0.04 + 0.72*0.246 = 0.21712
    close(adv, [[0.21712, 0.246, 0.3]])
    # returns = A + V
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_padding_treated_as_terminal_and_whitening() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae_advantages(
        with_garbage(rewards, mask), with_garbage(values, mask), mask, gamma=0.9, lam=0.8, whiten=False
    )
    close(adv, [[0.21712, 0.246, 0.3, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0]])
    white, ret_w = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=True)
    raw = torch.tensor([0.21712, 0.246, 0.3])
    expected = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)
    close(white[0, :3], expected)
    close(white[0, 3], 0.0)
    close(ret_w, ret)  # returns are computed before whitening


def test_gae_skips_holes_in_mask() -> None:
    # A hole (e.g. tool output) between valid tokens behaves as if it were not there.
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.6, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    close(adv, [[0.21712, 0.0, 0.246, 0.3]])


# --------------------------------------------------------------------------- aggregation


RAGGED_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
RAGGED_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2
    ],
)
def test_aggregate_modes_ragged(mode: str, expected: float) -> None:
    close(aggregate_loss(RAGGED_LOSS, RAGGED_MASK, mode), expected)
    garbage = with_garbage(RAGGED_LOSS, RAGGED_MASK)
    close(aggregate_loss(garbage, RAGGED_MASK, mode), expected)


def test_aggregate_seq_modes_ignore_empty_rows() -> None:
    loss = torch.cat([RAGGED_LOSS, torch.full((1, 3), 8.0)])
    mask = torch.cat([RAGGED_MASK, torch.zeros(1, 3)])
    close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 2.75)


def test_aggregate_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-mean.*seq-mean-token-sum"):
        aggregate_loss(RAGGED_LOSS, RAGGED_MASK, "seq-sum")


# --------------------------------------------------------------------------- policy loss


def test_policy_loss_clipping_by_hand() -> None:
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(1.5), math.log(1.5), math.log(0.5), 0.0]]).requires_grad_()
    adv = torch.tensor([[-1.0, 1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4)
    loss, stats = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # tok0: r=1.5, A=-1: max(1.5, 1.2) = 1.5   unclipped branch (pessimistic), not clipped
    # tok1: r=1.5, A=+1: max(-1.5, -1.2) = -1.2 clipped
    # tok2: r=0.5, A=-1: max(0.5, 0.8) = 0.8   clipped
    # tok3: r=1.0, A=+2: -2
    close(loss, (1.5 - 1.2 + 0.8 - 2.0) / 4)
    close(stats["clipfrac"], 0.5)
    close(stats["approx_kl"], (-2 * math.log(1.5) - math.log(0.5)) / 4)
    assert not stats["clipfrac"].requires_grad and stats["approx_kl"].dim() == 0
    loss.backward()
    # d/dlogp of -A*r/4 = -A*r/4 on unclipped tokens; clipped tokens get no gradient
    close(new.grad, [[1.5 / 4, 0.0, 0.0, -2.0 / 4]])


def test_policy_loss_asymmetric_clip_high() -> None:
    new = torch.tensor([[math.log(1.5)]])
    loss, stats = policy_loss(new, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_high=0.28)
    close(loss, -1.28)
    close(stats["clipfrac"], 1.0)


def test_policy_loss_masked_positions_ignored() -> None:
    gen = torch.Generator().manual_seed(2)
    new, old, adv = (torch.randn(3, 5, generator=gen) * 0.1 for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        ref, ref_stats = policy_loss(new, old, adv, mask, agg_mode=mode)
        got, got_stats = policy_loss(
            with_garbage(new, mask, 3),
            with_garbage(old, mask, 4),
            with_garbage(adv, mask, 5),
            mask,
            agg_mode=mode,
        )
        torch.testing.assert_close(got, ref)
        for key in ref_stats:
            torch.testing.assert_close(got_stats[key], ref_stats[key])


# --------------------------------------------------------------------------- KL


def test_kl_penalty_kinds_by_hand() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    ln2 = math.log(2.0)
    close(kl_penalty(logp, ref, "k1"), [ln2])  # log 0.5 - log 0.25
    close(kl_penalty(logp, ref, "k2"), [0.5 * ln2**2])  # 0.2402265
    close(kl_penalty(logp, ref, "k3"), [0.5 + ln2 - 1.0])  # exp(-ln2) - (-ln2) - 1 = 0.1931472


def test_kl_k3_clamped_with_finite_gradient() -> None:
    logp = torch.tensor([-40.0, 0.0], requires_grad=True)
    ref = torch.tensor([-10.0, 0.0])
    k3 = kl_penalty(logp, ref, "k3")
    close(k3.detach(), [10.0, 0.0])  # exp(30) - 30 - 1 is clamped to 10; equal logps give 0
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_kl_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# --------------------------------------------------------------------------- logits


def test_entropy_uniform_and_by_hand() -> None:
    close(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7.0)))
    # logits [0, ln 3] -> p = [1/4, 3/4]; H = 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351
    close(entropy_from_logits(torch.tensor([0.0, math.log(3.0)])), 0.5623351)
    # huge logits must not overflow
    close(entropy_from_logits(torch.tensor([1000.0, 1000.0])), math.log(2.0))


def test_logprobs_from_logits_matches_log_softmax() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=gen) * 4
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    expected = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)
    # by hand: logits [0, ln 3], label 1 -> log(3/4)
    close(
        logprobs_from_logits(torch.tensor([[[0.0, math.log(3.0)]]]), torch.tensor([[1]])), [[math.log(0.75)]]
    )


# --------------------------------------------------------------------------- value loss


def test_value_loss_clipping_by_hand() -> None:
    values = torch.tensor([[1.5, 1.1, 0.0]])
    old = torch.tensor([[1.0, 1.0, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 0.5]])
    mask = torch.ones(1, 3)
    loss, stats = value_loss(values, old, returns, mask, clip_range=0.2)
    # tok0: unclipped (1.5-2)^2 = 0.25, v_clip = 1.2 -> (1.2-2)^2 = 0.64 -> 0.5*0.64 = 0.32 (clipped)
    # tok1: unclipped (1.1-0)^2 = 1.21, v_clip = 1.1 (inside range) -> 0.605 (not clipped)
    # tok2: unclipped (0-0.5)^2 = 0.25, v_clip = 0.8 -> 0.09 -> 0.5*0.25 = 0.125 (not clipped)
    close(loss, (0.32 + 0.605 + 0.125) / 3)
    close(stats["vf_clipfrac"], 1.0 / 3.0)
    loss_none, stats_none = value_loss(values, old, returns, mask, clip_range=None)
    close(loss_none, 0.5 * (0.25 + 1.21 + 0.25) / 3)
    close(stats_none["vf_clipfrac"], 0.0)


def test_value_loss_masked_positions_ignored() -> None:
    values = torch.tensor([[1.5, 1.1, 0.0]])
    old = torch.tensor([[1.0, 1.0, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 0.5]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    ref, ref_stats = value_loss(values, old, returns, mask, clip_range=0.2)
    close(ref, (0.32 + 0.125) / 2)
    got, got_stats = value_loss(
        with_garbage(values, mask, 6), with_garbage(old, mask, 7), with_garbage(returns, mask, 8), mask, 0.2
    )
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_stats["vf_clipfrac"], ref_stats["vf_clipfrac"])


# --------------------------------------------------------------------------- mask invariance


def test_masked_positions_never_affect_advantages() -> None:
    gen = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    rewards = torch.randn(3, 5, generator=gen)
    values = torch.randn(3, 5, generator=gen)
    for whiten in (False, True):
        ref = gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95, whiten=whiten)
        got = gae_advantages(
            with_garbage(rewards, mask, 9),
            with_garbage(values, mask, 10),
            mask,
            gamma=0.99,
            lam=0.95,
            whiten=whiten,
        )
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b)
            assert (a[mask == 0] == 0).all()
    scores = torch.tensor([1.0, 2.0, 3.0])
    adv, _ = grpo_advantages(scores, torch.zeros(3, dtype=torch.int64), mask)
    assert (adv[mask == 0] == 0).all()
    x = torch.randn(3, 5, generator=gen)
    torch.testing.assert_close(masked_whiten(with_garbage(x, mask, 11), mask), masked_whiten(x, mask))
    torch.testing.assert_close(masked_var(with_garbage(x, mask, 12), mask), masked_var(x, mask))


def test_a_non_finite_gradient_skips_the_step_for_actor_and_critic_alike() -> None:
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.roles.actor import Actor
    from verl_hpc.roles.critic import Critic
    from verl_hpc.roles.optimizer import OptimizedModel

    assert issubclass(Actor, OptimizedModel) and issubclass(Critic, OptimizedModel)
    role = OptimizedModel(torch.nn.Linear(3, 1), OptimConfig(lr=0.1, grad_clip=1.0), total_steps=10)
    before = role.model.weight.detach().clone()
    role.model(torch.ones(1, 3)).sum().mul(float("nan")).backward()
    assert math.isnan(role.clip_and_step())
    assert torch.equal(role.model.weight, before)  # weights untouched, optimizer state empty
    assert not role.optimizer.state
    role.model(torch.ones(1, 3)).sum().backward()
    assert math.isfinite(role.clip_and_step())
    assert not torch.equal(role.model.weight, before)
    # Stepped or skipped, no gradient outlives the step (the next generation would carry it).
    assert all(p.grad is None for p in role.model.parameters())
    restored = OptimizedModel(torch.nn.Linear(3, 1), OptimConfig(lr=0.1), total_steps=10)
    restored.load_state_dict(role.state_dict())
    assert torch.equal(restored.model.weight, role.model.weight)
