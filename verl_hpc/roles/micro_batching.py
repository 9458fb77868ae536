"""Micro-batches by a token budget (`algorithm.use_dynamic_bsz`), trimmed to their own padding.

Why: a fixed number of rows per forward pays for the longest prompt and the longest response
of the whole batch in every micro-batch. When rows are grouped by length and each group is
cut down to its own longest prompt and response, a pass costs what its tokens cost. With a
budget on `rows x (longest prompt + longest response)`, the largest activation of a pass is
bounded whatever the lengths. This is verl's `use_dynamic_bsz` / `ppo_max_token_len_per_gpu`.

The gradient is unchanged: a micro-batch's weight is its share of the mini-batch's tokens (or
rows), whichever rows it holds, and the trimmed columns are padding, which no mask counts.
Under FSDP every rank must run as many forwards as the others (each is a collective), so the
number of micro-batches is the largest of the data-parallel group's, and the ranks with fewer
split their largest groups until they match.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from verl_hpc.utils.collective import all_reduce_kept

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")  # [B, prompt + response] columns


class MicroBatchingError(RuntimeError):
    """The data-parallel ranks cannot run the same number of micro-batches."""


def row_lengths(inputs: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """(prompt tokens, response tokens) per row, from the attention mask of `model_inputs`' layout."""
    response_width = inputs["response_mask"].shape[1]
    attention = inputs["attention_mask"]
    prompt_width = attention.shape[1] - response_width
    prompts = attention[:, :prompt_width].sum(dim=1).tolist()
    responses = attention[:, prompt_width:].sum(dim=1).tolist()
    return [int(p) for p in prompts], [int(r) for r in responses]


def padded_cost(rows: list[int], prompts: list[int], responses: list[int]) -> int:
    """Tokens a trimmed micro-batch of `rows` computes: rows x (longest prompt + longest response)."""
    return len(rows) * (max(prompts[i] for i in rows) + max(max(responses[i] for i in rows), 1))


def token_budget_groups(prompts: list[int], responses: list[int], budget: int) -> list[list[int]]:
    """Rows grouped longest first, each group's padded cost within `budget` (a longer row goes alone).

    Rows inside a group keep their batch order, so a group's results are laid out like a slice.
    """
    order = sorted(range(len(prompts)), key=lambda i: (-(prompts[i] + responses[i]), i))
    groups: list[list[int]] = []
    for row in order:
        if groups and padded_cost([*groups[-1], row], prompts, responses) <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return [sorted(group) for group in groups]


def split_to(groups: list[list[int]], count: int, prompts: list[int], responses: list[int]) -> list[list[int]]:
    """`groups` cut into exactly `count`: the costliest group of two rows or more is halved each time."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            raise MicroBatchingError(f"{sum(map(len, groups))} rows cannot make {count} micro-batches to match "
                                     "the other data-parallel ranks; give every rank as many rows")
        worst = max(splittable, key=lambda i: padded_cost(groups[i], prompts, responses))
        group = groups.pop(worst)
        half = len(group) // 2
        groups[worst:worst] = [group[:half], group[half:]]
    return groups


def agreed_count(count: int, group: dist.ProcessGroup | None) -> int:
    """The largest micro-batch count of the data-parallel group (one small all-reduce)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return count
    box = torch.tensor([count], dtype=torch.int64)
    all_reduce_kept(box, dist.ReduceOp.MAX, group)
    return int(box)


def plan_rows(inputs: dict[str, torch.Tensor], size: int, token_budget: int | None,
              group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Row indices per micro-batch: slices of `size` rows, or groups within `token_budget` tokens."""
    total = inputs["input_ids"].shape[0]
    if token_budget is None:
        return [list(range(start, min(start + size, total))) for start in range(0, total, size)]
    prompts, responses = row_lengths(inputs)
    groups = token_budget_groups(prompts, responses, token_budget)
    return split_to(groups, agreed_count(len(groups), group), prompts, responses)


def take(inputs: dict[str, torch.Tensor], rows: list[int], trim: bool) -> dict[str, torch.Tensor]:
    """The micro-batch of `rows`; with `trim`, only its own longest prompt and response columns."""
    contiguous = rows == list(range(rows[0], rows[-1] + 1))
    index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows)
    picked = {k: v[index] for k, v in inputs.items()}
    if not trim:
        return picked
    response_width = inputs["response_mask"].shape[1]
    prompt_width = inputs["input_ids"].shape[1] - response_width
    prompts, responses = row_lengths(picked)
    keep_prompt, keep_response = max(prompts), max(max(responses), 1)
    columns = slice(prompt_width - keep_prompt, prompt_width + keep_response)
    for key, value in picked.items():
        if key in INPUT_KEYS:
            picked[key] = value[:, columns]
        elif value.dim() >= 2 and value.shape[1] == response_width:
            picked[key] = value[:, :keep_response]
    return picked


def micro_batches_of(inputs: dict[str, torch.Tensor], size: int, token_budget: int | None = None,
                     group: dist.ProcessGroup | None = None) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """(rows, micro-batch) pairs; token-budget micro-batches come trimmed."""
    for rows in plan_rows(inputs, size, token_budget, group):
        yield rows, take(inputs, rows, trim=token_budget is not None)


def reassemble(parts: list[tuple[list[int], torch.Tensor]], rows: int, width: int) -> torch.Tensor:
    """[rows, width] from per-micro-batch [len(rows_i), width_i] results; trimmed columns are 0."""
    first = parts[0][1]
    out = first.new_zeros((rows, width))
    for indices, part in parts:
        out[torch.tensor(indices), :part.shape[1]] = part
    return out
