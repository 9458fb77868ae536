"""The stall diagnosis names the rank whose phase stopped moving."""

from __future__ import annotations

import time

import torch.distributed as dist

from verl_hpc.config import ResourceConfig, RoleResources
from verl_hpc.config.placement import plan_processes
from verl_hpc.runtime.process.heartbeat import Heartbeat, is_peer_lost, is_timeout


def _plan():
    res = ResourceConfig(actor=RoleResources(device_ids=[0, 1]), rollout=RoleResources(device_ids=[2]),
                         placement="split")
    return plan_processes(res, needs_critic=False, needs_ref=False, reward_is_model=False)


def test_oldest_phase_is_the_suspect() -> None:
    store, plan = dist.HashStore(), _plan()
    beats = [Heartbeat(plan, rank, store) for rank in range(3)]
    beats[2].enter("step 4 gen")
    time.sleep(0.05)
    beats[0].enter("step 4 wait_rollout")
    beats[1].enter("step 4 wait_rollout")
    text = beats[0].describe_stall()
    assert text.startswith("suspect: rollout rank 2 (stuck in 'step 4 gen'")
    assert "trainer rank 1: step 4 wait_rollout" in text


def test_a_rank_that_never_reported_is_the_suspect() -> None:
    store, plan = dist.HashStore(), _plan()
    Heartbeat(plan, 0, store).enter("start")
    Heartbeat(plan, 2, store).enter("start")
    assert Heartbeat(plan, 0, store).describe_stall().startswith("suspect: trainer rank 1 (never reported")


def test_without_a_store_rank_zero_is_named() -> None:
    assert "trainer rank 0" in Heartbeat(_plan(), 1, None).describe_stall()


def test_timeout_errors_are_recognised() -> None:
    assert is_timeout(TimeoutError("x"))
    assert is_timeout(RuntimeError("[gloo] Timed out waiting 1000ms for recv operation to complete"))
    assert not is_timeout(RuntimeError("shape mismatch"))


def test_a_rank_that_stopped_pulsing_is_the_suspect_even_with_a_newer_phase() -> None:
    """A frozen rank entered its phase at the same moment as everyone else; its pulse tells."""
    store, plan = dist.HashStore(), _plan()
    beats = [Heartbeat(plan, rank, store) for rank in range(3)]
    beats[0].enter("step 8 wait_rollout")
    beats[1].enter("step 8 reward")
    beats[2].enter("step 8 gen")  # the newest phase: phase age alone would name rank 0
    for beat in beats:
        beat.pulse()
    store.set("verl_hpc/pulse/2", repr(time.time() - 10))  # rank 2 froze 10 s ago
    text = beats[1].describe_stall()
    assert text.startswith("suspect: rollout rank 2 (frozen in 'step 8 gen': no pulse for 1"), text


def test_pulse_thread_refreshes_until_closed() -> None:
    store, plan = dist.HashStore(), _plan()
    beat = Heartbeat(plan, 1, store)
    beat.start(interval=0.02)
    time.sleep(0.1)
    first = float(store.get("verl_hpc/pulse/1"))
    time.sleep(0.1)
    assert float(store.get("verl_hpc/pulse/1")) > first
    beat.close()
    time.sleep(0.1)
    frozen = float(store.get("verl_hpc/pulse/1"))
    time.sleep(0.1)
    assert float(store.get("verl_hpc/pulse/1")) == frozen


def test_lost_peers_are_recognised() -> None:
    assert is_peer_lost(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"))
    assert is_peer_lost(ConnectionResetError("reset"))
    assert not is_peer_lost(RuntimeError("shape mismatch"))
