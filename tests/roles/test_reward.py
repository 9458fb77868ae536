"""Tests for rule rewards (decoded text) and sequence-classification reward models (padding)."""

from __future__ import annotations

import pytest
import torch

from verl_hpc.data import RolloutBatch
from verl_hpc.data.tasks.arithmetic import score as arithmetic_score
from verl_hpc.models.tiny import build_tokenizer
from verl_hpc.roles.reward import ModelReward, RuleReward


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(64, seed=0)


def make_batch(tokenizer, prompts: list[str], responses: list[str], truths: list[str | None],
               eos_rows: tuple[int, ...] = ()) -> RolloutBatch:
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    response_ids = [tokenizer(r)["input_ids"] + ([tokenizer.eos_token_id] if i in eos_rows else [])
                    for i, r in enumerate(responses)]
    n = len(prompts)
    return RolloutBatch.from_generation(prompt_ids, response_ids, None, group_ids=list(range(n)),
                                        prompt_index=list(range(n)), ground_truth=truths, policy_version=0)


def test_rule_reward_arithmetic(tokenizer):
    prompts = ["2+3=", "4+4=", "what is 1+1=", "9+0=", "5+5=", "3+3=", "1+0="]
    # only characters of the tiny tokenizer's training alphabet (others are dropped on encode)
    responses = ["5", "7", " 2 and more", "the sum", "10", "16", "1"]
    truths = ["5", "8", "2", "9", "10", "6", None]
    batch = make_batch(tokenizer, prompts, responses, truths, eos_rows=(0, 4))
    calls = []

    def recording_score(**kwargs):
        calls.append(kwargs)
        return arithmetic_score(**kwargs)

    scores = RuleReward(recording_score, tokenizer).score(batch)
    assert scores.dtype == torch.float32
    # full marks need the number then EOS; " 2 and more" has the right number but runs on
    assert scores.tolist() == [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0]
    assert [c["finished"] for c in calls] == [True, False, False, False, True, False, False]
    # the function sees decoded text, special tokens removed, and "" for a missing answer
    assert [c["prompt"] for c in calls] == prompts
    assert [c["response"] for c in calls] == responses
    assert calls[-1]["ground_truth"] == ""


@pytest.mark.parametrize(("on_error", "expected"), [("zero", [0.0, 1.0, 0.0, 0.0]), ("skip", [1.0, 1.0, 0.0, 0.0])])
def test_bad_scores_are_replaced_and_counted(tokenizer, on_error, expected):
    """Rows 0-1 are one group, 2-3 another: skip gives a bad row its group's mean of valid scores."""
    batch = RolloutBatch.from_generation([[5]] * 4, [[6]] * 4, None, group_ids=[0, 0, 1, 1],
                                         prompt_index=[7, 7, 9, 9], ground_truth=["1"] * 4, policy_version=0)
    values = iter([float("nan"), 1.0, "x", float("inf")])
    reward = RuleReward(lambda **_: next(values), tokenizer, on_error=on_error)
    assert reward.score(batch).tolist() == expected
    assert reward.metrics() == {"reward/errors": 3.0} and reward.errors == 3


def test_a_bad_score_fails_naming_prompt_and_value(tokenizer):
    from verl_hpc.roles.reward import RewardError

    batch = RolloutBatch.from_generation([[5]] * 2, [[6]] * 2, None, group_ids=[0, 0], prompt_index=[4, 11],
                                         ground_truth=["1"] * 2, policy_version=0)
    values = iter([0.5, float("nan")])
    with pytest.raises(RewardError, match=r"^reward.function: .* returned nan for prompt index 11 \(batch row 1\)"):
        RuleReward(lambda prompt, response, ground_truth: next(values), tokenizer).score(batch)


def test_rule_reward_writes_back_as_score_column(tokenizer):
    batch = make_batch(tokenizer, ["1+1=", "2+2="], ["2", "5"], ["2", "4"], eos_rows=(0, 1))
    scored = batch.with_columns(score=RuleReward(arithmetic_score, tokenizer).score(batch))
    assert scored.scores().tolist() == [1.0, 0.0]


@pytest.fixture(scope="module")
def reward_model_dir(tokenizer, tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).eval()
    with torch.no_grad():  # large score weights: a wrong read position changes the score a lot
        model.score.weight.normal_(0.0, 1.0)
    path = tmp_path_factory.mktemp("rm") / "reward_model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_model_reward_matches_unpadded_rows(tokenizer, reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    prompts = ["1+2=", "what is the sum of 45 and 54", "9+9=", "7+0=", "the answer is"]
    responses = ["3", "99 is the answer", "18 and", "7", "what is 12"]
    batch = make_batch(tokenizer, prompts, responses, ["3", "99", "18", "7", None], eos_rows=(0, 2))
    lengths = [len(p) + len(r) for p, r in zip(batch.column("prompt_ids").to_pylist(),
                                               batch.column("response_ids").to_pylist(), strict=True)]
    assert len(set(lengths)) > 2  # rows of different lengths: left and right padding both occur

    reward = ModelReward(str(reward_model_dir), micro_batch_size=2)  # several micro-batches
    scores = reward.score(batch)
    assert scores.shape == (len(batch),)
    assert scores.dtype == torch.float32

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    expected = []
    with torch.no_grad():
        for p, r in zip(batch.column("prompt_ids").to_pylist(), batch.column("response_ids").to_pylist(),
                        strict=True):
            expected.append(model(input_ids=torch.tensor([p + r])).logits[0, 0].item())
    expected_t = torch.tensor(expected)
    assert (scores - expected_t).abs().max().item() < 1e-4
    assert expected_t.std().item() > 0.1  # the rows really score differently
    # one big micro-batch gives the same scores
    assert (ModelReward(str(reward_model_dir)).score(batch) - scores).abs().max().item() < 1e-4
