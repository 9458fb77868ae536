"""An agent episode's KV cache kept between its turns, so a turn prefills only what was added since.

Why: an episode's next turn continues from its last context, the turn it just sampled and the
inserted tool or environment reply. HF `generate` keeps no cache between calls, so every turn
prefilled the whole context again. For SmolLM2 with six worked calls in each prompt (~850 tokens)
and ~20 model tokens a turn, the second turn's prefill cost more than all of its decoding
(`python -m bench agent_step`).

How: after a call, each row's keys and values at its real tokens (the prompt's and the sampled ones
the model has read, never a pad) are kept with those token ids. The next call finds, for each prompt,
a kept row whose ids begin it, and hands `generate` a cache of those rows right-aligned
(`[pad | kept]`, pads masked) and input ids `[gap | new ids]` (gap masked). A masked position is
never attended, and `generate` numbers positions by counting unmasked tokens, so every real token
sits where a fresh prefill puts it: the numbers are a fresh prefill's up to float rounding (which
the batch's composition changes anyway).

Only plain `DynamicLayer` caches are kept (a sliding-window layer holds the last tokens only);
anything else prefills as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KeptRow:
    """One row's cache: `keys[layer]` and `values[layer]` are `[heads, len(ids), head_dim]`."""

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class PrefixBatch:
    """What `generate` is given: ids and mask over `[cached | new]` columns, and the cache (None: none kept)."""

    input_ids: torch.Tensor
    attention: torch.Tensor
    cache: object | None
    kept_lengths: list[int]   # each row's tokens already in the cache
    new_lengths: list[int]    # each row's tokens fed in this call
    cached_width: int         # C: the cache's columns; the new ids take the next D columns


def keepable(cache: object) -> bool:
    """A cache whose every layer is HF's plain `DynamicLayer` (all tokens kept, in order)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers before per-layer caches: nothing is kept
        return False
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.keys is not None for layer in layers)


class PrefixStore:
    """Kept rows awaiting their episode's next turn; each is used once, by the prompt it begins."""

    def __init__(self) -> None:
        self.rows: list[KeptRow] = []
        self.reused_tokens = 0  # tokens the kept rows spared a prefill
        self.fed_tokens = 0     # tokens prefilled

    def take(self, prompt: list[int]) -> KeptRow | None:
        """The longest kept row that `prompt` strictly extends, removed from the store."""
        best = None
        for row in self.rows:
            n = len(row.ids)
            if n < len(prompt) and (best is None or n > len(best.ids)) and prompt[n - 1] == row.ids[-1] \
                    and prompt[:n] == row.ids:
                best = row
        if best is not None:
            self.rows.remove(best)
        return best

    def assemble(self, prompts: list[list[int]], pad_id: int) -> PrefixBatch:
        """The call's inputs: kept rows for the prompts that extend one, a fresh prefill for the rest."""
        batch = prefix_batch(prompts, [self.take(p) for p in prompts], pad_id)
        self.reused_tokens += sum(batch.kept_lengths)
        self.fed_tokens += sum(batch.new_lengths)
        return batch

    def keep(self, cache: object, batch: PrefixBatch, prompts: list[list[int]],
             responses: list[list[int]]) -> None:
        """Each row's real tokens from the call's final cache: its prompt and the sampled ids it read.

        The cache holds every column the model read: `[cached | new | generated]`, where the
        generated ones stop one short of the last sampled token (never fed back) and, for a row
        that stopped early, go on with pads it never sampled; only the tokens of `responses`
        (what the caller got back) are kept.
        """
        if not keepable(cache):
            return
        layers = cache.layers  # type: ignore[attr-defined]
        start_new = batch.cached_width
        start_gen = start_new + max(batch.new_lengths)
        read = layers[0].keys.shape[2] - start_gen  # generated tokens the model read
        seen = [min(len(r), read) for r in responses]
        columns = [torch.cat([torch.arange(start_new - n, start_new), torch.arange(start_gen - m, start_gen),
                              torch.arange(start_gen, start_gen + k)]).to(layers[0].keys.device)
                   for n, m, k in zip(batch.kept_lengths, batch.new_lengths, seen, strict=True)]
        kept = [KeptRow([*p, *r[:k]], [], []) for p, r, k in zip(prompts, responses, seen, strict=True)]
        for layer in layers:  # a layer at a time, each freed once copied: never two whole caches at once
            for row, (cols, out) in enumerate(zip(columns, kept, strict=True)):
                out.keys.append(layer.keys[row].index_select(1, cols))
                out.values.append(layer.values[row].index_select(1, cols))
            layer.keys = layer.values = None  # the call's cache is not read again
        self.rows.extend(kept)


def prefix_batch(prompts: list[list[int]], kept: list[KeptRow | None], pad_id: int) -> PrefixBatch:
    """Each prompt as `[pad | its kept row's ids | gap | the rest]`, pads and gap masked; with nothing
    kept that is plain left padding, the layout of every call outside `episode_cache()`."""
    kept_lengths = [0 if k is None else len(k.ids) for k in kept]
    new_lengths = [len(p) - n for p, n in zip(prompts, kept_lengths, strict=True)]
    cached, width = max(kept_lengths), max(new_lengths)
    input_ids = torch.full((len(prompts), cached + width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, (prompt, n, m) in enumerate(zip(prompts, kept_lengths, new_lengths, strict=True)):
        input_ids[row, cached - n:cached] = torch.as_tensor(prompt[:n], dtype=torch.long)
        attention[row, cached - n:cached] = 1
        input_ids[row, cached + width - m:] = torch.as_tensor(prompt[n:], dtype=torch.long)
        attention[row, cached + width - m:] = 1
    cache = _right_aligned_cache(kept, cached) if cached else None
    return PrefixBatch(input_ids, attention, cache, kept_lengths, new_lengths, cached)


def _right_aligned_cache(kept: list[KeptRow | None], width: int) -> object:
    """A `DynamicCache` of `width` columns: each kept row at the right, zeros (masked) before it."""
    from transformers import DynamicCache

    sample = next(k for k in kept if k is not None)
    data = []
    for layer in range(len(sample.keys)):
        heads, _, dim = sample.keys[layer].shape
        like = sample.keys[layer]
        keys = like.new_zeros((len(kept), heads, width, dim))
        values = like.new_zeros((len(kept), heads, width, dim))
        for row, k in enumerate(kept):
            if k is not None:
                n = len(k.ids)
                keys[row, :, width - n:] = k.keys[layer]
                values[row, :, width - n:] = k.values[layer]
                k.keys[layer] = k.values[layer] = None  # type: ignore[assignment]  # freed once copied
        data.append((keys, values))
    return DynamicCache(ddp_cache_data=data)
