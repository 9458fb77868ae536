"""Which rows of a step's batch each data-parallel rank holds: one layout for every role.

Why one pure function: the numbers of a step must not depend on the placement. A row's
place in the step is fixed (`group_id * n + sample_index`) and the optimizer's global
mini-batch k is always rows [k*m, (k+1)*m). Rank r of W holds the r-th W-th of every
mini-batch, so its k-th local mini-batch is exactly its part of the global one, and one
process (W = 1) simply holds everything in order. Trainer ranks, a critic group and a
reference group each apply it with their own W.
"""

from __future__ import annotations

import numpy as np


def rank_rows(batch_size: int, mini_batch_size: int, world: int, rank: int) -> list[int]:
    """Global row positions rank `rank` of `world` holds, mini-batch after mini-batch."""
    if batch_size % mini_batch_size or mini_batch_size % world:
        raise ValueError(f"a batch of {batch_size} in mini-batches of {mini_batch_size} cannot be split "
                         f"evenly over {world} ranks")
    per_rank = mini_batch_size // world
    rows: list[int] = []
    for start in range(0, batch_size, mini_batch_size):
        first = start + rank * per_rank
        rows.extend(range(first, first + per_rank))
    return rows


def row_position(group_id: int, sample_index: int, group_size: int) -> int:
    return group_id * group_size + sample_index


def even_slices(total: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous [start, end) of `total` items for part `index` of `parts` (sizes differ by ≤ 1)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def row_owner(position: np.ndarray, batch_size: int, mini_batch_size: int, world: int) -> np.ndarray:
    """The rank of `world` that holds each row `position` under `rank_rows` (its inverse).

    What a producer needs to send each row straight to the rank that trains it."""
    del batch_size  # every mini-batch is laid out alike: the position within one decides
    return (np.asarray(position) % mini_batch_size) // (mini_batch_size // world)


def even_owner(index: np.ndarray, total: int, parts: int) -> np.ndarray:
    """The part of `parts` whose `even_slices` range holds each item `index` of `total`."""
    index = np.asarray(index)
    base, extra = divmod(total, parts)
    cut = extra * (base + 1)  # the first `extra` parts hold base + 1 items each
    return np.where(index < cut, index // (base + 1), extra + (index - cut) // max(base, 1))
