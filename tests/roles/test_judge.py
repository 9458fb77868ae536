"""The LLM judge as a reward: its config checks, verdict parsing, real judges in this process: the
locally built tiny model (verdicts with no score follow `reward.on_error`) and SmolLM2-135M-Instruct
(the step's cache, a rule function that combines its own check with the judge's verdict)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.reward import JudgeConfig
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.judge import JudgeReward, parse_verdict
from verl_hpc.roles.reward import RewardError, RuleReward, scored


def test_verdicts_parse_as_the_config_says() -> None:
    assert parse_verdict("I would rate it 8/10.", "number") == 8.0
    assert parse_verdict("-0.5 points", "number") == -0.5
    assert parse_verdict("Score: 7. (it was 3 lines)", r"Score:\s*(\d+)") == 7.0
    assert parse_verdict("looks right", "number") is None
    assert parse_verdict("Score: high", r"Score:\s*(\d+)") is None
    assert parse_verdict("verdict 9", r"\d") == 9.0  # no group: the whole match


@pytest.mark.parametrize(("judge", "message"), [
    ({"prompt": "Rate {answer}"}, "a judge template may use"),
    ({"prompt": "Rate {prompt}"}, "must contain {response}"),
    ({"prompt": "Rate {response", }, "not a valid template"),
    ({"parse": "Score: (\\d+"}, "not a regular expression"),
])
def test_a_bad_judge_is_refused_naming_the_field(tmp_path, judge: dict, message: str) -> None:
    data = {"model": {"path": "unused"}, "reward": {"judge": {"model_path": str(tmp_path), **judge}}}
    with pytest.raises(ConfigError) as err:
        load_config(data=data)
    assert err.value.path.startswith("reward.judge") and message in err.value.message


def test_a_judge_that_cannot_reach_the_function_is_refused() -> None:
    def no_judge_kwarg(prompt: str, response: str, ground_truth: str) -> float:
        return 1.0

    with pytest.raises(ConfigError, match="judge"):
        JudgeReward(JudgeConfig(model_path="unused"), None, torch.device("cpu"),
                    combine=RuleReward(no_judge_kwarg, tokenizer=None))


@pytest.mark.parametrize("on_error", ["fail", "zero", "skip"])
def test_a_real_tiny_judge_that_never_writes_the_pattern_follows_on_error(tiny_model_dir: Path,
                                                                         on_error: str) -> None:
    """The locally built tiny model as the judge: real generation, verdicts that never match."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = _batch(tokenizer, ["5", "7", "5", "9"], [0, 0, 1, 1])
    judge = JudgeConfig(model_path=str(tiny_model_dir), parse=r"VERDICT=(\d+)", max_new_tokens=3)
    reward = JudgeReward(judge, tokenizer, torch.device("cpu"), on_error=on_error)
    if on_error == "fail":
        with pytest.raises(RewardError, match="the judge .* has no score"):
            reward.score(batch)
        return
    out = scored(batch, reward)
    assert out.scores().tolist() == [0.0] * 4  # zero: 0; skip: the group's mean of nothing scored is 0
    assert len(out.column("judge_verdict").to_pylist()) == 4  # the raw verdicts are kept all the same
    metrics = reward.metrics()
    assert metrics["reward/errors"] == 4 and metrics["reward/judge/unparsable"] == 4
    assert metrics["reward/judge/calls"] == 3  # the two "5"s of one prompt: judged once
    reward.close()


def _batch(tokenizer, responses: list[str], groups: list[int]) -> RolloutBatch:
    prompt = tokenizer("What is 2 + 3?", add_special_tokens=False)["input_ids"]
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    return RolloutBatch.from_generation([prompt] * len(ids), ids, None, group_ids=groups, prompt_index=groups,
                                        ground_truth=["5"] * len(ids), policy_version=0, step=1)


@pytest.mark.slow
def test_smollm2_judges_each_pair_once_and_feeds_its_verdict_to_a_rule(smollm2_model: Path) -> None:
    """One SmolLM2 judge (loaded once: the slow part): the step's cache, the verdicts beside the
    scores, and a rule function that combines its own check with the judge's score."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    responses = ["5", "7", "5", "The answer is 5."]
    batch = _batch(tokenizer, responses, [0, 0, 1, 1])
    seen: list[dict] = []

    def rule_and_judge(prompt: str, response: str, ground_truth: str, judge: dict | None = None) -> float:
        seen.append(judge)
        return (ground_truth in response) + judge["score"] / 10

    judge = JudgeConfig(model_path=str(smollm2_model), max_new_tokens=6, batch_size=2)
    reward = JudgeReward(judge, tokenizer, torch.device("cpu"), on_error="fail",
                         combine=RuleReward(rule_and_judge, tokenizer))
    out = scored(batch, reward)
    verdicts = out.column("judge_verdict").to_pylist()
    assert len(verdicts) == 4 and all(isinstance(v, str) and v for v in verdicts)
    assert verdicts[0] == verdicts[2]  # the same (prompt, response): one call, one verdict
    metrics = reward.metrics()
    assert metrics["reward/judge/calls"] == 3 and metrics["reward/judge/cached"] == 1
    assert [j["verdict"] for j in seen] == verdicts
    assert [j["score"] for j in seen] == [parse_verdict(v, "number") for v in verdicts]
    expected = [("5" in r) + parse_verdict(v, "number") / 10 for r, v in zip(responses, verdicts, strict=True)]
    assert out.scores().tolist() == pytest.approx(expected)
    assert torch.equal(reward.score(batch), out.scores())  # the same step again: all from the cache
    assert reward.metrics()["reward/judge/cached"] == 4
    reward.close()
