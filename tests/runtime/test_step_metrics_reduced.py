"""Step metrics from reductions over trainer ranks equal the metrics of the whole batch.

Why: the trainer no longer gathers every rank's rows on rank 0 to compute `data_metrics`;
each rank reduces partials of its own rows (`data_metrics_reduced`). These tests split one
batch into uneven parts — with all-padding rows, a part with no valid token, a part with no
row at all — run one "rank" per part and check that every key matches `data_metrics` of
the whole batch: with threads standing in for the collectives, and with a real gloo world
using the placement's own all-reduce reducers.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.runtime.step.metrics import data_metrics, data_metrics_reduced
from verl_hpc.utils.proc import exit_now

MAX_NEW_TOKENS = 6
Batch = tuple[torch.Tensor, dict[str, torch.Tensor]]


def random_batch(rows: int = 23, seed: int = 0, dtype: torch.dtype = torch.float64,
                 critic: bool = True) -> Batch:
    """Scores and the step's tensors: ragged prompts and responses, some responses empty."""
    gen = torch.Generator().manual_seed(seed)
    prompt_width, width = 5, MAX_NEW_TOKENS
    prompt_lens = torch.randint(1, prompt_width + 1, (rows,), generator=gen)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    lengths[::5] = 0  # responses that are all padding
    mask = (torch.arange(width) < lengths[:, None]).to(dtype)
    prompt_mask = (torch.arange(prompt_width) >= (prompt_width - prompt_lens)[:, None]).long()
    inputs = {"response_mask": mask, "attention_mask": torch.cat([prompt_mask, mask.long()], dim=1),
              "advantages": torch.randn(rows, width, generator=gen, dtype=dtype),
              # returns far from zero next to their spread: a one-pass variance would lose digits
              "returns": 50.0 + torch.randn(rows, width, generator=gen, dtype=dtype),
              "token_rewards": torch.randn(rows, width, generator=gen, dtype=dtype)}
    if critic:
        inputs["values"] = inputs["returns"] + 0.3 * torch.randn(rows, width, generator=gen, dtype=dtype)
    return torch.randn(rows, generator=gen, dtype=dtype), inputs


def split(batch: Batch, cuts: list[int]) -> list[Batch]:
    """The batch's rows cut at `cuts` (a cut may repeat: a part without rows)."""
    scores, inputs = batch
    bounds = [0, *cuts, scores.shape[0]]
    return [(scores[a:b], {k: v[a:b] for k, v in inputs.items()}) for a, b in zip(bounds, bounds[1:], strict=False)]


def expected(batch: Batch) -> dict[str, float]:
    scores, inputs = batch
    return {**data_metrics(scores, inputs, MAX_NEW_TOKENS),
            "perf/total_num_tokens": float(inputs["attention_mask"].sum())}


class ThreadCollectives:
    """All-reduce stand-ins for `world` threads: each call waits for every rank's tensor."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls: list[int] = [0] * world

    def reducer(self, rank: int, op: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            assert tensor.dim() == 1 and tensor.dtype == torch.float64 and tensor.device.type == "cpu"
            self.calls[rank] += 1
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            out = op(torch.stack(self.slots))  # type: ignore[arg-type]
            self.barrier.wait()  # every rank has read the slots before any rank refills them
            return out
        return reduce


def reduced_over(parts: list[Batch]) -> tuple[list[dict[str, float]], list[int]]:
    """`data_metrics_reduced` on each part, one thread per part, as trainer ranks would run it."""
    group = ThreadCollectives(len(parts))
    results: list[dict[str, float] | BaseException | None] = [None] * len(parts)

    def rank_main(rank: int) -> None:
        scores, inputs = parts[rank]
        try:
            results[rank] = data_metrics_reduced(scores, inputs, MAX_NEW_TOKENS,
                                                 group.reducer(rank, lambda s: s.sum(dim=0)),
                                                 group.reducer(rank, lambda s: s.amax(dim=0)))
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            results[rank] = err
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results, group.calls  # type: ignore[return-value]


def assert_matches(got: dict[str, float], want: dict[str, float], rel: float) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=1e-12), key


CUTS = {1: [], 2: [9], 3: [4, 17]}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("critic", [True, False], ids=["ppo", "grpo"])
def test_reductions_over_uneven_parts_equal_the_whole_batch(world: int, critic: bool) -> None:
    batch = random_batch(critic=critic)
    results, calls = reduced_over(split(batch, CUTS[world]))
    want = expected(batch)
    assert ("critic/vf_explained_var" in want) == critic
    for got in results:  # every rank gets the same numbers (only the leader logs them)
        assert_matches(got, want, rel=1e-9)
    assert calls == [3 if critic else 2] * world  # sums and maxima packed: one reduction each (+ variances)


def test_a_rank_without_valid_tokens_or_rows() -> None:
    """Its minima and maxima are -inf partials, its sums zero: the others' numbers stand."""
    scores, inputs = random_batch(rows=12, seed=1)
    inputs["response_mask"][:5] = 0
    inputs["attention_mask"][:, -MAX_NEW_TOKENS:][:5] = 0
    batch = (scores, inputs)
    results, _ = reduced_over(split(batch, [5, 5]))  # rows 0-4: no valid token; then a rank with no rows
    for got in results:
        assert_matches(got, expected(batch), rel=1e-9)


def test_no_valid_token_anywhere_leaves_out_the_masked_stats() -> None:
    scores, inputs = random_batch(rows=7, seed=2)
    inputs["response_mask"].zero_()
    inputs["attention_mask"][:, -MAX_NEW_TOKENS:] = 0
    want = expected((scores, inputs))
    assert "critic/advantages/mean" not in want
    for got in reduced_over(split((scores, inputs), [3]))[0]:
        assert_matches(got, want, rel=1e-9)


def test_explained_variance_keeps_masked_vars_bessel_correction() -> None:
    """With variances near its 1e-8 guard the n / (n - 1) correction no longer cancels in the ratio."""
    scores, inputs = random_batch(seed=4)
    inputs["returns"] = 50.0 + 1e-4 * (inputs["returns"] - 50.0)
    noise = torch.randn(inputs["returns"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    inputs["values"] = inputs["returns"] + 1e-4 * noise
    batch = (scores, inputs)
    want = expected(batch)
    assert abs(want["critic/vf_explained_var"]) < 0.9  # the guard is not negligible here
    for got in reduced_over(split(batch, [8, 8, 20]))[0]:
        assert_matches(got, want, rel=1e-9)


def test_float32_inputs_agree_to_float32_rounding() -> None:
    """The trainer's tensors are float32: the reductions run in float64, `data_metrics` in float32."""
    batch = random_batch(seed=3, dtype=torch.float32)
    for got in reduced_over(split(batch, [6, 15]))[0]:
        assert_matches(got, expected(batch), rel=1e-5)


# --- a real gloo world -------------------------------------------------------------------------------

GLOO_CUTS = [10]


def _gloo_rank(rank: int, world: int, out: str) -> None:
    from verl_hpc.runtime.placement.collectives import GroupCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'init')}", rank=rank,
                            world_size=world)
    try:
        scores, inputs = split(random_batch(), GLOO_CUTS)[rank]
        placement = SimpleNamespace(world=world, ctx=SimpleNamespace(process_group=None))  # the default group

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            return GroupCollectives.reduce_sum(placement, t)  # type: ignore[arg-type]

        def reduce_max(t: torch.Tensor) -> torch.Tensor:
            return GroupCollectives.reduce_max(placement, t)  # type: ignore[arg-type]

        got = data_metrics_reduced(scores, inputs, MAX_NEW_TOKENS, reduce_sum, reduce_max)
        torch.save(got, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


@pytest.mark.slow
def test_gloo_all_reduce_equals_the_whole_batch(tmp_path: Path) -> None:
    world = len(GLOO_CUTS) + 1
    ctx = mp.start_processes(_gloo_rank, args=(world, str(tmp_path)), nprocs=world, join=False,
                             start_method="spawn")
    start = time.monotonic()
    while not ctx.join(timeout=1):
        if time.monotonic() - start > 120:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the gloo ranks did not finish within 120 s (deadlock?)")
    want = expected(random_batch())
    for rank in range(world):
        assert_matches(torch.load(tmp_path / f"rank{rank}.pt"), want, rel=1e-9)
