"""The actor's objective, as verl's actor combines it: pg - entropy_coef * H + kl.coef * KL, the
entropy and the KL aggregated with `loss_agg_mode` like the policy loss (the entropy bonus was
always a token mean; verl 0.9.1 aggregates it with the mode)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_hpc.roles.actor import Actor, micro_weight

G = 99.0  # padding: must never count
ENTROPY = torch.tensor([[1.0, 2.0, 3.0], [4.0, G, G]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def _actor(mode: str, entropy_coef: float = 0.1, kl_coef: float = 0.5) -> SimpleNamespace:
    algo = SimpleNamespace(loss_agg_mode=mode, entropy_coef=entropy_coef, sampling=SimpleNamespace(max_new_tokens=4),
                           kl=SimpleNamespace(in_reward=False, estimator="k1", coef=kl_coef))
    return SimpleNamespace(algo=algo)


@pytest.mark.parametrize(("mode", "entropy"), [
    ("token-mean", 10 / 4),             # (1 + 2 + 3 + 4) / 4 tokens
    ("token-sum", 10.0),
    ("seq-mean-token-mean", 3.0),       # (2 + 4) / 2 sequences
    ("seq-mean-token-sum", 5.0),        # (6 + 4) / 2
    ("seq-mean-token-sum-norm", 1.25),  # (6 + 4) / 2 / 4
])
def test_entropy_bonus_is_aggregated_with_the_loss_mode(mode: str, entropy: float) -> None:
    pg = torch.tensor(0.5)
    loss, ent, kl = Actor._objective(_actor(mode), pg, torch.zeros(2, 3), ENTROPY, {"response_mask": MASK})
    assert float(ent) == pytest.approx(entropy) and float(kl) == 0.0
    assert float(loss) == pytest.approx(0.5 - 0.1 * entropy)


def test_kl_term_is_aggregated_like_the_policy_loss() -> None:
    """k1 = logp - ref = .1 .2 .3 | .4 (padding ignored); token-mean .25, times coef .5."""
    logprobs = torch.tensor([[0.1, 0.2, 0.3], [0.4, G, G]])
    micro = {"response_mask": MASK, "ref_logprobs": torch.zeros(2, 3)}
    loss, _, kl = Actor._objective(_actor("token-mean", entropy_coef=0.0), torch.tensor(0.5), logprobs, ENTROPY, micro)
    assert float(kl) == pytest.approx(0.25) and float(loss) == pytest.approx(0.5 + 0.5 * 0.25)


def test_micro_batch_weights_sum_to_the_mini_batch() -> None:
    """Two micro-batches of the rows above plus an empty row: seq modes count the rows that have a token."""
    mask = torch.cat([MASK, torch.zeros(1, 3)])
    parts = [mask[:2], mask[2:]]
    total_tokens, total_rows = mask.sum(), torch.tensor(2)
    for mode, expected in (("token-mean", [1.0, 0.0]), ("seq-mean-token-mean", [1.0, 0.0]), ("token-sum", [1.0, 1.0])):
        assert [micro_weight(p, total_tokens, total_rows, mode) for p in parts] == expected, mode
