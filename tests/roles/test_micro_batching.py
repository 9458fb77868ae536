"""Token-budget micro-batches (`algorithm.use_dynamic_bsz`): within budget, trimmed, same gradient.

(Over FSDP with ranks whose own groups differ in number: tests/transport/test_dist_sync.py, dynamic_bsz.)
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.grad_helpers import gradients_at_the_step
from tests.roles.test_chunked_logprobs import EOS, PAD, VOCAB, inputs
from verl_hpc.config import AlgorithmConfig, load_config
from verl_hpc.config.errors import ConfigError
from verl_hpc.config.schema import OptimConfig
from verl_hpc.models.tiny import PRESETS, build_model
from verl_hpc.roles.actor import Actor, UpdatePlan
from verl_hpc.roles.critic import Critic, ValueModel
from verl_hpc.roles.forward import batched_logprobs
from verl_hpc.roles.micro_batching import (
    MicroBatchingError,
    padded_cost,
    plan_rows,
    row_lengths,
    split_to,
    take,
    token_budget_groups,
)


def test_groups_stay_within_the_budget_and_hold_every_row_once() -> None:
    prompts = [3, 9, 2, 5, 7, 1, 4, 8]
    responses = [6, 1, 8, 2, 7, 3, 5, 9]
    groups = token_budget_groups(prompts, responses, budget=30)
    assert sorted(r for g in groups for r in g) == list(range(8))
    assert all(padded_cost(g, prompts, responses) <= 30 for g in groups)
    assert all(g == sorted(g) for g in groups)
    assert token_budget_groups([20], [20], budget=30) == [[0]]  # longer than the budget: alone


def test_split_to_matches_a_count_and_refuses_what_it_cannot() -> None:
    prompts, responses = [4] * 5, [1, 2, 3, 4, 5]
    groups = split_to([[0, 1, 2, 3, 4]], 3, prompts, responses)
    assert len(groups) == 3 and sorted(r for g in groups for r in g) == list(range(5))
    with pytest.raises(MicroBatchingError, match="5 rows cannot make 6 micro-batches"):
        split_to([[0, 1, 2, 3, 4]], 6, prompts, responses)


def test_trimming_drops_only_padding_and_keeps_the_numbers() -> None:
    batch = inputs(rows=6, prompt=5, response=9)
    rows = [2, 3]
    trimmed = take(batch, rows, trim=True)
    prompts, responses = row_lengths(batch)
    width = max(prompts[r] for r in rows) + max(responses[r] for r in rows)
    assert trimmed["input_ids"].shape == (2, width)
    assert trimmed["response_mask"].shape == (2, max(responses[r] for r in rows))
    assert trimmed["attention_mask"].sum() == batch["attention_mask"][rows].sum()  # no real token lost
    model = build_model(PRESETS["tiny"], VOCAB, PAD, EOS, seed=0)
    with torch.no_grad():
        whole = batched_logprobs(model, batch, 1.0, micro_batch_size=6)
        by_tokens = batched_logprobs(model, batch, 1.0, micro_batch_size=6, token_budget=20)
    assert len(plan_rows(batch, 6, 20)) > 1
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(by_tokens[mask], whole[mask], rtol=1e-5, atol=1e-5)
    assert bool((by_tokens[~mask] == 0).all())


def _batch_for_update() -> dict[str, torch.Tensor]:
    batch = inputs(rows=8, prompt=5, response=9, seed=3)
    gen = torch.Generator().manual_seed(5)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    batch["old_logprobs"] = (torch.randn(mask.shape, generator=gen) * 0.1 - 3.0) * mask
    batch["values"] = torch.randn(mask.shape, generator=gen) * mask
    batch["returns"] = torch.randn(mask.shape, generator=gen) * mask
    return batch


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_actor_and_critic_gradients_equal_the_fixed_micro_batch_path(agg: str) -> None:
    batch = _batch_for_update()
    algo = AlgorithmConfig(loss_agg_mode=agg, entropy_coef=0.01)
    grads = {}
    for name, plan in (("fixed", UpdatePlan(8, 3, 1)), ("tokens", UpdatePlan(8, 3, 1, token_budget=30))):
        policy = build_model(PRESETS["tiny"], VOCAB, PAD, EOS, seed=0)
        actor = Actor(policy, algo, OptimConfig(lr=1e-3), total_steps=1)
        actor_grads = gradients_at_the_step(actor)
        actor.update(copy.deepcopy(batch), plan)
        backbone = build_model(PRESETS["tiny"], VOCAB, PAD, EOS, seed=0).model
        critic = Critic(ValueModel(backbone, backbone.config.hidden_size), algo, OptimConfig(lr=1e-3), 1)
        critic_grads = gradients_at_the_step(critic)
        critic.update(copy.deepcopy(batch), plan)
        assert len(actor_grads) == len(list(policy.parameters())) and critic_grads
        grads[name] = {**{f"actor.{n}": g for n, g in actor_grads.items()},
                       **{f"critic.{n}": g for n, g in critic_grads.items()}}
    assert len(plan_rows(batch, 3, 30)) != len(plan_rows(batch, 3, None))  # the cut really differs
    for key, grad in grads["fixed"].items():
        torch.testing.assert_close(grads["tokens"][key], grad, rtol=1e-4, atol=1e-5, msg=key)


def test_config_refuses_a_budget_below_one_sequence(tiny_model_dir) -> None:
    from tests.runtime.test_runtime_embedded import quick_dict

    data = quick_dict(tiny_model_dir)
    data["data"]["max_prompt_length"] = 64
    data["algorithm"].update(use_dynamic_bsz=True, max_token_len_per_gpu=50)
    data["algorithm"].setdefault("sampling", {})["max_new_tokens"] = 8
    with pytest.raises(ConfigError, match=r"algorithm.max_token_len_per_gpu.*set it to 72 or more"):
        load_config(data=data)
    data["algorithm"]["max_token_len_per_gpu"] = 72
    assert load_config(data=data).algorithm.use_dynamic_bsz
