"""Who is stuck where: each rank records its current phase so a timeout can name a suspect.

Why: when one process hangs (a stopped node, a deadlocked engine), every other rank
times out in some collective with the same generic "Timed out waiting 60000ms" error,
and the first one to fail is rarely the culprit. Each rank writes `(phase, time)` to
the rendezvous store when it enters a phase; whoever times out first reads everyone's
entry and names the rank whose entry is oldest — the one that stopped making progress.
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from verl_hpc.config.placement import ProcessPlan

_KEY = "verl_hpc/phase/{rank}"


class Heartbeat:
    def __init__(self, plan: ProcessPlan, rank: int, store: dist.Store | None):
        self.plan, self.rank, self.store = plan, rank, store

    def enter(self, phase: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(_KEY.format(rank=self.rank), json.dumps([phase, time.time()]))
        except Exception:  # noqa: BLE001 - diagnostics never fail the run
            self.store = None

    def _entries(self) -> dict[int, tuple[str, float]] | None:
        if self.store is None:
            return None
        entries = {}
        try:
            for rank in range(self.plan.world_size):
                key = _KEY.format(rank=rank)
                if self.store.check([key]):
                    phase, stamp = json.loads(self.store.get(key))
                    entries[rank] = (phase, stamp)
        except Exception:  # noqa: BLE001 - the store lives in rank 0's process
            return None
        return entries

    def describe_stall(self) -> str:
        """One line naming the suspect (oldest phase) and every rank's last phase."""
        entries = self._entries()
        if entries is None:
            group = self.plan.locate(0)[0].name
            return f"suspect: {group} rank 0 (the rendezvous store in its process does not answer)"
        now = time.time()
        silent = [r for r in range(self.plan.world_size) if r not in entries]
        if silent:
            suspect, why = silent[0], "never reported a phase"
        else:
            suspect = min(entries, key=lambda r: entries[r][1])
            phase, stamp = entries[suspect]
            why = f"stuck in '{phase}' for {now - stamp:.1f}s"
        group = self.plan.locate(suspect)[0].name
        where = "; ".join(f"{self.plan.locate(r)[0].name} rank {r}: {p} ({now - t:.1f}s ago)"
                          for r, (p, t) in sorted(entries.items()))
        return f"suspect: {group} rank {suspect} ({why}); last phases: {where}"


def is_timeout(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, TimeoutError) or "Timed out" in text or "timed out" in text


class StallError(RuntimeError):
    """A collective or transfer timed out; the message names the suspected rank."""
