"""Small host-memory collectives whose tensors outlive the call by a few more collectives.

Why: a gloo collective's work object, and with it references to the tensors, is finished
and released on gloo's own threads, after the waiting Python call has already returned.
A tensor the caller drops at once can then be freed while that thread still touches it
(pytorch/pytorch#75529, the race behind #75528's workaround). Twice in CI, never here,
a trainer rank that dropped such tensors at once died later in an unrelated collective:
"malloc(): unaligned tcache chunk detected" in the weight gather (hence `gather_only`'s
held tensor), then SIGSEGV and SIGABRT after the step metrics became all-reduced partials
(a few more such reductions per step). Every per-step scalar reduction of the runtime goes
through here, so its tensors stay referenced until `KEPT` later ones have been made:
by then every collective they took part in has long completed on every thread.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

KEPT = 32  # tensors of a few bytes each: the last steps' reductions
_recent: deque[torch.Tensor] = deque(maxlen=KEPT)


def keep_alive(*tensors: torch.Tensor) -> None:
    """Hold `tensors` until `KEPT` newer ones have been held."""
    _recent.extend(tensors)


def all_reduce_kept(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`dist.all_reduce` in place on `tensor` (returned), which is then kept alive a while."""
    dist.all_reduce(tensor, op=op, group=group)
    keep_alive(tensor)
    return tensor


def broadcast_kept(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`dist.broadcast` in place on `tensor` (returned; `src` is a global rank), then kept alive a while."""
    dist.broadcast(tensor, src=src, group=group)
    keep_alive(tensor)
    return tensor
