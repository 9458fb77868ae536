"""roles/fsdp.full_tensor gathers FSDP2's host-memory shards itself (one synchronous all-gather):
bit for bit DTensor's own `full_tensor`, for uneven row counts and for 2 and 3 ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.models.tiny import PRESETS, build_model


def _rank(rank: int, world: int, out: str) -> None:
    from verl_hpc.roles.fsdp import full_tensor, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'init')}", rank=rank,
                            world_size=world)
    try:
        spec = PRESETS["tiny"]
        model = shard_model(build_model(spec, spec.vocab_size, pad_id=0, eos_id=1, seed=0), dist.group.WORLD, "cpu")
        checked, uneven = 0, 0
        for name, param in model.named_parameters():
            mine, theirs = full_tensor(param.detach()), param.detach().full_tensor()
            assert mine.shape == theirs.shape and torch.equal(mine, theirs), name
            checked += 1
            uneven += int(param.shape[0] % world != 0)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"checked": checked, "uneven": uneven}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_own_gather_equals_dtensor_full_tensor(tmp_path: Path, world: int) -> None:
    mp.start_processes(_rank, args=(world, str(tmp_path)), nprocs=world, join=True, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["checked"] > 10 for r in results)
    if world == 3:
        assert results[0]["uneven"] > 0  # rows not divisible by 3: the padding is exercised
