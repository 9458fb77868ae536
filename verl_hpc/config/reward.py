"""The reward section: a rule function, a reward model or an LLM judge, and DAPO's overlong shaping.

Why its own module: the reward has grown three sources that combine (a judge can feed a
function), each with its own checks; they are one concern, and `schema.py` holds the rest.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from verl_hpc.config.base import StrictModel


class OverlongBufferConfig(StrictModel):
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`)."""

    enable: bool = Field(False, description="add the penalty to every score (DAPO)")
    len: int = Field(0, ge=0, description="the last `len` tokens before sampling.max_new_tokens, over which "
                     "the penalty grows from 0 to -penalty_factor")
    penalty_factor: float = Field(1.0, ge=0.0, description="the penalty at the limit (its negative)")


class CustomRewardFunction(StrictModel):
    """verl's `custom_reward_function`: a Python file and the function in it."""

    path: str = Field(description="a .py file (relative to the working directory)")
    name: str = Field("compute_score", description="the function's name in that file")
    reward_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments "
                                          "for every call (verl's key)")


DEFAULT_JUDGE_PROMPT = (
    "Rate the response to the question below from 0 to 10, where 10 is a correct and complete answer.\n\n"
    "Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n\n"
    "Reply with the rating only.")
JUDGE_FIELDS = ("prompt", "response", "ground_truth")


class JudgeConfig(StrictModel):
    """An LLM that reads each response and writes a verdict; the number parsed from it is the score."""

    model_path: str = Field(description="a local Hugging Face causal-LM directory (an instruct model)")
    prompt: str = Field(DEFAULT_JUDGE_PROMPT, description="the judge's instruction, a template with `{prompt}`, "
                        "`{response}` and `{ground_truth}` (the decoded texts); rendered with the judge's chat "
                        "template as one user message when it has one; `{{`/`}}` are literal braces")
    parse: str = Field("number", description="how a verdict becomes a score: `number` (the first number in it), "
                       "or a regular expression whose first group (else its whole match) is the number; a verdict "
                       "with none is an error handled by `reward.on_error`")
    max_new_tokens: int = Field(16, ge=1, description="tokens the judge may write per verdict (greedy)")
    strategy: Literal["hf", "vllm"] = Field("hf", description="hf: transformers' `generate`, batched; vllm: a "
                                            "vLLM engine in the reward process")
    batch_size: int = Field(16, ge=1, description="verdicts generated per `generate` call (hf)")

    @model_validator(mode="after")
    def _template(self) -> JudgeConfig:
        import re
        import string

        try:
            names = {name for _, name, _, _ in string.Formatter().parse(self.prompt) if name is not None}
        except ValueError as err:
            raise ValueError(f"prompt is not a valid template: {err} (write literal braces as {{{{ and }}}})") from None
        unknown = sorted(names - set(JUDGE_FIELDS))
        if unknown:
            raise ValueError(f"prompt names {unknown}; a judge template may use {{prompt}}, {{response}} and "
                             "{ground_truth}")
        if "response" not in names:
            raise ValueError("prompt must contain {response}: the judge has to see what it scores")
        if self.parse != "number":
            try:
                re.compile(self.parse)
            except re.error as err:
                raise ValueError(f"parse is not a regular expression: {err}") from None
        return self


class RewardConfig(StrictModel):
    """A rule-based function (ours or verl's `compute_score`), a sequence-classification reward model, or an
    LLM judge (alone, or feeding its verdict to the function)."""

    function: str | None = None
    custom_reward_function: CustomRewardFunction | None = Field(None, description="verl's form of a rule "
                                                                "reward: `{path, name}`")
    model_path: str | None = None
    judge: JudgeConfig | None = Field(None, description="an LLM judge scores each response (docs/judge.md); "
                                      "with a function as well, the function gets the judge's verdict as its "
                                      "`judge` keyword argument and returns the score")
    # A score that is not a finite number, or a function that raises: stop the run (fail),
    # score it 0 (zero), or give it its group's mean (skip); counted in reward/errors.
    on_error: Literal["fail", "zero", "skip"] = "fail"
    num_workers: int = Field(1, ge=1, description="processes that run a rule reward in parallel (slow "
                             "Python: math checks, code execution); 1 = in the scoring process")
    timeout_seconds: float = Field(60.0, gt=0.0, description="with num_workers > 1: a call running longer "
                                   "is killed, scores 0 and counts in `reward/timeouts`")
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig,
                                                  description="DAPO: penalise responses near the length limit")

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        given = sum(v is not None for v in (self.function, self.custom_reward_function, self.model_path))
        if self.judge is not None and self.model_path is not None:
            raise ValueError("reward.judge and reward.model_path are two reward models: set one of them")
        if given > 1 or (given == 0 and self.judge is None):
            raise ValueError("set exactly one of reward.function (module:function), "
                             "reward.custom_reward_function ({path, name}), reward.model_path or reward.judge "
                             "(a judge may be combined with a function)")
        return self

    @property
    def is_model(self) -> bool:
        """A model scores (a reward model or a judge): it gets a reward group, or runs on the trainer ranks."""
        return self.model_path is not None or self.judge is not None

    @property
    def function_spec(self) -> str | None:
        """The rule function as `module:function` or `file.py:function`; None for a reward model."""
        if self.custom_reward_function is not None:
            return f"{self.custom_reward_function.path}:{self.custom_reward_function.name}"
        return self.function

    @property
    def function_field(self) -> str:
        return "reward.custom_reward_function" if self.custom_reward_function is not None else "reward.function"
