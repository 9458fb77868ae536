"""Rewards: a rule-based `module:function`, or a sequence-classification reward model.

Why both produce one score per sequence: GRPO and PPO both start from a sequence score
(token-level rewards are derived from it in `algo`), so the trainer never needs to know
which kind of reward it is talking to.

Why every score is checked here: one NaN poisons the advantages of its whole group and,
through the update, the weights; a run then "trains" to exit 0 with a final score of nan.
A score that is not a finite number (or a function that raises) is handled by
`reward.on_error`: `fail` (the default) stops the run with one line naming the prompt and
the value; `zero` scores the sequence 0; `skip` gives it its group's mean of the valid
scores, so its GRPO advantage is 0 and it adds no gradient. Either way the sequences are
counted (`errors`, `metrics()` -> `reward/errors`).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.data.rollout_batch import RolloutBatch

ON_ERROR = ("fail", "zero", "skip")


class RewardError(ConfigError):
    """A reward gave no usable score; one line naming the prompt index and the value."""


def score_problem(value: Any) -> str | None:
    """Why `value` is not a usable score (None when it is a finite real number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return None if math.isfinite(float(value)) else f"returned {float(value)}"
    return f"returned {type(value).__name__} {value!r:.60}, not a number"


class _Checked:
    """The `on_error` policy and the error counters shared by both reward kinds."""

    field = "reward.function"
    on_error = "fail"
    errors = 0       # sequences whose score was replaced, over the whole run (this process)
    last_errors = 0  # the same, in the latest batch

    def _set_policy(self, on_error: str) -> None:
        if on_error not in ON_ERROR:
            raise ConfigError("reward.on_error", f"unknown value {on_error!r}", f"use one of {', '.join(ON_ERROR)}")
        self.on_error, self.errors, self.last_errors = on_error, 0, 0

    def metrics(self) -> dict[str, float]:
        """`reward/errors`: sequences of the latest batch whose score was replaced."""
        return {"reward/errors": float(self.last_errors)}

    def _resolve(self, batch: RolloutBatch, values: list[float], problems: dict[int, str]) -> torch.Tensor:
        scores = torch.tensor(values, dtype=torch.float32)
        self.last_errors = len(problems)
        self.errors += len(problems)
        if not problems:
            return scores
        if self.on_error == "fail":
            raise self._error(batch, problems)
        bad = torch.zeros(len(values), dtype=torch.bool)
        bad[list(problems)] = True
        if self.on_error == "zero":
            return torch.where(bad, torch.zeros_like(scores), scores)
        groups = torch.tensor(batch.column("group_id").to_numpy(), dtype=torch.long)
        for row in problems:
            peers = (groups == groups[row]) & ~bad
            scores[row] = scores[peers].mean() if peers.any() else 0.0
        return scores

    def _error(self, batch: RolloutBatch, problems: dict[int, str]) -> RewardError:
        row = min(problems)
        prompt = int(batch.column("prompt_index")[row].as_py())
        more = f" (and {len(problems) - 1} more sequences of this batch)" if len(problems) > 1 else ""
        return RewardError(self.field, f"{self.describe()} {problems[row]} for prompt index {prompt} "
                           f"(batch row {row}){more}",
                           "return a finite float for every response, or set reward.on_error: zero or skip "
                           "to count such sequences in reward/errors and go on")

    def describe(self) -> str:
        return "the reward"


class RuleReward(_Checked):
    """Calls `fn(prompt=..., response=..., ground_truth=...)` on decoded text, per sequence.

    A function that takes a `finished` keyword (or `**kwargs`) also gets whether the
    response ended with EOS, which the decoded text cannot show (special tokens are removed).
    """

    def __init__(self, fn: Callable[..., float], tokenizer, on_error: str = "fail"):
        self.fn = fn
        self.tokenizer = tokenizer
        self._set_policy(on_error)
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = []
        self._pass_finished = any(p.name == "finished" or p.kind is p.VAR_KEYWORD for p in params)

    def describe(self) -> str:
        """`module:function`, or `path/file.py:function` for a function loaded from a file."""
        module, name = getattr(self.fn, "__module__", None) or "?", getattr(self.fn, "__qualname__", repr(self.fn))
        code = getattr(self.fn, "__code__", None)
        if module.startswith("verl_hpc_user_") and code is not None:
            module = code.co_filename
        return f"{module}:{name}"

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        decode = self.tokenizer.batch_decode
        response_ids = batch.column("response_ids").to_pylist()
        prompts = decode(batch.column("prompt_ids").to_pylist(), skip_special_tokens=True)
        responses = decode(response_ids, skip_special_tokens=True)
        truths = batch.column("ground_truth").to_pylist()
        eos = self.tokenizer.eos_token_id
        values: list[float] = []
        problems: dict[int, str] = {}
        for row, (p, r, t, ids) in enumerate(zip(prompts, responses, truths, response_ids, strict=True)):
            extra = {"finished": bool(ids) and ids[-1] == eos} if self._pass_finished else {}
            try:
                value = self.fn(prompt=p, response=r, ground_truth=t or "", **extra)
            except Exception as err:  # noqa: BLE001 - the user's function: reported per on_error
                problems[row] = f"raised {type(err).__name__}: {err}"
                values.append(0.0)
                continue
            problem = score_problem(value)
            if problem is not None:
                problems[row] = problem
            values.append(0.0 if problem is not None else float(value))
        return self._resolve(batch, values, problems)


class ModelReward(_Checked):
    """A Hugging Face sequence-classification model; the score is logit 0 at the last token."""

    field = "reward.model_path"

    def __init__(self, path: str, device: torch.device | str = "cpu", micro_batch_size: int = 64,
                 on_error: str = "fail"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path = path
        self.device = torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model.config.pad_token_id = self.pad_id
        self.micro_batch_size = micro_batch_size
        self._set_policy(on_error)

    def describe(self) -> str:
        return f"the reward model {self.path}"

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """The classifier reads the last non-pad token of each [prompt | response] row."""
        inputs = batch.model_inputs(self.pad_id)
        scores = []
        for start in range(0, len(batch), self.micro_batch_size):
            sl = slice(start, start + self.micro_batch_size)
            logits = self.model(input_ids=inputs["input_ids"][sl].to(self.device),
                                attention_mask=inputs["attention_mask"][sl].to(self.device),
                                position_ids=inputs["position_ids"][sl].to(self.device)).logits
            scores.append(logits[:, 0].float().cpu())
        values = torch.cat(scores)
        problems = {row: f"returned {v}" for row, v in enumerate(values.tolist()) if not math.isfinite(v)}
        return self._resolve(batch, [0.0 if row in problems else v for row, v in enumerate(values.tolist())],
                             problems)
