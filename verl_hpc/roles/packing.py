"""Padding removal (`model.remove_padding`): a micro-batch's sequences packed into fewer rows.

Why: a rollout micro-batch is padded to its longest prompt plus its longest response, and
every pad token costs a full pass through every layer (verl's `use_remove_padding`). Here
each row's real tokens (one contiguous span: prompts are left-padded, responses
right-padded) are packed first-fit-decreasing into rows of the longest span's length, with
`position_ids` restarting at 0 for each sequence and no attention mask. Transformers then
masks attention block-diagonally, so no token sees another sequence's (SDPA and eager build
that mask from the positions; flash-attention's varlen kernel uses them directly). The
outputs the losses need, the ones predicting each response token, are gathered back into
the padded `[B, R, ...]` layout, so everything after the forward is unchanged.

Attention over a packed row costs its length squared, as a padded row does; the saving is
in the rows: fewer of them, and every layer's matmuls run over real tokens only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """A micro-batch's tokens packed into rows, and where each response token's predictor landed."""

    input_ids: torch.Tensor     # [rows, width]
    position_ids: torch.Tensor  # [rows, width], restarting at 0 per sequence
    gather: torch.Tensor        # [B * R]: flat index into rows * width of the position predicting each token

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices per bin, longest first into the first bin with room: a pure function."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[index] <= free:
                bins[b].append(index)
                room[b] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(capacity - lengths[index])
    return bins


def pack(inputs: dict[str, torch.Tensor]) -> PackedRows | None:
    """The packed layout of `inputs`, or None when it would not save a row (or spans are not contiguous)."""
    mask = inputs["attention_mask"].bool()
    batch, width = mask.shape
    resp_len = inputs["response_mask"].shape[1]
    lengths = mask.sum(1)
    starts = mask.int().argmax(1)
    if bool((mask.int().flip(1).argmax(1) != width - starts - lengths).any()) or bool((lengths == 0).any()):
        return None  # a row whose real tokens have a gap, or none: keep the padded layout
    capacity = int(lengths.max())
    bins = first_fit_decreasing(lengths.tolist(), capacity)
    if len(bins) == batch and capacity == width:
        return None
    device = inputs["input_ids"].device
    ids = torch.zeros(len(bins), capacity, dtype=inputs["input_ids"].dtype, device=device)
    positions = torch.zeros(len(bins), capacity, dtype=torch.long, device=device)
    offsets = torch.zeros(batch, dtype=torch.long)
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            n, s = int(lengths[i]), int(starts[i])
            ids[b, at:at + n] = inputs["input_ids"][i, s:s + n]
            positions[b, at:at + n] = torch.arange(n, device=device)
            offsets[i] = b * capacity + at
            at += n
        positions[b, at:] = torch.arange(capacity - at, device=device)  # the tail: a sequence of its own
    # Response token j of row i sits at padded column width - R + j; its predictor one column before.
    predictor = torch.arange(width - resp_len - 1, width - 1).expand(batch, -1) - starts[:, None]
    valid = predictor < lengths[:, None]
    gather = torch.where(valid, offsets[:, None] + predictor, torch.zeros_like(predictor))
    return PackedRows(ids, positions, gather.reshape(-1).to(device))


def packed_response_outputs(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                            inputs: dict[str, torch.Tensor], packed: PackedRows) -> torch.Tensor:
    """`forward(input_ids, position_ids)` over the packed rows, gathered to `[B, R, X]`.

    Positions of padding (past a row's response) read the first packed output: finite,
    masked out by `response_mask` as the padded path's pad outputs are.
    """
    batch, resp_len = inputs["response_mask"].shape
    out = forward(packed.input_ids, packed.position_ids)
    flat = out.reshape(-1, out.shape[-1])
    return flat.index_select(0, packed.gather).view(batch, resp_len, -1)
