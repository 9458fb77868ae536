"""Who is stuck where: each rank records its phase and a liveness pulse so a timeout can
name a suspect.

Why: when one process hangs (a stopped node, a deadlocked engine), every other rank
times out in some collective with the same generic "Timed out waiting 60000ms" error,
and the first one to fail is rarely the culprit. Two signals tell the culprit apart:

* a *pulse*: a daemon thread on every rank refreshes a timestamp every second. Ranks
  blocked in a collective keep pulsing (the wait releases the GIL); a frozen process
  (SIGSTOP, a hung node, a GIL-holding deadlock) stops. The stalest pulse wins.
* a *phase*: `(phase, time)` written when a rank enters a phase. When every pulse is
  fresh (a live process stuck in a loop), the rank whose phase is oldest is named.

Phase times alone are not enough: all ranks enter a step's phases within milliseconds,
so a rank frozen in a short phase is indistinguishable by phase time from its waiters.
"""

from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

from verl_hpc.config.placement import ProcessPlan

_PHASE_KEY = "verl_hpc/phase/{rank}"
_PULSE_KEY = "verl_hpc/pulse/{rank}"
PULSE_SECONDS = 1.0
STALE_PULSES = 3  # a pulse this many intervals behind the freshest one means a frozen rank


class Heartbeat:
    def __init__(self, plan: ProcessPlan, rank: int, store: dist.Store | None):
        self.plan, self.rank, self.store = plan, rank, store
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def enter(self, phase: str) -> None:
        self._set(_PHASE_KEY, json.dumps([phase, time.time()]))

    def pulse(self) -> None:
        self._set(_PULSE_KEY, repr(time.time()))

    def _set(self, template: str, value: str) -> None:
        store = self.store
        if store is None:
            return
        try:
            store.set(template.format(rank=self.rank), value)
        except Exception:  # noqa: BLE001 - diagnostics never fail the run
            self.store = None

    def start(self, interval: float = PULSE_SECONDS) -> None:
        """Pulse from a daemon thread until `close` (or the process ends)."""
        def beat() -> None:
            while not self._stopped.is_set() and self.store is not None:
                self.pulse()
                self._stopped.wait(interval)

        self._thread = threading.Thread(target=beat, name="verl-hpc-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()

    def _read(self, template: str) -> dict[int, bytes] | None:
        if self.store is None:
            return None
        found = {}
        try:
            for rank in range(self.plan.world_size):
                key = template.format(rank=rank)
                if self.store.check([key]):
                    found[rank] = self.store.get(key)
        except Exception:  # noqa: BLE001 - the store lives in rank 0's process
            return None
        return found

    def describe_stall(self, settle: float = 0.0) -> str:
        """One line naming the suspect and every rank's last phase.

        `settle`: seconds to wait for a dead rank's pulse to go stale — a lost peer is
        noticed at once, before its silence shows; a timeout has waited long enough.
        """
        deadline = time.monotonic() + settle
        while True:
            line, frozen = self._describe()
            if frozen or time.monotonic() >= deadline:
                return line
            time.sleep(PULSE_SECONDS / 2)

    def _describe(self) -> tuple[str, bool]:
        phases, pulses = self._read(_PHASE_KEY), self._read(_PULSE_KEY)
        if phases is None or pulses is None:
            group = self.plan.locate(0)[0].name
            return f"suspect: {group} rank 0 (the rendezvous store in its process does not answer)", True
        entries = {rank: tuple(json.loads(raw)) for rank, raw in phases.items()}
        beats = {rank: float(raw) for rank, raw in pulses.items()}
        now = time.time()
        suspect, why = _suspect(self.plan.world_size, entries, beats, now)
        group = self.plan.locate(suspect)[0].name
        where = "; ".join(f"{self.plan.locate(r)[0].name} rank {r}: {p} ({now - t:.1f}s ago)"
                          for r, (p, t) in sorted(entries.items()))
        return f"suspect: {group} rank {suspect} ({why}); last phases: {where}", why.startswith("frozen")


def _suspect(world_size: int, entries: dict[int, tuple[str, float]], beats: dict[int, float],
             now: float) -> tuple[int, str]:
    """Never reported > stopped pulsing > oldest phase, in that order of evidence."""
    silent = [r for r in range(world_size) if r not in entries]
    if silent:
        return silent[0], "never reported a phase"
    if beats:
        freshest = max(beats.values())
        stalest = min(beats, key=lambda r: beats[r])
        if freshest - beats[stalest] > STALE_PULSES * PULSE_SECONDS:
            phase = entries[stalest][0]
            return stalest, f"frozen in '{phase}': no pulse for {now - beats[stalest]:.1f}s"
    oldest = min(entries, key=lambda r: entries[r][1])
    phase, stamp = entries[oldest]
    return oldest, f"stuck in '{phase}' for {now - stamp:.1f}s"


def is_timeout(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, TimeoutError) or "Timed out" in text or "timed out" in text


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "UNAVAILABLE", "Socket closed")


def is_peer_lost(err: BaseException) -> bool:
    """A collective or transfer failed because a peer process is gone (killed, crashed)."""
    return isinstance(err, ConnectionError) or any(marker in str(err) for marker in _PEER_LOST)


class StallError(RuntimeError):
    """A collective or transfer timed out; the message names the suspected rank."""
