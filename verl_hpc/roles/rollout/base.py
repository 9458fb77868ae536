"""The rollout-engine interface: token ids in, sampled token ids and their logprobs out.

Why token ids and not text: re-tokenising decoded text drifts (merges differ), and the
trainer must score exactly the tokens that were sampled. Engines also take versioned
weights, so every rollout can be stamped with the policy version that produced it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from verl_hpc.config import SamplingConfig


def stop_token_ids(tokenizer, model_dir: str | None = None, model=None) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's `generation_config` ones.

    Why both: chat models end a turn with a token the tokenizer may not call EOS
    (`<|im_end|>`), listed only in generation_config.json (an int or a list). Both engines
    stop on the same set, so HF and vLLM rollouts of one model end in the same place.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    if config is None and model_dir is not None:
        try:
            from transformers import GenerationConfig

            config = GenerationConfig.from_pretrained(model_dir)
        except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS alone
            config = None
    extra = getattr(config, "eos_token_id", None)
    for token in [extra] if isinstance(extra, int) else list(extra or []):
        if int(token) not in ids:
            ids.append(int(token))
    return ids


@dataclass
class Generation:
    """One sampled response per input prompt, EOS included when it was produced.

    Replayed agent episodes also carry their loss masks, turn bounds and versions and episode
    records (`trajectory`, as `RolloutBatch.from_generation(trajectory=...)` takes them) and the
    prompts they continue (`prompt_ids`: rendered with the tools, not the dataset's own ids).
    """

    response_ids: list[list[int]]
    logprobs: list[list[float]]
    trajectory: dict[str, list[Any]] | None = None
    prompt_ids: list[list[int]] | None = None


class RolloutEngine(Protocol):
    policy_version: int

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                 stop_token_ids: Sequence[int] = (), max_tokens: Sequence[int] | None = None) -> Generation:
        """Sample one response for each prompt (repeat prompts for n samples).

        `stop_token_ids` end a response like EOS does (kept in it); `max_tokens` gives each prompt
        its own limit instead of `sampling.max_new_tokens`. The agent loop calls it once per
        round with every episode that is ready for its next turn.
        """
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the engine's weights in place and record the policy version."""
        ...

    def weight_specs(self) -> list[tuple[str, torch.Size]]:
        """(name, shape) of each tensor `load_weights` expects, in the actor's parameter order."""
        ...

    def sleep(self) -> None:
        """Release memory not needed while the trainer runs (KV cache, weights)."""
        ...

    def wake_up(self) -> None:
        ...

    def close(self) -> None:
        """Release the engine for good (a child process, its sockets)."""
        ...
