"""Every transport backend implements its concern's small base; parts are chosen through registries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from verl_hpc.transport.rollouts.base import RolloutReceiver, RolloutSender
from verl_hpc.transport.rollouts.flight import RolloutFlightClient, RolloutFlightServer
from verl_hpc.transport.weights.base import SyncLinks, WeightReceiver, WeightSender
from verl_hpc.transport.weights.receiver import BucketReceiver
from verl_hpc.transport.weights.sender import BroadcastSender, GatherJoin, weight_sender


def test_the_flight_backend_implements_both_rollout_ends() -> None:
    assert issubclass(RolloutFlightClient, RolloutSender)
    assert issubclass(RolloutFlightServer, RolloutReceiver)
    with pytest.raises(TypeError):  # a backend that misses part of the contract cannot be made
        type("Half", (RolloutReceiver,), {"get": lambda self, timeout=None: None})()


def test_a_trainer_rank_gets_the_weight_sender_its_links_allow() -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    leader = weight_sender(model, optimizer, SyncLinks(group=object(), src=0))  # type: ignore[arg-type]
    assert isinstance(leader, BroadcastSender) and isinstance(leader, WeightSender)
    other = weight_sender(model, optimizer, SyncLinks(group=None, src=0))
    assert isinstance(other, GatherJoin)
    assert issubclass(BucketReceiver, WeightReceiver)


def test_engines_sinks_placements_and_step_kinds_are_registered_by_name() -> None:
    from verl_hpc.metrics.factory import SINKS
    from verl_hpc.roles.rollout.factory import ENGINES, build_engine, register_engine
    from verl_hpc.runtime.placement import PLACEMENTS
    from verl_hpc.runtime.step.kinds import STEP_KINDS

    assert {"hf", "vllm"} <= set(ENGINES)
    assert {"tensorboard", "prometheus", "wandb", "mlflow"} <= set(SINKS)
    assert {"colocated", "split"} <= set(PLACEMENTS)
    assert {"rl", "dpo"} <= set(STEP_KINDS) and not STEP_KINDS["dpo"].generates

    made = []
    register_engine("echo")(lambda *args, **kwargs: made.append(args[0].strategy) or "engine")
    try:
        resources = SimpleNamespace(strategy="echo")
        assert build_engine(resources, "dir", None, torch.device("cpu"), colocated=True, timeout=1.0) == "engine"
        assert made == ["echo"]
    finally:
        ENGINES.pop("echo")
