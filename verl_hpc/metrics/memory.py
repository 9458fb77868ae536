"""Memory gauges under `memory/`: host RSS now and at its peak, device memory on a GPU, and each
stage's own peak.

Why both host figures: the peak says whether a step fits the node; the current value,
step after step, is the trend that shows a leak (tests/e2e/soak.py fits its slope).

Why per stage: a step's peak is set by one of its stages (generation, a log-prob pass, the
update), and the memory plan (roles/memory/) estimates each of them; measuring each one is
what tells a wrong estimate from a wrong guess about which stage peaks. Linux keeps a
process's resident high-water mark (VmHWM) and lets the process reset it (writing 5 to
`/proc/self/clear_refs`), so a stage's peak is read exactly, without sampling. `PhaseProbe`
folds the mark into every open stage before each reset, so nested stages (the step, the
update inside it) each get their own peak, and it keeps the run's peak for
`memory/peak_rss_gb`. On a GPU the CUDA allocator's peak is reset the same way.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterator

import psutil
import torch

GIB = float(1 << 30)
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def read_hwm() -> int | None:
    """This process's resident high-water mark in bytes (Linux), None where it cannot be read."""
    try:
        with open(_STATUS, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _maxrss_bytes() -> int:
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak_kb if sys.platform == "darwin" else peak_kb * 1024


class PhaseProbe:
    """Peak memory per stage (`stage(name)` nests) and over the run, for this process and its GPU."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.run_peak = 0                          # host bytes, over the whole run
        self.device_run_peak = (0, 0)              # CUDA (allocated, reserved) bytes, over the whole run
        self.peaks: dict[str, int] = {}            # stage -> host (or device) bytes, this step
        self._open: dict[str, int] = {}
        self.resettable = read_hwm() is not None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def _fold(self) -> None:
        """The peak since the last reset, into every open stage and the run; then reset."""
        host = read_hwm() if self.resettable else _maxrss_bytes()
        host = host or 0
        self.run_peak = max(self.run_peak, host, _maxrss_bytes() if not self.resettable else 0)
        now = host
        if self.on_cuda:
            now = int(torch.cuda.max_memory_allocated(self.device))
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            self.device_run_peak = (max(self.device_run_peak[0], now), max(self.device_run_peak[1], reserved))
        for name in self._open:
            self._open[name] = max(self._open[name], now)
        if self.resettable:
            self.resettable = _reset_hwm()
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._fold()
        self._open[name] = 0
        try:
            yield
        finally:
            self._fold()
            self.peaks[name] = max(self.peaks.get(name, 0), self._open.pop(name))

    def take(self) -> dict[str, float]:
        """This step's stage peaks (`memory/peak_gb/<stage>`, the step's as `memory/step_peak_gb`); resets them."""
        out = {f"memory/peak_gb/{name}": value / GIB for name, value in self.peaks.items() if name != "step"}
        if "step" in self.peaks:
            out["memory/step_peak_gb"] = self.peaks["step"] / GIB
        self.peaks = {}
        return out

    def run_peak_bytes(self) -> int:
        self._fold()
        return self.run_peak


_PROBES: list[PhaseProbe] = []


def process_probe(device: torch.device | str = "cpu") -> PhaseProbe:
    """The one probe of this process (the high-water mark is the process's: one reader resets it)."""
    if not _PROBES:
        _PROBES.append(PhaseProbe(device))
    return _PROBES[0]


def memory_metrics(device: torch.device) -> dict[str, float]:
    probe = _PROBES[0] if _PROBES else None
    peak_bytes = probe.run_peak_bytes() if probe is not None else _maxrss_bytes()
    out = {"memory/peak_rss_gb": peak_bytes / GIB, "memory/rss_gb": psutil.Process().memory_info().rss / GIB}
    if device.type == "cuda" and torch.cuda.is_available():
        max_allocated = torch.cuda.max_memory_allocated(device)
        max_reserved = torch.cuda.max_memory_reserved(device)
        if probe is not None:  # its resets cut the allocator's own peaks into stages
            max_allocated, max_reserved = (max(a, b) for a, b in zip(probe.device_run_peak,
                                                                      (max_allocated, max_reserved), strict=True))
        out["memory/allocated_gb"] = torch.cuda.memory_allocated(device) / GIB
        out["memory/reserved_gb"] = torch.cuda.memory_reserved(device) / GIB
        out["memory/max_allocated_gb"] = max_allocated / GIB
        out["memory/max_reserved_gb"] = max_reserved / GIB
    return out
