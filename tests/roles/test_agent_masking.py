"""Masking: tokens the model did not sample change nothing, whatever garbage they carry.

A hand-built multi-turn batch (model tokens with tool output inserted between them, then
padding) against the same rows with the tool tokens removed: every registered estimator gives
the same advantages on the model's tokens, and every policy loss, agg mode, KL and entropy term
gives the same loss and the same gradients, with huge fake advantages, values and KL on the
tool tokens. The batch's `model_inputs` produce exactly that mask.
"""

from __future__ import annotations

import pytest
import torch

from verl_hpc.algo import (
    ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    aggregate_loss,
    kl_penalty,
    token_level_rewards,
)
from verl_hpc.algo.losses import AGG_MODES
from verl_hpc.algo.masked import masked_mean
from verl_hpc.config.schema import AlgorithmConfig
from verl_hpc.data.rollout_batch import RolloutBatch

MODEL_LENGTHS = [5, 3, 6, 4]        # the model's tokens per row
HOLES = [(2, 3), (1, 4), (0, 0), (3, 2)]  # (after which model token, how many tool tokens)
GARBAGE = 1e6


def spread(compact: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Insert each row's tool tokens (value `fill`) and pad: (holey values, loss mask)."""
    width = max(n + h for n, (_, h) in zip(MODEL_LENGTHS, HOLES, strict=True)) + 2
    out = torch.full((compact.shape[0], width), fill, dtype=compact.dtype)
    mask = torch.zeros(compact.shape[0], width)
    for row, (n, (at, h)) in enumerate(zip(MODEL_LENGTHS, HOLES, strict=True)):
        positions = list(range(at)) + list(range(at + h, n + h))
        out[row, positions] = compact[row, :n]
        mask[row, positions] = 1.0
    return out, mask


def gather(holey: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """The model-token entries of each row, back in compact [B, width] form."""
    out = torch.zeros(holey.shape[0], width, dtype=holey.dtype)
    for row in range(holey.shape[0]):
        values = holey[row][mask[row].bool()]
        out[row, :len(values)] = values
    return out


def compact_mask() -> torch.Tensor:
    width = max(MODEL_LENGTHS)
    return (torch.arange(width)[None, :] < torch.tensor(MODEL_LENGTHS)[:, None]).float()


@pytest.fixture
def tensors():
    torch.manual_seed(0)
    width = max(MODEL_LENGTHS)
    cmask = compact_mask()
    return {"scores": torch.tensor([1.0, 0.0, 0.5, 0.25]), "groups": torch.tensor([0, 0, 1, 1]),
            "values": torch.randn(4, width) * cmask, "kl": torch.rand(4, width) * cmask, "cmask": cmask,
            "baselines": torch.tensor([0.3, 0.3, 0.1, 0.1])}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_ignores_tool_tokens(name: str, tensors) -> None:
    algo = AlgorithmConfig(adv_estimator=name)
    cmask = tensors["cmask"]
    holey_values, hmask = spread(tensors["values"], GARBAGE)
    holey_kl, _ = spread(tensors["kl"], GARBAGE)
    results = []
    for mask, values, kl in ((cmask, tensors["values"], tensors["kl"]), (hmask, holey_values, holey_kl)):
        rewards = token_level_rewards(tensors["scores"], mask, kl, 0.1)
        adv, ret = ESTIMATORS[name].compute(AdvantageInputs(
            scores=tensors["scores"], group_ids=tensors["groups"], response_mask=mask, token_rewards=rewards,
            values=values, algo=algo, baselines=tensors["baselines"]))
        results.append((adv, ret, mask))
    (c_adv, c_ret, _), (h_adv, h_ret, mask) = results
    width = cmask.shape[1]
    assert torch.allclose(gather(h_adv, mask, width).float(), c_adv.float(), atol=1e-6), name
    assert torch.allclose(gather(h_ret, mask, width).float(), c_ret.float(), atol=1e-6), name
    assert (h_adv[mask == 0] == 0).all()  # nothing reaches a tool token


def loss_terms(algo: AlgorithmConfig, loss_name: str, logprobs, old, ref, adv, entropy, mask) -> torch.Tensor:
    pg, _ = POLICY_LOSSES[loss_name].compute(logprobs, old, adv, mask, algo)
    kl = aggregate_loss(kl_penalty(logprobs, ref, "k3"), mask, algo.loss_agg_mode, algo.sampling.max_new_tokens)
    return pg + 0.1 * kl - 0.01 * masked_mean(entropy, mask)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_name", sorted(POLICY_LOSSES))
def test_losses_and_gradients_ignore_tool_tokens(mode: str, loss_name: str) -> None:
    algo = AlgorithmConfig(loss_agg_mode=mode, sampling={"max_new_tokens": 8})
    torch.manual_seed(1)
    cmask = compact_mask()
    base = {k: torch.randn(4, cmask.shape[1]) * cmask for k in ("logprobs", "old", "ref", "adv", "entropy")}
    base["logprobs"], base["old"], base["ref"] = -base["logprobs"].abs(), -base["old"].abs(), -base["ref"].abs()
    compact = {k: v.clone().requires_grad_(k in ("logprobs", "entropy")) for k, v in base.items()}
    holey = {}
    for key, value in base.items():
        filled, hmask = spread(value, GARBAGE if key == "adv" else -3.0)  # huge fake advantages on tool tokens
        holey[key] = filled.requires_grad_(key in ("logprobs", "entropy"))
    loss_c = loss_terms(algo, loss_name, *(compact[k] for k in ("logprobs", "old", "ref", "adv", "entropy")), cmask)
    loss_h = loss_terms(algo, loss_name, *(holey[k] for k in ("logprobs", "old", "ref", "adv", "entropy")), hmask)
    assert torch.allclose(loss_h, loss_c, atol=1e-6), (loss_h, loss_c)
    loss_c.backward()
    loss_h.backward()
    for key in ("logprobs", "entropy"):
        grad_h = holey[key].grad
        assert torch.allclose(gather(grad_h, hmask, cmask.shape[1]), compact[key].grad, atol=1e-7)
        assert (grad_h[hmask == 0] == 0).all()  # no gradient reaches a tool token


def test_model_inputs_carry_the_loss_mask() -> None:
    rows = [[5, 6, 7, 8, 9, 10], [11, 12]]
    masks = [[1, 1, 0, 0, 1, 1], [1, 1]]
    batch = RolloutBatch.from_generation(
        [[1, 2], [3]], rows, [[-0.1] * 6, [-0.2] * 2], group_ids=[0, 0], prompt_index=[0, 0],
        ground_truth=["a", "a"], policy_version=2,
        trajectory={"loss_mask": masks, "turn_bounds": [[0, 2, 4, 6], [0, 2]], "turn_versions": [[2, 2], [2]],
                    "trajectory": ["{}", "{}"]})
    inputs = batch.model_inputs(pad_id=0)
    assert inputs["response_mask"].tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0]]
    assert batch.model_token_counts().tolist() == [4, 2] and batch.response_lengths().tolist() == [6, 2]
    rewards = token_level_rewards(torch.tensor([1.0, 2.0]), inputs["response_mask"])
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 1.0]  # the score sits on the model's last token
