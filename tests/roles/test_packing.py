"""`model.remove_padding`: packed rows give the padded path's log-probs, entropies, values and gradients."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.grad_helpers import gradients_at_the_step
from verl_hpc.config import AlgorithmConfig
from verl_hpc.config.schema import OptimConfig
from verl_hpc.roles.actor import Actor, UpdatePlan
from verl_hpc.roles.critic import ValueModel
from verl_hpc.roles.forward import response_logprobs
from verl_hpc.roles.packing import first_fit_decreasing, pack


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=24))
def test_first_fit_decreasing_places_every_sequence_once_within_capacity(lengths: list[int]) -> None:
    bins = first_fit_decreasing(lengths, max(lengths))
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= max(lengths) for b in bins)
    assert bins == first_fit_decreasing(lengths, max(lengths))  # deterministic: every rank packs alike


def _batch(rows: int = 12, prompt: int = 8, resp: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses, of random lengths: a rollout micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, prompt + 1, (rows,), generator=gen)
    resp_lens = torch.randint(1, resp + 1, (rows,), generator=gen)
    attention = torch.zeros(rows, prompt + resp, dtype=torch.long)
    for i in range(rows):
        attention[i, prompt - int(prompt_lens[i]):prompt + int(resp_lens[i])] = 1
    ids = torch.randint(3, 60, (rows, prompt + resp), generator=gen) * attention
    mask = attention[:, prompt:].float()
    return {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "response_mask": mask, "advantages": torch.randn(rows, resp, generator=gen) * mask}


def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verl_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("models") / request.param, preset=request.param, seed=1)


@pytest.mark.parametrize("chunk_tokens", [0, 16])  # whole head, and the chunked one
def test_packed_logprobs_entropies_and_gradients_equal_the_padded_ones(model_dir: Path, chunk_tokens: int) -> None:
    inputs = _batch()
    packed = pack(inputs)
    assert packed is not None and packed.rows < 12  # sequences really share rows
    mask = inputs["response_mask"]
    results = []
    for remove_padding in (False, True):
        model = _model(model_dir)
        logprobs, entropy = response_logprobs(model, inputs, 0.7, with_entropy=True, chunk_tokens=chunk_tokens,
                                              remove_padding=remove_padding)
        ((logprobs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        results.append((logprobs * mask, entropy * mask, {n: p.grad for n, p in model.named_parameters()}))
    (lp_a, ent_a, grad_a), (lp_b, ent_b, grad_b) = results
    assert torch.allclose(lp_a, lp_b, atol=1e-5) and torch.allclose(ent_a, ent_b, atol=1e-5)
    for name, grad in grad_a.items():
        assert torch.allclose(grad, grad_b[name], atol=1e-5), name


def test_packed_critic_values_and_actor_update_equal_the_padded_ones(model_dir: Path) -> None:
    inputs = _batch(seed=4)
    values = []
    for remove_padding in (False, True):
        critic = ValueModel.from_pretrained(str(model_dir), seed=0)
        critic.remove_padding = remove_padding
        with torch.no_grad():
            values.append(critic(inputs) * inputs["response_mask"])
    assert torch.allclose(values[0], values[1], atol=1e-5)
    base = _model(model_dir)
    stats, grads = [], []
    for remove_padding in (False, True):
        actor = Actor(copy.deepcopy(base), AlgorithmConfig(), OptimConfig(lr=1e-2), 1, chunk_tokens=0,
                      remove_padding=remove_padding)
        # The gradients of the step (AdamW's step itself turns float noise on ~0 gradients into +-lr).
        grads.append(gradients_at_the_step(actor))
        stats.append(actor.update(inputs, UpdatePlan(12, 6, 1)))
    for key in ("pg_loss", "entropy", "grad_norm"):
        assert stats[1][key] == pytest.approx(stats[0][key], abs=1e-5), key
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-5), name


def test_rows_that_do_not_pack_keep_the_padded_layout() -> None:
    full = {"input_ids": torch.ones(3, 6, dtype=torch.long), "attention_mask": torch.ones(3, 6, dtype=torch.long),
            "response_mask": torch.ones(3, 2)}
    assert pack(full) is None  # nothing to remove
    gap = {**full, "attention_mask": torch.tensor([[1, 0, 1, 1, 1, 1]] * 3)}
    assert pack(gap) is None  # real tokens with a hole: not a rollout layout, left alone
