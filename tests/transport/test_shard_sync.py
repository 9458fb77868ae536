"""A sharded actor's direct weight sync (transport/weights/shard.py): every trainer rank sends its own
rows, the first rollout rank lays them out, the chain carries them on; bit for bit, twice."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.models.tiny import PRESETS, build_model
from verl_hpc.transport.weights.gather import rows_of
from verl_hpc.utils.proc import exit_now


@pytest.mark.parametrize("shape,world", [((10, 3), 3), ((2, 5), 3), ((7,), 2), ((8, 2, 2), 4), ((1, 4), 2)])
def test_each_rank_holds_fsdp2s_rows_and_together_they_cover_the_tensor(shape: tuple[int, ...], world: int) -> None:
    pieces = [rows_of(torch.Size(shape), world, r) for r in range(world)]
    per_rank = -(-shape[0] // world)
    for r, (first, _) in enumerate(pieces):
        assert first == r * per_rank * math.prod(shape[1:])  # torch.chunk's rows, as FSDP2 shards them
    covered = [i for first, count in pieces for i in range(first, first + count)]
    assert covered == list(range(math.prod(shape)))  # in order, no gap, no overlap


def test_a_rank_past_the_last_row_holds_nothing() -> None:
    assert rows_of(torch.Size([2, 5]), 3, 2) == (10, 0)


def _rank(rank: int, world: int, trainers: int, port: int, out: str) -> None:
    from verl_hpc.config import ResourceConfig, RoleResources
    from verl_hpc.config.placement import plan_processes
    from verl_hpc.roles.fsdp import shard_model
    from verl_hpc.runtime.process.dist import init_distributed
    from verl_hpc.runtime.process.env import JobEnvironment
    from verl_hpc.transport.weights.bucketed import receive_weights, send_header, send_plan
    from verl_hpc.transport.weights.flat import flatten_params
    from verl_hpc.transport.weights.shard import ShardReceiver, send_shards, shard_sendable
    from verl_hpc.utils.dtensor import full_tensor

    torch.set_num_threads(1)
    res = ResourceConfig(actor=RoleResources(device_ids=list(range(trainers)), strategy="fsdp"),
                         rollout=RoleResources(device_ids=list(range(trainers, world))), placement="split")
    plan = plan_processes(res, needs_critic=False, needs_ref=False, reward_is_model=False)
    env = JobEnvironment.from_env({"VERL_HPC_RANK": str(rank), "VERL_HPC_WORLD_SIZE": str(world),
                                   "VERL_HPC_LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
    ctx = init_distributed(env, plan, "gloo", 300)
    spec = PRESETS["tiny"]
    trains = rank < trainers
    model = build_model(spec, spec.vocab_size, pad_id=0, eos_id=1, seed=0 if trains else 1 + rank)
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    bucket_bytes = 4096  # small buckets: single parameters and packed runs both
    if trains:
        shard_model(model, ctx.process_group, "cpu")
        assert shard_sendable(model) and ctx.shard_link is not None and ctx.shard_links is None
    shards = ShardReceiver([s for _, s in shapes], ctx.shard_links) if ctx.shard_links is not None else None
    into = None if trains else flatten_params(model)
    for version in (3, 4):
        if trains:
            if version == 4:  # new weights: the kept pack and stage buffers must not replay the old ones
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-0.5)
            if rank == 0:
                send_header(model, ctx.sync_groups["rollout"], 0, version)
            sent = send_shards(model, send_plan(model, bucket_bytes), ctx.shard_link)  # type: ignore[arg-type]
            full = {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
            if rank == 0:
                torch.save({"params": full, "sent": sent}, os.path.join(out, f"actor{version}.pt"))
        else:
            got, tensors = receive_weights(shapes, ctx.sync_groups["rollout"], 0, bucket_bytes, into=into,
                                           relay=ctx.weight_relay, shards=shards)
            received = {name: tensor.clone() for name, tensor in tensors}
            torch.save({"version": got, "params": received}, os.path.join(out, f"rollout{rank}_{version}.pt"))
    dist.barrier()
    ctx.destroy()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


@pytest.mark.parametrize("trainers,receivers", [(3, 1), (2, 2)])
def test_every_trainer_rank_sends_its_rows_and_each_rollout_rank_gets_the_whole_model(
        tmp_path: Path, trainers: int, receivers: int) -> None:
    from verl_hpc.runtime.process.env import free_port

    world = trainers + receivers
    mp.start_processes(_rank, args=(world, trainers, free_port(), str(tmp_path)), nprocs=world,
                       start_method="spawn", join=True)
    for version in (3, 4):
        actor = torch.load(tmp_path / f"actor{version}.pt", weights_only=True)
        total = sum(t.numel() * t.element_size() for t in actor["params"].values())
        assert actor["sent"] < total  # rank 0 sent its rows, not the model
        for r in range(trainers, world):
            rollout = torch.load(tmp_path / f"rollout{r}_{version}.pt", weights_only=True)
            assert rollout["version"] == version
            assert list(rollout["params"]) == list(actor["params"])
            for name, value in actor["params"].items():
                assert torch.equal(rollout["params"][name], value), (r, version, name)


def _header_only(rank: int, init: str, out: str) -> None:
    from verl_hpc.transport.weights.bucketed import WeightSyncError, receive_weights, send_header

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    spec = PRESETS["tiny"]
    model = build_model(spec, spec.vocab_size, pad_id=0, eos_id=1, seed=0)
    if rank == 0:
        send_header(model, dist.group.WORLD, 0, 5)  # "every trainer rank sends its rows"
    else:
        try:
            receive_weights([(n, p.shape) for n, p in model.named_parameters()], dist.group.WORLD, 0)
            Path(out).write_text("received")
        except WeightSyncError as err:
            Path(out).write_text(str(err))
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)


def test_a_rollout_rank_with_no_link_to_the_trainer_ranks_refuses_their_rows(tmp_path: Path) -> None:
    """The header says who sends: a first rollout rank that cannot take W streams says so, before any data."""
    out = tmp_path / "result.txt"
    mp.start_processes(_header_only, args=(str(tmp_path / "init"), str(out)), nprocs=2, start_method="spawn",
                       join=True)
    assert out.read_text() == "the trainer ranks send their own rows, but this rank has no link to them"
