"""ResourceAllocator: free-memory probes, and out-of-memory retries at a smaller micro-batch.

Why a retry is exact for training: an actor's optimizer step zeroes the gradients, runs
its micro-batches (each loss weighted by its share of the mini-batch, `micro_weight`),
then steps the optimizer once. An out-of-memory error inside that sequence leaves the
weights untouched, so the whole optimizer step can run again with micro-batches half as
big; gradient accumulation makes the result the same up to float summation order.
The smaller size is kept for later steps (memory that ran out once will run out again),
and checkpointed with the actor: a restart on the same resources starts at it.

For generation a retry cuts the prompts into smaller chunks: the run stays valid, but
sampling draws random numbers per chunk, so the samples are not those an undisturbed
run would have drawn.

Limit: within an FSDP world of several ranks, one rank's OOM strands the others inside
a collective; there the error is raised with the numbers instead (docs/elastic.md).

Test hook: `VERL_HPC_INJECT_OOM_AT=train:N` (or `generate:N`, or `N` for both) raises
torch's `OutOfMemoryError` whenever that phase is about to run a micro-batch (or
generation chunk) of N or more rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psutil
import torch

from verl_hpc.utils.logging import get_logger

log = get_logger("allocator")
INJECT_ENV = "VERL_HPC_INJECT_OOM_AT"
GIB = float(1 << 30)
T = TypeVar("T")


class OutOfMemoryAtFloor(RuntimeError):
    """Even the smallest allowed micro-batch does not fit; the message has the numbers."""


def free_memory(device: torch.device | str) -> tuple[float, float]:
    """(free, total) bytes where `device` computes: torch.cuda.mem_get_info, else host RAM."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        return float(free), float(total)
    memory = psutil.virtual_memory()
    return float(memory.available), float(memory.total)


def parse_injection(value: str) -> tuple[str | None, int | None]:
    """`train:64` -> ("train", 64); `64` -> (None, 64); empty -> no injection."""
    phase, _, size = value.strip().rpartition(":")
    if not size:
        return None, None
    if not size.isdigit():
        raise ValueError(f"{INJECT_ENV}={value!r}: expected PHASE:N or N, e.g. train:64")
    return phase or None, int(size)


class ResourceAllocator:
    """Per-phase micro-batch sizes that shrink on OOM, down to `floor`; counts the events."""

    def __init__(self, device: torch.device | str = "cpu", floor: int = 1, enabled: bool = True,
                 field: str = "trainer.min_micro_batch_size"):
        self.device, self.floor, self.enabled, self.field = torch.device(device), floor, enabled, field
        self.sizes: dict[str, int] = {}
        self.degrade_events = 0
        self.free_bytes, self.total_bytes = 0.0, 0.0
        self.inject_phase, self.inject_at = parse_injection(os.environ.get(INJECT_ENV, ""))

    def probe(self) -> dict[str, float]:
        """Before each step: how much memory this process's device has free."""
        self.free_bytes, self.total_bytes = free_memory(self.device)
        return {"memory/free_gb": self.free_bytes / GIB, "memory/total_gb": self.total_bytes / GIB}

    def size(self, phase: str, configured: int) -> int:
        return min(configured, self.sizes.get(phase, configured))

    def run(self, phase: str, configured: int, work: Callable[[int], T]) -> T:
        """`work(size)`, retried with half the size after an OOM, until it fits or the floor fails.

        `work` must be safe to repeat after a failure part-way through (an optimizer step
        that zeroes its gradients first; a generation).
        """
        size = self.size(phase, configured)
        while True:
            try:
                if self.inject_at is not None and self.inject_phase in (None, phase) and size >= self.inject_at:
                    raise torch.OutOfMemoryError(f"{INJECT_ENV}={self.inject_at}: injected at {phase} size {size}")
                return work(size)
            except torch.OutOfMemoryError as err:
                size = self._degrade(phase, size, err)

    def _degrade(self, phase: str, size: int, err: BaseException) -> int:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        free, total = free_memory(self.device)
        numbers = (f"{phase} ran out of memory at micro-batch {size}; {free / GIB:.2f} GiB free of "
                   f"{total / GIB:.2f} GiB on {self.device}")
        if not self.enabled or size <= self.floor:
            reason = "out-of-memory retries are off" if not self.enabled else f"{self.field}={self.floor} is the floor"
            raise OutOfMemoryAtFloor(f"{numbers}; {reason} (hint: lower {self.field}, shorten "
                                     "sampling.max_new_tokens, or give the role more memory)") from err
        smaller = max(self.floor, size // 2)
        self.sizes[phase] = smaller
        self.degrade_events += 1
        log.warning("%s: retrying at micro-batch %d (degrade event %d)", numbers, smaller, self.degrade_events)
        return smaller

    def state_dict(self) -> dict[str, Any]:
        """The sizes learned from OOMs: a restart on the same resources would only rediscover them."""
        return {"sizes": dict(self.sizes), "degrade_events": self.degrade_events}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sizes = {str(phase): int(size) for phase, size in state.get("sizes", {}).items()}
        self.degrade_events = int(state.get("degrade_events", 0))

    def metrics(self) -> dict[str, float]:
        out = {"resource/degrade_events": float(self.degrade_events)}
        out.update({f"resource/micro_batch_size/{phase}": float(size) for phase, size in sorted(self.sizes.items())})
        if self.total_bytes:
            out.update({"memory/free_gb": self.free_bytes / GIB,
                        "memory/total_gb": self.total_bytes / GIB})
        return out


def generate_guarded(engine, prompt_ids: list[list[int]], sampling, allocator: ResourceAllocator | None,
                     stop_token_ids: Sequence[int] = (), max_tokens: Sequence[int] | None = None):
    """`engine.generate`, retried in smaller chunks of prompts after an OOM (not bit-identical).

    `stop_token_ids` and per-prompt `max_tokens` (an agent turn's end tags and each episode's
    remaining budget) go with each chunk's own prompts.
    """
    from verl_hpc.roles.rollout.base import Generation

    def call(start: int, end: int) -> Generation:
        if not stop_token_ids and max_tokens is None:  # the single-turn call, as every engine takes it
            return engine.generate(prompt_ids[start:end], sampling)
        return engine.generate(prompt_ids[start:end], sampling, stop_token_ids=stop_token_ids,
                               max_tokens=None if max_tokens is None else list(max_tokens[start:end]))

    if allocator is None or not prompt_ids:
        return call(0, len(prompt_ids))

    def chunked(size: int) -> Generation:
        parts = [call(i, i + size) for i in range(0, len(prompt_ids), size)]
        return Generation([r for p in parts for r in p.response_ids], [lp for p in parts for lp in p.logprobs])

    return allocator.run("generate", len(prompt_ids), chunked)
