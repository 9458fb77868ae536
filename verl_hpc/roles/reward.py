"""Rewards: a rule-based `module:function`, or a sequence-classification reward model.

Why both produce one score per sequence: GRPO and PPO both start from a sequence score
(token-level rewards are derived from it in `algo`), so the trainer never needs to know
which kind of reward it is talking to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_hpc.data.rollout_batch import RolloutBatch


class RuleReward:
    """Calls `fn(prompt=..., response=..., ground_truth=...)` on decoded text, per sequence."""

    def __init__(self, fn: Callable[..., float], tokenizer):
        self.fn = fn
        self.tokenizer = tokenizer

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        decode = self.tokenizer.batch_decode
        prompts = decode(batch.column("prompt_ids").to_pylist(), skip_special_tokens=True)
        responses = decode(batch.column("response_ids").to_pylist(), skip_special_tokens=True)
        truths = batch.column("ground_truth").to_pylist()
        values = [float(self.fn(prompt=p, response=r, ground_truth=t or ""))
                  for p, r, t in zip(prompts, responses, truths, strict=True)]
        return torch.tensor(values, dtype=torch.float32)


class ModelReward:
    """A Hugging Face sequence-classification model; the score is logit 0 at the last token."""

    def __init__(self, path: str, device: torch.device | str = "cpu", micro_batch_size: int = 64):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model.config.pad_token_id = self.pad_id
        self.micro_batch_size = micro_batch_size

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
        return torch.cat(scores)
