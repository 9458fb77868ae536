"""utils/collective: the reductions give gloo's answer and their tensors outlive the call."""

from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.utils import collective
from verl_hpc.utils.proc import exit_now


def _rank(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'init')}", rank=rank,
                            world_size=world)
    try:
        summed = collective.all_reduce_kept(torch.tensor([rank + 1.0, 10.0 * rank]))
        largest = collective.all_reduce_kept(torch.tensor([float(rank)]), dist.ReduceOp.MAX)
        sent = collective.broadcast_kept(torch.tensor([7 if rank == 1 else 0]), src=1)
        total = summed.tolist()
        watched = weakref.ref(summed)
        del summed
        gc.collect()
        kept_after_call = watched() is not None
        collective.keep_alive(*[torch.zeros(1) for _ in range(collective.KEPT)])
        gc.collect()
        result = {"sum": total, "largest": largest.tolist(), "sent": sent.tolist(),
                  "kept_after_call": kept_after_call, "released_later": watched() is None}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


def test_kept_reductions_agree_over_gloo_and_release_their_tensors_later(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["sum"] == [3.0, 10.0] and got["largest"] == [1.0] and got["sent"] == [7]
        assert got["kept_after_call"] and got["released_later"]


def test_keep_alive_holds_only_the_newest() -> None:
    first = torch.ones(1)
    watched = weakref.ref(first)
    collective.keep_alive(first)
    del first
    gc.collect()
    assert watched() is not None
    collective.keep_alive(*[torch.zeros(1) for _ in range(collective.KEPT)])
    gc.collect()
    assert watched() is None
