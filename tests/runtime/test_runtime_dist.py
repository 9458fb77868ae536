"""init_distributed with real processes (gloo on 127.0.0.1): groups, weight-sync groups, barriers.

One spawn of four processes runs every scenario (spawning costs seconds per process on a
small machine) and each rank writes what it saw to a JSON file; the tests read those.
The timed-out barrier runs last because a timeout leaves the control group unusable.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.config.placement import ProcessPlan, plan_processes
from verl_hpc.config.resources import ResourceConfig, RoleResources
from verl_hpc.runtime.process.dist import DistContext, DistTimeoutError, init_distributed, parse_failed_ranks
from verl_hpc.runtime.process.env import JobEnvironment, free_port

BARRIER_TIMEOUT_S = 2.0
SPAWN_DEADLINE_S = 60.0


def split_plan() -> ProcessPlan:
    resources = ResourceConfig(actor=RoleResources(device_ids=[0, 1]), rollout=RoleResources(device_ids=[0]),
                               reward=RoleResources(device_ids=[0]), placement="split")
    return plan_processes(resources, needs_critic=False, needs_ref=False, reward_is_model=True)



def local_env(rank: int, world: int, port: int) -> JobEnvironment:
    return JobEnvironment.from_env({"VERL_HPC_RANK": str(rank), "VERL_HPC_WORLD_SIZE": str(world),
                                    "VERL_HPC_LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": str(port)})


def wait_for_files(paths: list[Path], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not all(p.exists() for p in paths) and time.monotonic() < end:
        time.sleep(0.05)


def four_rank_worker(rank: int, port: int, out_dir: str) -> None:
    """Every scenario for one rank; results go to out_dir/rank<N>.json."""
    out = Path(out_dir)
    ctx = init_distributed(local_env(rank, 4, port), split_plan(), "gloo", timeout_seconds=120)
    result: dict = {"group": ctx.group.name, "rank_in_group": ctx.rank_in_group,
                    "roles": {r: ctx.is_role(r) for r in ("actor", "rollout", "reward")},
                    "sync_groups": sorted(ctx.sync_groups)}
    total = torch.tensor([float(ctx.rank_in_group)])
    dist.all_reduce(total, group=ctx.process_group)
    result["group_sum"] = total.item()
    for name in ("rollout", "reward"):
        if name in ctx.sync_groups:
            weights = torch.tensor([42.0, 7.0]) if rank == 0 else torch.zeros(2)
            dist.broadcast(weights, src=0, group=ctx.sync_groups[name])
            result[f"sync_{name}"] = weights.tolist()
    ctx.barrier("all_here", timeout_seconds=BARRIER_TIMEOUT_S)
    result["barrier_ok"] = True
    if ctx.is_role("reward"):
        # Never arrives: wait until the others have reported, then leave without a barrier.
        wait_for_files([out / f"rank{r}.json" for r in range(3)], SPAWN_DEADLINE_S)
    else:
        started = time.monotonic()
        try:
            ctx.barrier("reward_never_comes", timeout_seconds=BARRIER_TIMEOUT_S)
            result["timeout_error"] = None
        except DistTimeoutError as err:
            result["timeout_error"] = {"message": str(err), "missing": err.missing}
        result["timeout_elapsed_s"] = time.monotonic() - started
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # Rank 0 hosts the store: nobody leaves until everyone has used it.
    wait_for_files([out / f"rank{r}.json" for r in range(4)], SPAWN_DEADLINE_S)
    ctx.destroy()
    # Skip interpreter teardown: torch's takes seconds when four processes share two cores.
    os._exit(0)


def single_worker(_index: int, out_dir: str) -> None:
    plan = plan_processes(ResourceConfig(), needs_critic=False, needs_ref=False, reward_is_model=False)
    ctx = init_distributed(JobEnvironment.from_env({}), plan, "gloo", timeout_seconds=10)
    total = torch.tensor([5.0])
    dist.all_reduce(total, group=ctx.process_group)
    ctx.barrier("solo")
    result = {"group": ctx.group.name, "actor": ctx.is_role("actor"), "rollout": ctx.is_role("rollout"),
              "sum": total.item(), "sync_groups": sorted(ctx.sync_groups)}
    ctx.destroy()
    ctx.destroy()  # idempotent
    result["initialized_after"] = dist.is_initialized()
    (Path(out_dir) / "single.json").write_text(json.dumps(result))


def spawn(fn: Callable[..., None], nprocs: int, args: tuple) -> None:
    """Run workers in fresh processes; kill them all rather than hang the test run."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"workers still running after {SPAWN_DEADLINE_S} s")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("dist4")
    spawn(four_rank_worker, 4, (free_port(), str(out)))
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


def test_plan_for_the_split_layout() -> None:
    plan = split_plan()
    assert [(g.name, g.size) for g in plan.groups] == [("trainer", 2), ("rollout", 1), ("reward", 1)]


def test_each_rank_lands_in_its_group(four_ranks: dict[int, dict]) -> None:
    assert [four_ranks[r]["group"] for r in range(4)] == ["trainer", "trainer", "rollout", "reward"]
    assert [four_ranks[r]["rank_in_group"] for r in range(4)] == [0, 1, 0, 0]
    assert four_ranks[0]["roles"] == {"actor": True, "rollout": False, "reward": False}
    assert four_ranks[3]["roles"] == {"actor": False, "rollout": False, "reward": True}


def test_all_reduce_within_own_group(four_ranks: dict[int, dict]) -> None:
    # trainer: 0 + 1; rollout and reward hold one rank each.
    assert [four_ranks[r]["group_sum"] for r in range(4)] == [1.0, 1.0, 0.0, 0.0]


def test_sync_group_broadcast_reaches_rollout_and_reward(four_ranks: dict[int, dict]) -> None:
    assert four_ranks[0]["sync_groups"] == ["reward", "rollout"]
    assert four_ranks[1]["sync_groups"] == []
    assert four_ranks[2]["sync_rollout"] == [42.0, 7.0]
    assert four_ranks[3]["sync_reward"] == [42.0, 7.0]


def test_barrier_names_the_missing_reward_rank(four_ranks: dict[int, dict]) -> None:
    assert all(four_ranks[r]["barrier_ok"] for r in range(4))
    for rank in range(3):
        error = four_ranks[rank]["timeout_error"]
        assert error is not None, f"rank {rank} passed a barrier that rank 3 never entered"
        assert "reward" in error["message"] and "3" in error["message"], error["message"]
        assert error["missing"] == {"3": "reward"}
        assert four_ranks[rank]["timeout_elapsed_s"] < BARRIER_TIMEOUT_S + 4


def test_world_of_one(tmp_path: Path) -> None:
    spawn(single_worker, 1, (str(tmp_path),))
    result = json.loads((tmp_path / "single.json").read_text())
    assert result == {"group": "trainer", "actor": True, "rollout": True, "sum": 5.0, "sync_groups": [],
                      "initialized_after": False}


def test_world_size_mismatch_is_refused_before_rendezvous() -> None:
    env = local_env(0, 2, free_port())
    with pytest.raises(ValueError, match="plan needs 4"):
        init_distributed(env, split_plan(), "gloo", timeout_seconds=1)
    assert not dist.is_initialized()


def context_on_rank(rank: int) -> DistContext:
    """A DistContext without process groups: enough for the timeout diagnosis, no processes."""
    plan = split_plan()
    group, rank_in_group = plan.locate(rank)
    return DistContext(env=local_env(rank, 4, 29500), plan=plan, group=group, rank_in_group=rank_in_group,
                       groups={}, control_group=None, sync_groups={}, timeout_seconds=1.0)


def test_non_coordinator_names_a_missing_rank_zero_from_the_store() -> None:
    """Only rank 0 hears who failed; the others rely on the arrival record in the store."""
    store = dist.HashStore()
    store.append("k", "1 ")
    store.append("k", "3 ")
    ctx = context_on_rank(2)
    missing = ctx._missing_ranks("Rank 2 successfully reached monitoredBarrier, but ...", store, "k")
    assert missing == [0]
    message = ctx._timeout_message("step", 1.0, missing, "")
    assert "group 'trainer' (roles actor) rank(s) 0" in message and "on rank 2 (rollout)" in message


def test_unreachable_store_blames_rank_zero() -> None:
    class DeadStore:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("Connection reset by peer")

    ctx = context_on_rank(1)
    assert ctx._missing_ranks("Rank 1 successfully reached monitoredBarrier", DeadStore(), "k") is None
    assert "rank 0 (trainer) has probably died" in ctx._timeout_message("step", 1.0, None, "")


@pytest.mark.parametrize(("text", "ranks"), [
    ("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 3000 ms", [1, 3]),
    ("[Rank 0]: Rank 3 failed to pass monitoredBarrier in 3000 ms", [3]),
    ("Rank 2 successfully reached monitoredBarrier, but received errors while waiting", []),
])
def test_parse_failed_ranks(text: str, ranks: list[int]) -> None:
    assert parse_failed_ranks(text) == ranks


def test_nccl_groups_also_carry_cpu_tensors_over_gloo() -> None:
    from verl_hpc.runtime.process.dist import with_cpu_path

    assert with_cpu_path("nccl") == "cpu:gloo,cuda:nccl"  # metric means and flags are CPU tensors
    assert with_cpu_path("gloo") == "gloo"
