"""The one forward pass every trainer-side role shares: logits of the response tokens only.

Why one function: the actor's logprobs, the reference's logprobs and the trainer's
recomputation of old logprobs must agree bit for bit on the same weights; computing
them in one place (same slicing, same temperature) guarantees it. `logits_to_keep`
skips the LM head over prompt tokens, which no loss uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from verl_hpc.algo import entropy_from_logits, logprobs_from_logits
from verl_hpc.config.schema import LOGPROB_CHUNK_TOKENS
from verl_hpc.roles.head_logprobs import head_logits, head_logprobs
from verl_hpc.roles.micro_batching import micro_batches_of, reassemble
from verl_hpc.roles.packing import PackedRows, pack, packed_response_outputs

# Config fields with which a model changes its logits after the output head (Gemma's
# soft-capping, Cohere's and Granite's scales): the chunked path would skip that step, so
# such models take the whole-logits path.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def response_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Logits predicting each response token, [B, R, V], divided by the sampling temperature."""
    return tempered(_response_outputs(model, inputs), unsampled_token(model), temperature)


def _response_outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's outputs (logits, or hidden states under `_head_passes_hidden`) at the
    positions that predict each response token: the head skips the prompt."""
    resp_len = inputs["response_mask"].shape[1]
    out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                position_ids=inputs["position_ids"], logits_to_keep=resp_len + 1, use_cache=False)
    return out.logits[:, :-1, :]


def tempered(logits: torch.Tensor, pad_id: int | None, temperature: float) -> torch.Tensor:
    """The sampled distribution's logits: padding excluded, divided by the temperature."""
    logits = exclude_padding(logits, pad_id)
    return logits / temperature if temperature != 1.0 else logits


def unsampled_token(model: torch.nn.Module) -> int | None:
    """The pad token, when it is distinct from EOS: never an action, never sampled."""
    config = getattr(model, "config", None)
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    return pad if pad is not None and pad != eos else None


def exclude_padding(logits: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """Take the pad token out of the policy's distribution, for the sampler and the trainer alike.

    Why both: if only the sampler skipped it, the probability mass the policy keeps on pad
    would silently make the sampled distribution differ from the one being optimised — an
    off-policy error that grows with training and ends in collapse. A large finite
    negative (not -inf) keeps entropies finite.
    """
    if pad_id is None:
        return logits
    return logits.index_fill(-1, torch.tensor([pad_id], device=logits.device), -1e9)


def response_logprobs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float,
                      with_entropy: bool = False, chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
                      remove_padding: bool = False, entropy_grad: bool = True,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs of the response under `model` (and entropies if asked).

    With more than `chunk_tokens` response tokens (and a plain linear head) the logits exist
    one chunk of tokens at a time, in forward and in backward (`chunked_token_stats`); else
    all at once. `remove_padding`: the forward runs over packed rows (packing.py) and the
    head over the response tokens' hidden states only. `entropy_grad=False`: the entropies are
    a metric only (no entropy bonus), computed without autograd, so backward neither keeps
    nor recomputes their `[tokens, vocab]` softmax.
    """
    resp_len = inputs["response_mask"].shape[1]
    labels = inputs["input_ids"][:, -resp_len:]
    packed = pack(inputs) if remove_padding else None
    head = chunkable_head(model)
    # Chunks pay only when the logits are wider than the hidden states kept instead (49k vs
    # 576 for SmolLM2; the tiny test models' 64-token vocabulary is narrower than their 96),
    # and only for more than one chunk's tokens. Else the whole path, which autograd alone
    # drives: no recompute, and the numbers of every earlier run bit for bit.
    narrow = head is not None and head.out_features <= head.in_features
    if head is None or (packed is None and (narrow or not 0 < chunk_tokens < labels.numel())):
        logits = response_logits(model, inputs, temperature).float()
        logprobs = logprobs_from_logits(logits, labels)
        return logprobs, _entropy(logits, entropy_grad) if with_entropy else None
    hidden = response_hidden(model, head, inputs, packed)  # packed rows: only this path takes them
    whole = narrow or chunk_tokens <= 0
    return chunked_token_stats(hidden, head, labels, temperature, unsampled_token(model), with_entropy,
                               labels.numel() if whole else chunk_tokens, recompute=not narrow,
                               entropy_grad=entropy_grad)


def chunkable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output head when logits are exactly `head(hidden)`, else None (whole-logits path)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear):
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_POSTPROCESSING):
        return None
    return head


@contextmanager
def _head_passes_hidden(head: torch.nn.Module) -> Iterator[None]:
    """The model's forward runs whole (FSDP's root hooks included) but its head returns its input."""
    head.forward = lambda hidden: hidden  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward


def response_hidden(model: torch.nn.Module, head: torch.nn.Module, inputs: dict[str, torch.Tensor],
                    packed: PackedRows | None = None) -> torch.Tensor:
    """Last hidden states at the positions that predict each response token, [B, R, H].

    Why through the model's own forward and not its decoder submodule: under FSDP2 the
    root module's hooks gather the parameters it holds (embeddings, final norm, head) and
    drive the backward's reduce-scatter; calling a submodule directly would skip them.
    `packed`: the forward over packed rows, no attention mask (packing.py).
    """
    with _head_passes_hidden(head):
        if packed is None:
            return _response_outputs(model, inputs)
        return packed_response_outputs(
            lambda ids, positions: model(input_ids=ids, position_ids=positions, attention_mask=None,
                                         use_cache=False).logits, inputs, packed)


def _entropy(logits: torch.Tensor, grad: bool) -> torch.Tensor:
    if grad:
        return entropy_from_logits(logits)
    with torch.no_grad():
        return entropy_from_logits(logits)


def _token_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                 temperature: float, pad_id: int | None, with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """One chunk through autograd: the entropy bonus's path, which needs the entropy's gradient."""
    logits = head_logits(hidden, weight, bias, pad_id, temperature)
    logprobs = logprobs_from_logits(logits, labels)
    return (logprobs, entropy_from_logits(logits)) if with_entropy else (logprobs,)


def chunked_token_stats(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, temperature: float,
                        pad_id: int | None, with_entropy: bool, chunk_tokens: int, recompute: bool = True,
                        entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of `labels`, [B, R], from hidden states `chunk_tokens` at a time.

    Why chunks that keep nothing vocab-wide: autograd would otherwise keep every chunk's fp32
    logits and softmax for backward, which is the whole `[tokens, vocab]` tensor again. Each
    chunk's logits are recomputed in backward instead (one more head matmul per chunk), so
    what the pass keeps is the hidden states, `[tokens, hidden]`, a vocab/hidden fraction of
    the logits. Log-probs alone, or with entropies as a metric, take the hand-written
    backward (head_logprobs.py); an entropy bonus takes autograd under a checkpoint, or
    without one when `recompute=False` (logits no wider than the hidden states).
    """
    rows, resp_len, width = hidden.shape
    flat_hidden, flat_labels = hidden.reshape(-1, width), labels.reshape(-1)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    # Only an entropy bonus needs autograd through the chunk; else the hand-written backward.
    by_hand = not (grad and with_entropy and entropy_grad)
    logprobs, entropies = [], []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        args = (flat_hidden[start:start + chunk_tokens], head.weight, head.bias,
                flat_labels[start:start + chunk_tokens], temperature, pad_id, with_entropy)
        if by_hand:
            stats: tuple[torch.Tensor | None, ...] = head_logprobs(*args)
        elif recompute:
            stats = checkpoint(_token_stats, *args, use_reentrant=False)
        else:
            stats = _token_stats(*args)
        logprobs.append(stats[0])
        if with_entropy:
            entropies.append(stats[1])
    logprob = torch.cat(logprobs).view(rows, resp_len)
    return logprob, torch.cat(entropies).view(rows, resp_len) if with_entropy else None


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float,
                     micro_batch_size: int, chunk_tokens: int = LOGPROB_CHUNK_TOKENS, token_budget: int | None = None,
                     group: dist.ProcessGroup | None = None, remove_padding: bool = False) -> torch.Tensor:
    """Inference-only logprobs over micro-batches (reference policy, old policy), [B, R] in row order.

    `token_budget`/`group`: micro-batches by tokens, as many on every rank of the
    data-parallel `group` (micro_batching.py); columns trimmed away come back as 0 (padding).
    """
    parts = [(rows, response_logprobs(model, mb, temperature, chunk_tokens=chunk_tokens,
                                      remove_padding=remove_padding)[0])
             for rows, mb in micro_batches_of(inputs, micro_batch_size, token_budget, group)]
    return reassemble(parts, inputs["input_ids"].shape[0], inputs["response_mask"].shape[1])


def to_device(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if all(v.device == device for v in inputs.values()):
        return inputs
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
