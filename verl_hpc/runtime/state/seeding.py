"""Where every random draw of a run comes from: one seed per (run seed, step, stream).

Why re-seed at every step instead of carrying generators: a resumed run (any placement,
any number of processes) then samples exactly what the uninterrupted run sampled without
having to restore every process's generator state; each process draws from its own
stream (its role rank), so no two processes share a sequence.
"""

from __future__ import annotations

import torch


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A distinct, reproducible seed per (run seed, step, stream)."""
    return (seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1)


def seed_all(value: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU) from one value."""
    import random

    import numpy as np

    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def reseed(seed: int, step: int, stream: int = 0) -> None:
    seed_all(step_seed(seed, step, stream))
