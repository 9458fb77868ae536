"""Rollouts with Hugging Face `generate`: the backend that works everywhere, CPU included.

Why it can share the actor's module: in the embedded (single-process, colocated)
runtime the engine holds the very `nn.Module` the actor trains, so a weight sync is free
and exact; in split placement it holds its own copy and `load_weights` copies into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch

from verl_hpc.config import SamplingConfig
from verl_hpc.roles.forward import exclude_padding, unsampled_token
from verl_hpc.roles.rollout.base import Generation, stop_token_ids
from verl_hpc.roles.rollout.hf_prefix import PrefixStore, prefix_batch
from verl_hpc.transport.weights.flat import flatten_params, same_memory


class HFRolloutEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device | str = "cpu"):
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = stop_token_ids(tokenizer, model=model)
        self.policy_version = 0
        self._kept: PrefixStore | None = None  # set inside `episode_cache()`
        self.prefill_counts = {"reused": 0, "fed": 0}  # context tokens read from kept caches / prefilled

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                 stop_token_ids: Sequence[int] = (), max_tokens: Sequence[int] | None = None) -> Generation:
        """`stop_token_ids`: more ids that end a response (kept, like EOS): a multi-turn turn ends at
        its end-of-turn or tool-call end tag. `max_tokens`: each prompt's own token limit (an
        episode's remaining budget); the batch samples up to the largest and cuts the others, which
        is the same distribution as stopping them there (later tokens never influence earlier ones)."""
        stops = [*self.eos_ids, *(int(t) for t in stop_token_ids if int(t) not in self.eos_ids)]
        limit = max(max_tokens) if max_tokens else sampling.max_new_tokens
        store = self._kept
        batch = store.assemble(prompt_ids, self.pad_id) if store is not None \
            else prefix_batch(prompt_ids, [None] * len(prompt_ids), self.pad_id)
        input_ids, attention = batch.input_ids, batch.attention
        width = input_ids.shape[1]
        # HF pads a row that hit a stop string with pad tokens until the batch ends; record
        # where each row stopped so those never-sampled pads are cut like tokens after EOS.
        stopper = _StopStringLengths(self.tokenizer, sampling.stop, width, len(prompt_ids)) \
            if sampling.stop else None
        was_training = self.model.training
        self.model.eval()
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None,
            max_new_tokens=limit, pad_token_id=self.pad_id, eos_token_id=stops,
            output_logits=True, return_dict_in_generate=True,
            # Padding is not an action: a sampled pad would be cut from the sequence by every
            # consumer that strips padding (reward models, the trainer's masks).
            suppress_tokens=[unsampled_token(self.model)] if unsampled_token(self.model) is not None else None,
            stopping_criteria=[stopper] if stopper else None,
            **({"past_key_values": batch.cache, "use_cache": True} if store is not None else {}),
        )
        self.model.train(was_training)
        tokens = out.sequences[:, width:].cpu()
        step_logits = list(out.logits)
        cache = out.past_key_values if store is not None else None  # what the store keeps of this call
        del out
        logprobs = _sampled_logprobs(step_logits, tokens, unsampled_token(self.model), sampling.temperature)
        out_rows = _trim(tokens, logprobs, stops, stopper.lengths if stopper else None)
        if max_tokens:
            out_rows = Generation([r[:n] for r, n in zip(out_rows.response_ids, max_tokens, strict=True)],
                                  [r[:n] for r, n in zip(out_rows.logprobs, max_tokens, strict=True)])
        if store is not None:
            store.keep(cache, batch, prompt_ids, out_rows.response_ids)  # type: ignore[arg-type]
        return out_rows

    @contextlib.contextmanager
    def episode_cache(self) -> Iterator[PrefixStore]:
        """Within it, each row's KV cache is kept for the next call's prompt that extends it (hf_prefix.py).

        The agent loop holds one around a step's episodes: a turn then prefills only the
        reply inserted since its episode's last turn. Everything kept is dropped on leaving and
        when weights change (a cache from other weights is not this policy's).
        """
        self._kept = PrefixStore()
        try:
            yield self._kept
        finally:
            self.prefill_counts["reused"] += self._kept.reused_tokens
            self.prefill_counts["fed"] += self._kept.fed_tokens
            self._kept = None

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                if not same_memory(params[name], tensor):  # a sync received into `weight_buffer` is in place
                    params[name].copy_(tensor)
        self.policy_version = version
        if self._kept is not None:
            self._kept.rows.clear()

    def weight_buffer(self) -> torch.Tensor | None:
        """This engine's weights as one flat float32 buffer a split sync receives into (None: not fp32).

        Only split placement calls it: there the engine holds its own copy. The embedded
        runtime's engine shares the actor's module and must never be re-homed.
        """
        return flatten_params(self.model)

    def weight_specs(self) -> list[tuple[str, torch.Size]]:
        return [(name, p.shape) for name, p in self.model.named_parameters()]

    def close(self) -> None:
        pass

    def sleep(self) -> None:  # nothing to release: a kept episode cache lives only inside `episode_cache()`
        pass

    def wake_up(self) -> None:
        pass


class _StopStringLengths:
    """HF's stop-string criterion that also records how many tokens each row had when it first fired."""

    def __init__(self, tokenizer, stops: list[str], prompt_width: int, batch_size: int):
        from transformers import StopStringCriteria

        self.inner = StopStringCriteria(tokenizer, stops)
        self.prompt_width = prompt_width
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # 0: never stopped

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = self.inner(input_ids, scores, **kwargs)
        lengths = self.lengths.to(done.device)  # stays on the device: no sync per step
        self.lengths = torch.where(done & (lengths == 0), input_ids.shape[1] - self.prompt_width, lengths)
        return done


def _sampled_logprobs(step_logits: list[torch.Tensor | None], tokens: torch.Tensor, pad_id: int | None,
                      temperature: float) -> torch.Tensor:
    """Log-probability of each sampled token, one generation step at a time; empties `step_logits`.

    Why per step: stacking HF's per-step logits into `[B, T, vocab]` and then casting,
    excluding the pad, scaling and log-softmaxing it made five such tensors. On SmolLM2
    (49k vocab, 32 rows, 64 tokens) that was ~1.7 GB. It set the whole GRPO step's peak
    memory, above the update's own (`python -m bench memory`). Per step only one row-block of
    logits is live beyond the ones HF returned, and each is dropped once used.
    """
    out = torch.empty(tokens.shape, dtype=torch.float32)
    for t in range(tokens.shape[1]):
        logits = step_logits[t]
        step_logits[t] = None
        scaled = exclude_padding(logits.float().cpu(), pad_id) / temperature  # type: ignore[union-attr]
        out[:, t] = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, t:t + 1]).squeeze(-1)
    return out


def _trim(tokens: torch.Tensor, logprobs: torch.Tensor, eos_ids: list[int],
          stop_lengths: torch.Tensor | None = None) -> Generation:
    """Cut each row after its first EOS (any of `eos_ids`) or stop string (kept: emitting it was an action)."""
    is_eos = torch.isin(tokens, torch.tensor(eos_ids, dtype=tokens.dtype))
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, tokens.shape[1] - 1,
                                                                                  dtype=torch.long))
    lengths = first_eos + 1
    if stop_lengths is not None:
        stop_lengths = stop_lengths.cpu()
        lengths = torch.where(stop_lengths > 0, torch.minimum(lengths, stop_lengths), lengths)
    lengths = lengths.tolist()
    token_rows, lp_rows = tokens.tolist(), logprobs.tolist()
    return Generation([r[:n] for r, n in zip(token_rows, lengths, strict=True)],
                      [r[:n] for r, n in zip(lp_rows, lengths, strict=True)])
