"""An LLM judge as the reward: it reads each (prompt, response) and writes a verdict; a number in it is the score.

Why a rollout engine underneath: the judge is generation, nothing more, and the project
already has two engines that do it on any device (HF `generate`, batched; vLLM in a child
process). The judge decodes greedily (top-k 1), so one (prompt, response) always gets the
same verdict, on its own reward group or colocated on the trainer ranks alike; no FSDP, no
gradients. Within a step each distinct (prompt, response) is judged once: GRPO's groups
often hold identical answers, and a judge call is the step's most expensive reward.

A verdict with no number in it (or that `reward.judge.parse` does not match) is the
judge's error, not the policy's, and follows `reward.on_error` like a reward function's
exception. With `reward.function` (or verl's `custom_reward_function`) as well, the
function is called for every row the judge scored, with `judge={"score": float,
"verdict": str}` beside its usual arguments, and its return value is the score: a rule
and the judge combined as the user says. The raw verdicts go to the samples log
(`last_verdicts` -> the rollout batch's `judge_verdict` column).
"""

from __future__ import annotations

import math
import re

import torch

from verl_hpc.config import SamplingConfig
from verl_hpc.config.errors import ConfigError
from verl_hpc.config.resources import RoleResources, VllmArgs
from verl_hpc.config.schema import JudgeConfig
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.reward import RuleReward, _Checked
from verl_hpc.roles.rollout import build_engine

NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def parse_verdict(verdict: str, parse: str) -> float | None:
    """The score in a verdict: the first number (`parse: number`), or the regex's first group (else
    its whole match) read as a number; None when there is none or it is not finite."""
    if parse == "number":
        found = NUMBER.search(verdict)
        text = found.group(0) if found else None
    else:
        match = re.search(parse, verdict)
        text = None if match is None else (match.group(1) if match.groups() else match.group(0))
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        found = NUMBER.search(text)
        value = float(found.group(0)) if found else math.nan
    return value if math.isfinite(value) else None


def render(template: str, prompt: str, response: str, ground_truth: str) -> str:
    return template.format(prompt=prompt, response=response, ground_truth=ground_truth)


class JudgeReward(_Checked):
    """Scores a rollout batch with an LLM judge (optionally through a rule function that gets its verdict)."""

    field = "reward.judge"

    def __init__(self, judge: JudgeConfig, policy_tokenizer, device: torch.device, on_error: str = "fail",
                 combine: RuleReward | None = None, timeout: float = 600.0):
        from transformers import AutoTokenizer

        from verl_hpc.utils.fs import expand_path

        self.judge, self.policy_tokenizer, self.combine = judge, policy_tokenizer, combine
        if combine is not None and not combine.takes_judge:
            raise ConfigError("reward.judge", f"{combine.describe()} takes no `judge` keyword argument, so the "
                              "judge's verdict could not reach it", "add `judge=None` to the function's "
                              "parameters (a dict with score and verdict), or remove reward.function")
        self._set_policy(on_error)
        path = str(expand_path(judge.model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        resources = RoleResources(device_type=device.type, device_ids=[device.index or 0], strategy=judge.strategy,
                                  vllm_args=VllmArgs(enforce_eager=True) if judge.strategy == "vllm" else None)
        self.engine = build_engine(resources, path, self.tokenizer, device, colocated=False, timeout=timeout)
        self.sampling = SamplingConfig(n=1, temperature=1.0, top_k=1, max_new_tokens=judge.max_new_tokens)
        self.cache: dict[tuple[str, str], str] = {}
        self.cache_step: int | None = None
        self.last_verdicts: list[str] = []
        self.stats = {"calls": 0, "cached": 0, "unparsable": 0}

    def describe(self) -> str:
        return f"the judge {self.judge.model_path}"

    def judge_inputs(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each judge prompt: one user message through the judge's chat template, if it has one."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                             add_generation_prompt=True) for t in texts]
        return [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]

    def verdicts(self, prompts: list[str], responses: list[str], truths: list[str], step: int) -> list[str]:
        """One verdict per row; each distinct (prompt, response) of the step judged once."""
        if step != self.cache_step:
            self.cache, self.cache_step = {}, step
        keys = list(zip(prompts, responses, strict=True))
        todo: dict[tuple[str, str], str] = {}
        for key, truth in zip(keys, truths, strict=True):
            if key not in self.cache and key not in todo:
                todo[key] = render(self.judge.prompt, key[0], key[1], truth)
        self.stats["cached"] = len(keys) - len(todo)
        self.stats["calls"] = len(todo)
        pending = list(todo)
        size = self.judge.batch_size
        for start in range(0, len(pending), size):
            chunk = pending[start:start + size]
            out = self.engine.generate(self.judge_inputs([todo[k] for k in chunk]), self.sampling)
            decoded = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            self.cache.update(zip(chunk, (v.strip() for v in decoded), strict=True))
        return [self.cache[key] for key in keys]

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        decode = self.policy_tokenizer.batch_decode
        prompts = decode(batch.column("prompt_ids").to_pylist(), skip_special_tokens=True)
        responses = decode(batch.column("response_ids").to_pylist(), skip_special_tokens=True)
        truths = [t or "" for t in batch.column("ground_truth").to_pylist()]
        step = int(batch.column("step")[0].as_py()) if len(batch) else -1
        verdicts = self.verdicts(prompts, responses, truths, step)
        self.last_verdicts = verdicts
        parsed = [parse_verdict(v, self.judge.parse) for v in verdicts]
        problems = {row: f"wrote the verdict {v!r:.80}, which has no score ({self._parse_hint()})"
                    for row, (v, p) in enumerate(zip(verdicts, parsed, strict=True)) if p is None}
        self.stats["unparsable"] = len(problems)
        if self.combine is None:
            values = [0.0 if p is None else p for p in parsed]
        else:
            per_row = [{"judge": {"score": p, "verdict": v}} for v, p in zip(verdicts, parsed, strict=True)]
            values, rule_problems = self.combine.raw(batch, per_row, skip=frozenset(problems))
            problems = {**rule_problems, **problems}
        return self._resolve(batch, values, problems)

    def _parse_hint(self) -> str:
        return "no number in it" if self.judge.parse == "number" else f"no match for {self.judge.parse!r}"

    def metrics(self) -> dict[str, float]:
        """`reward/errors`, and the judge's own: verdicts generated, rows served from the step's cache,
        verdicts without a score; a combining function's extras."""
        out = super().metrics()
        out.update({f"reward/judge/{k}": float(v) for k, v in self.stats.items()})
        if self.combine is not None:
            out.update({f"reward/extra/{k}": v for k, v in self.combine.extra.items()})
        return out

    def close(self) -> None:
        self.engine.close()
        if self.combine is not None:
            self.combine.close()
