"""The sender's transfers in flight: posted broadcasts, the bytes they hold, and when to wait.

Why apart from weight_sync.py: how many transfers ride at once is one decision (bounded by
bytes for a sender that gathers or packs, unbounded for one that sends views of its live
weights, which then must not change until they have crossed), and both the sender and the
runtime's optimizer hook (`weight_sender.py`) need it without the rest of the sync.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Once:
    """A posted transfer that may be waited for twice (a packing buffer's last reader is
    also in the window): the second `wait()` returns at once."""

    def __init__(self, work: Any):
        self.work, self.done = work, False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True


def transfer(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> Once:
    """Post one transfer (async): a broadcast from `src` over `group`."""
    return Once(dist.broadcast(tensor, src=src, group=group, async_op=True))


class Window:
    """Transfers posted and not yet known to be done, oldest first, with the bytes they hold.

    Posting waits for the oldest ones while more than `limit` bytes would ride at once:
    that bounds what an FSDP sender's gathered tensors cost, and lets a packing buffer be
    reused once the transfer that last read it has finished.
    """

    def __init__(self, group: dist.ProcessGroup | None, src: int, limit: float,
                 data_group: dist.ProcessGroup | None = None):
        self.group, self.src, self.limit = group, src, limit
        self.data_group = data_group or group  # the chain's first link (weight_relay.py), else the sync group
        self.works: deque[tuple[Any, int]] = deque()
        self.bytes = 0

    def post(self, tensor: torch.Tensor, header: bool = False) -> Any:
        """One bucket down the data group; `header`: over the whole sync group (STOP must reach all)."""
        nbytes = tensor.numel() * tensor.element_size()
        while self.works and self.bytes + nbytes > self.limit:
            self._finish_oldest()
        if self.group is None:
            return None
        work = transfer(tensor, self.src, self.group if header else self.data_group)
        self.works.append((work, nbytes))
        self.bytes += nbytes
        return work

    def drain(self) -> None:
        while self.works:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, nbytes = self.works.popleft()
        work.wait()
        self.bytes -= nbytes


class SyncInFlight:
    """A sender's buckets still crossing: `wait()` before the parameters they view may change.

    Why: a flat sender (`flatten_sender`) sends views of the live parameters, so nothing
    has to stay in memory for the transfer, and the trainer may go on with the next step
    while the rollout ranks take the weights; only the next optimizer step must wait for
    it (the split runtime hooks that step), or the engines would get a torn mix.
    """

    def __init__(self, window: Window | None = None):
        self._window = window

    @property
    def pending(self) -> bool:
        return self._window is not None and bool(self._window.works)

    def wait(self, timeout: timedelta | None = None) -> None:
        """Until every bucket has crossed; `timeout` (at shutdown, when the receivers may be
        gone) bounds each transfer's wait, else the group's own timeout does."""
        window, self._window = self._window, None
        while window is not None and window.works:
            posted, _ = window.works.popleft()
            if timeout is None:
                posted.wait()
            else:
                posted.work.wait(timeout=timeout)
