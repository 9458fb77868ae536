"""Tests for the Hugging Face rollout engine on a tiny random model (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from verl_hpc.config import SamplingConfig
from verl_hpc.data import RolloutBatch
from verl_hpc.models.tiny import init_model
from verl_hpc.roles.forward import response_logprobs
from verl_hpc.roles.rollout import HFRolloutEngine

TEXTS = ["1+2=", "12+5=", "what is 3+4=", "9+9=", "the sum of 45 and 54 is", "0+0="]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = init_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer = tiny
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert len({len(p) for p in ids}) > 2  # ragged: generation must left-pad
    return ids


def to_batch(prompt_ids, generation, policy_version=0) -> RolloutBatch:
    n = len(prompt_ids)
    return RolloutBatch.from_generation(prompt_ids, generation.response_ids, generation.logprobs,
                                        group_ids=list(range(n)), prompt_index=list(range(n)),
                                        ground_truth=[None] * n, policy_version=policy_version)


def test_generate_shapes_and_eos(tiny, prompts):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    assert engine.policy_version == 0
    torch.manual_seed(0)
    gen = engine.generate(prompts, SamplingConfig(n=1, max_new_tokens=5))
    assert len(gen.response_ids) == len(gen.logprobs) == len(prompts)
    for tokens, logprobs in zip(gen.response_ids, gen.logprobs, strict=True):
        assert 1 <= len(tokens) <= 5
        assert len(logprobs) == len(tokens)
        assert all(0 <= t < len(tokenizer) for t in tokens)
        assert all(lp <= 0.0 and lp > -float("inf") for lp in logprobs)
        if tokenizer.eos_token_id in tokens:
            assert tokens.index(tokenizer.eos_token_id) == len(tokens) - 1
        else:
            assert len(tokens) == 5
    assert not model.training


def test_generate_cuts_after_first_eos(tiny, prompts):
    """Force EOS at step 3 on even rows and forbid it on odd rows: lengths are exactly 3 and 5."""
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    steps = []

    def force_eos(module, args, output):
        step = len(steps)
        steps.append(step)
        out = output.clone()
        out[:, -1, eos] = -1e4
        if step == 2:
            out[0::2, -1, eos] = 1e4
        return out

    handle = model.lm_head.register_forward_hook(force_eos)
    try:
        torch.manual_seed(1)
        gen = HFRolloutEngine(model, tokenizer).generate(prompts, SamplingConfig(n=1, max_new_tokens=5))
    finally:
        handle.remove()
    for row, (tokens, logprobs) in enumerate(zip(gen.response_ids, gen.logprobs, strict=True)):
        if row % 2 == 0:
            assert len(tokens) == 3 and tokens[-1] == eos
            assert logprobs[-1] == pytest.approx(0.0, abs=1e-6)  # EOS was certain
        else:
            assert len(tokens) == 5 and eos not in tokens
        assert len(logprobs) == len(tokens)


def test_generate_cuts_after_stop_string(tiny, prompts):
    """Even rows emit "=" at step 2 and stop there; HF's pad filler after it must not be returned."""
    model, tokenizer = tiny
    equals = tokenizer("=")["input_ids"]
    assert len(equals) == 1
    # tokens that would end a row early if sampled: anything spelling "=", EOS, and pad
    banned = [i for i in range(len(tokenizer)) if "=" in tokenizer.decode([i])]
    banned += [tokenizer.eos_token_id, tokenizer.pad_token_id]
    steps = []

    def force_equals(module, args, output):
        step = len(steps)
        steps.append(step)
        out = output.clone()
        out[:, -1, banned] = -1e4
        if step == 1:
            out[0::2, -1, equals[0]] = 1e4
        return out

    handle = model.lm_head.register_forward_hook(force_equals)
    try:
        torch.manual_seed(2)
        gen = HFRolloutEngine(model, tokenizer).generate(
            prompts, SamplingConfig(n=1, max_new_tokens=5, stop=["="]))
    finally:
        handle.remove()
    for row, (tokens, logprobs) in enumerate(zip(gen.response_ids, gen.logprobs, strict=True)):
        assert len(logprobs) == len(tokens)
        assert tokenizer.pad_token_id not in tokens
        if row % 2 == 0:
            assert tokens[-1] == equals[0] and len(tokens) == 2
            assert tokenizer.decode(tokens).endswith("=")
            assert logprobs[-1] == pytest.approx(0.0, abs=1e-6)
        else:
            assert len(tokens) == 5 and "=" not in tokenizer.decode(tokens)
        assert all(lp > -100.0 for lp in logprobs)  # no logprob of a banned (never sampled) token


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_trainer_forward(tiny, prompts, temperature):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    many = prompts + prompts[::-1]  # 12 rows, ragged on both sides
    torch.manual_seed(2)
    gen = engine.generate(many, SamplingConfig(n=1, max_new_tokens=8, temperature=temperature))
    batch = to_batch(many, gen)
    inputs = batch.model_inputs(tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = response_logprobs(model, inputs, temperature)
    width = inputs["response_mask"].shape[1]
    rollout = batch.token_tensor("rollout_logprobs", width)
    mask = inputs["response_mask"].bool()
    assert recomputed.shape == rollout.shape == mask.shape
    assert int(mask.sum()) == sum(len(r) for r in gen.response_ids)
    diff = (recomputed[mask] - rollout[mask]).abs().max().item()
    assert diff < 1e-4


def test_temperature_changes_logprobs(tiny, prompts):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    torch.manual_seed(3)
    gen = engine.generate(prompts, SamplingConfig(n=1, max_new_tokens=4))
    batch = to_batch(prompts, gen)
    inputs = batch.model_inputs(tokenizer.pad_token_id)
    with torch.no_grad():
        at_one, _ = response_logprobs(model, inputs, 1.0)
        at_half, _ = response_logprobs(model, inputs, 0.5)
    mask = inputs["response_mask"].bool()
    assert (at_one[mask] - at_half[mask]).abs().max().item() > 1e-3


def test_load_weights_into_a_separate_copy(tiny, prompts):
    model, tokenizer = tiny
    engine = HFRolloutEngine(copy.deepcopy(model), tokenizer)
    gen_seed = torch.Generator().manual_seed(4)
    new = {name: torch.randn(p.shape, generator=gen_seed) * 0.05 for name, p in model.named_parameters()}
    original = {name: p.detach().clone() for name, p in model.named_parameters()}

    engine.load_weights(new.items(), version=7)

    assert engine.policy_version == 7
    loaded = dict(engine.model.named_parameters())
    assert set(loaded) == set(new)
    for name, tensor in new.items():
        assert torch.equal(loaded[name].detach(), tensor), name
    for name, p in model.named_parameters():  # the source model is untouched
        assert torch.equal(p.detach(), original[name]), name
    # The engine samples from (and scores with) the new weights.
    torch.manual_seed(5)
    gen = engine.generate(prompts, SamplingConfig(n=1, max_new_tokens=4))
    inputs = to_batch(prompts, gen).model_inputs(tokenizer.pad_token_id)
    mask = inputs["response_mask"].bool()
    with torch.no_grad():
        under_new, _ = response_logprobs(engine.model, inputs, 1.0)
        under_old, _ = response_logprobs(model, inputs, 1.0)
    rollout = to_batch(prompts, gen).token_tensor("rollout_logprobs", mask.shape[1])
    assert (under_new[mask] - rollout[mask]).abs().max().item() < 1e-4
    assert (under_old[mask] - rollout[mask]).abs().max().item() > 1e-2


def test_generation_deterministic_under_seed(tiny, prompts):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    sampling = SamplingConfig(n=1, max_new_tokens=6, temperature=0.9)
    torch.manual_seed(0)
    first = engine.generate(prompts, sampling)
    torch.manual_seed(0)
    second = engine.generate(prompts, sampling)
    assert first.response_ids == second.response_ids
    assert first.logprobs == second.logprobs
    torch.manual_seed(1)
    third = engine.generate(prompts, sampling)
    assert third.response_ids != first.response_ids


def test_generate_restores_training_mode(tiny, prompts):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    model.train()
    try:
        engine.generate(prompts[:2], SamplingConfig(n=1, max_new_tokens=2))
        assert model.training
    finally:
        model.eval()


def test_sampled_logprobs_step_by_step_equal_the_stacked_formula_bit_for_bit() -> None:
    """The per-step computation (no `[B, T, vocab]` stack, the SmolLM2 step's peak) changes no number."""
    from verl_hpc.roles.forward import exclude_padding
    from verl_hpc.roles.rollout.hf import _sampled_logprobs

    torch.manual_seed(0)
    steps = [torch.randn(6, 4099) * 3 for _ in range(9)]
    tokens = torch.randint(0, 4099, (6, 9))
    stacked = exclude_padding(torch.stack(steps, dim=1).float(), 5) / 0.7
    expected = torch.log_softmax(stacked, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    given = list(steps)
    assert torch.equal(_sampled_logprobs(given, tokens, 5, 0.7), expected)
    assert given == [None] * 9  # each step's logits dropped once used


def test_a_kept_episode_cache_samples_what_a_fresh_prefill_does(tiny, prompts):
    """A second turn read from each row's kept cache (hf_prefix.py) samples the same ids with the same
    logprobs as the same call prefilling everything: rows stopped at different lengths, ragged
    inserted ids, and one prompt that extends no kept row, in one batch."""
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    sampling = SamplingConfig(n=1, max_new_tokens=8)
    inserted = torch.Generator().manual_seed(1)
    with engine.episode_cache() as store:
        torch.manual_seed(0)
        first = engine.generate(prompts, sampling, max_tokens=[3, 8, 5, 8, 2, 8])
        assert len(store.rows) == len(prompts)
        contexts = [p + r + torch.randint(5, 60, (k,), generator=inserted).tolist()
                    for p, r, k in zip(prompts, first.response_ids, [1, 4, 7, 2, 3, 5], strict=True)]
        contexts.append(prompts[2][:-1])  # begins a kept row, but no kept row begins it: a fresh prefill
        torch.manual_seed(5)
        kept = engine.generate(contexts, sampling)
        reused = store.reused_tokens
    assert reused == sum(len(p) + len(r) for p, r in zip(prompts, first.response_ids, strict=True)) - \
        sum(1 for r in first.response_ids if len(r) == 8)  # a row's last sampled token was never read
    torch.manual_seed(5)
    fresh = engine.generate(contexts, sampling)  # outside `episode_cache()`: nothing kept
    assert kept.response_ids == fresh.response_ids
    for a, b in zip(kept.logprobs, fresh.logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert engine.prefill_counts["reused"] == reused and engine._kept is None


def test_kept_rows_are_used_once_longest_first_and_dropped_with_new_weights(tiny, prompts):
    from verl_hpc.roles.rollout.hf_prefix import KeptRow, PrefixStore

    store = PrefixStore()
    short, long = KeptRow([1, 2], [], []), KeptRow([1, 2, 3], [], [])
    store.rows += [short, long]
    assert store.take([1, 2, 3]) is short  # a row must leave at least one token to feed
    assert store.take([1, 2, 3, 4]) is long and store.take([1, 2, 3, 4]) is None  # each used once
    assert store.take([9, 2, 3]) is None

    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    with engine.episode_cache() as kept:
        engine.generate(prompts[:2], SamplingConfig(n=1, max_new_tokens=3))
        assert len(kept.rows) == 2
        engine.load_weights([(n, p.detach().clone()) for n, p in model.named_parameters()], version=1)
        assert kept.rows == []  # a cache from other weights is not this policy's
