"""The `Dataflow` facade: stage graphs become the ResourceConfig the runtime places.

Why these tests: the facade is a declared graph's entry point to placement, so a wrong device id
or a silently accepted edge would run a different job than the one declared. Each test
pins one translation rule or one rejection (with the words a user needs to fix it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import verl_hpc
from verl_hpc import Dataflow
from verl_hpc.config import ResourceConfig, RunConfig, load_config
from verl_hpc.config.placement import plan_for_config

REPO = Path(__file__).resolve().parents[1]
SPLIT = REPO / "configs" / "quickstart_split.yaml"


def declared_flow(rollout_strategy: str = "vllm") -> Dataflow:
    """Rollout, reward and actor in a ring, as the `Dataflow` docs declare it."""
    flow = Dataflow()
    flow.add_stage("rollout", num_workers=1, num_gpus_per_worker=1, strategy=rollout_strategy)
    flow.add_stage("reward", num_workers=2, num_gpus_per_worker=0)
    flow.add_stage("actor", num_workers=2, num_gpus_per_worker=1)
    flow.connect("rollout", "reward")
    flow.connect("reward", "actor")
    flow.connect("actor", "rollout")
    return flow


def test_declared_example_gives_expected_resources() -> None:
    res = declared_flow().to_resources()
    assert isinstance(res, ResourceConfig)
    assert (res.actor.device_type, res.actor.device_ids, res.actor.strategy) == ("cuda", [0, 1], "fsdp")
    assert (res.rollout.device_type, res.rollout.device_ids, res.rollout.strategy) == ("cuda", [2], "vllm")
    assert res.rollout.vllm_args is None
    assert res.reward is not None
    assert (res.reward.device_type, res.reward.device_ids, res.reward.strategy) == ("cpu", [0, 1], "data_parallel")
    assert res.critic is None and res.ref is None
    assert res.placement == "split"
    assert res.resolved_backend() == "nccl"


def test_declaration_order_does_not_change_ids_and_calls_chain() -> None:
    flow = (Dataflow().add_stage("reward", num_workers=2).add_stage("rollout", num_gpus_per_worker=1)
            .add_stage("critic", num_workers=2, num_gpus_per_worker=1)
            .add_stage("actor", num_workers=2, num_gpus_per_worker=1)
            .add_stage("ref", num_gpus_per_worker=1))
    assert flow.connect("critic", "actor") is flow
    res = flow.to_resources()
    assert res.actor.device_ids == [0, 1]
    assert res.critic is not None and res.critic.device_ids == [2, 3] and res.critic.strategy == "fsdp"
    assert res.ref is not None and res.ref.device_ids == [4] and res.ref.strategy == "hf"
    assert res.rollout.device_ids == [5] and res.rollout.strategy == "hf"
    assert res.reward is not None and res.reward.device_ids == [0, 1]


def test_strategy_defaults() -> None:
    flow = (Dataflow().add_stage("actor").add_stage("rollout").add_stage("reward")
            .add_stage("critic", num_workers=1))
    res = flow.to_resources()
    assert res.actor.strategy == "hf" and res.actor.device_type == "cpu"
    assert res.rollout.strategy == "hf"
    assert res.reward is not None and res.reward.strategy == "none"
    assert res.critic is not None and res.critic.strategy == "hf"


def test_colocated_rollout_shares_the_actor_devices() -> None:
    flow = (Dataflow().add_stage("actor", num_workers=2, num_gpus_per_worker=1)
            .add_stage("rollout", strategy="vllm", colocate_with="actor")
            .connect("actor", "rollout").connect("rollout", "actor"))
    res = flow.to_resources()
    assert res.placement == "colocated" and flow.placement == "colocated"
    assert (res.rollout.device_type, res.rollout.device_ids, res.rollout.strategy) == ("cuda", [0, 1], "vllm")
    assert res.actor.device_ids == [0, 1]
    with pytest.raises(ValueError, match="one worker in each of the actor's 2"):
        (Dataflow().add_stage("actor", num_workers=2, num_gpus_per_worker=1)
         .add_stage("rollout", num_workers=3, colocate_with="actor").to_resources())
    with pytest.raises(ValueError, match="only rollout, critic, ref may be colocated"):
        Dataflow().add_stage("reward", colocate_with="actor")


def test_colocated_cpu_flow_runs_in_the_trainer_group() -> None:
    flow = Dataflow().add_stage("actor", num_workers=2).add_stage("rollout", colocate_with="actor")
    cfg = flow.apply(load_config(SPLIT))
    assert cfg.resources.placement == "colocated" and cfg.resources.rollout.device_ids == [0, 1]
    plan = plan_for_config(cfg)
    assert [g.name for g in plan.groups] == ["trainer"]
    assert "rollout" in plan.groups[0].roles and plan.world_size == 2


def test_bad_stage_name() -> None:
    with pytest.raises(ValueError, match=r"unknown stage 'policy'.*actor, critic, ref, reward, rollout"):
        Dataflow().add_stage("policy")
    with pytest.raises(ValueError, match="did you mean 'rollout'"):
        Dataflow().add_stage("rollouts")


def test_duplicate_stage_rejected() -> None:
    flow = Dataflow().add_stage("actor")
    with pytest.raises(ValueError, match="'actor' is already declared"):
        flow.add_stage("actor", num_workers=2)


def test_bad_edges_rejected() -> None:
    flow = declared_flow()
    with pytest.raises(ValueError, match=r"fixed pipeline.*no reward -> rollout step"):
        flow.connect("reward", "rollout")
    with pytest.raises(ValueError, match=r"did you mean connect\('reward', 'actor'\)"):
        flow.connect("actor", "reward")
    with pytest.raises(ValueError, match="no rollout -> rollout step"):
        flow.connect("rollout", "rollout")
    with pytest.raises(ValueError, match="did you mean connect"):
        Dataflow().add_stage("actor").add_stage("ref").connect("actor", "ref")
    with pytest.raises(ValueError, match="stage 'critic' is not declared"):
        flow.connect("critic", "actor")
    with pytest.raises(ValueError, match="unknown stage"):
        flow.connect("actor", "learner")
    flow.connect("rollout", "reward")  # repeating a valid edge records it once
    assert flow.edges == (("rollout", "reward"), ("reward", "actor"), ("actor", "rollout"))


def test_gpus_per_worker_rules() -> None:
    with pytest.raises(ValueError, match=r"'actor': num_gpus_per_worker=2.*num_workers=4"):
        Dataflow().add_stage("actor", num_workers=2, num_gpus_per_worker=2)
    with pytest.raises(ValueError, match="strategy='vllm'"):
        Dataflow().add_stage("rollout", num_gpus_per_worker=2)
    with pytest.raises(ValueError, match="tensor parallel"):
        Dataflow().add_stage("rollout", num_gpus_per_worker=2, strategy="vllm", colocate_with="actor")
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        Dataflow().add_stage("actor", num_workers=0)
    with pytest.raises(ValueError, match="num_gpus_per_worker must be 0"):
        Dataflow().add_stage("actor", num_gpus_per_worker=-1)
    flow = (Dataflow().add_stage("actor", num_workers=2, num_gpus_per_worker=1)
            .add_stage("rollout", num_workers=2, num_gpus_per_worker=2, strategy="vllm"))
    res = flow.to_resources()
    assert res.rollout.device_ids == [2, 3, 4, 5]
    assert res.rollout.vllm_args is not None and res.rollout.vllm_args.tensor_parallel_size == 2


def test_device_type_cpu_override() -> None:
    res = declared_flow().to_resources(device_type="cpu")
    for role in (res.actor, res.rollout, res.reward):
        assert role is not None and role.device_type == "cpu"
    assert res.actor.device_ids == [0, 1] and res.rollout.device_ids == [2]
    assert res.reward is not None and res.reward.device_ids == [3, 4]
    assert res.rollout.strategy == "vllm" and res.resolved_backend() == "gloo"
    with pytest.raises(ValueError, match="device_type must be None"):
        declared_flow().to_resources(device_type="tpu")


def test_apply_to_quickstart_split() -> None:
    base = load_config(SPLIT)
    cfg = declared_flow("hf").apply(base, device_type="cpu")
    assert isinstance(cfg, RunConfig)
    assert cfg.resources.actor == base.resources.actor and cfg.resources.rollout == base.resources.rollout
    assert cfg.resources.timeout_seconds == 60 and cfg.resources.placement == "split"
    assert cfg.reward.function == base.reward.function
    assert cfg.trainer == base.trainer and cfg.algorithm == base.algorithm
    plan = plan_for_config(cfg)
    # The reward stage is a reward group: the rule function, data-parallel over 2 processes.
    assert [(g.name, g.size) for g in plan.groups] == [("trainer", 2), ("rollout", 1), ("reward", 2)]
    assert cfg.resources.reward is not None and cfg.resources.reward.strategy == "data_parallel"
    from verl_hpc.config import dump_config

    assert load_config(data=cfg.model_dump(mode="json", by_alias=True)) == cfg
    assert "placement: split" in dump_config(cfg.resources)


def test_apply_accepts_a_dict_and_runs_run_config_checks() -> None:
    raw = verl_hpc.config.read_yaml(SPLIT)
    cfg = declared_flow("hf").apply(raw, device_type="cpu")
    assert cfg.resources.reward is not None and cfg.resources.reward.device_ids == [3, 4]
    bad = Dataflow().add_stage("actor", num_workers=3).add_stage("rollout")
    with pytest.raises(ValueError, match="resources.actor.device_ids"):
        bad.apply(raw)  # 3 actor processes cannot split a mini-batch of 128


def test_slurm_keywords_go_to_role_resources() -> None:
    flow = (Dataflow().add_stage("actor", num_workers=2, num_gpus_per_worker=1, nodes=2, partition="gpu",
                                 account="proj", gpus_per_node=1)
            .add_stage("rollout", num_gpus_per_worker=1, qos="high"))
    res = flow.to_resources()
    assert (res.actor.nodes, res.actor.partition, res.actor.account, res.actor.gpus_per_node) == (2, "gpu", "proj", 1)
    assert res.rollout.qos == "high"
    with pytest.raises(ValueError, match="did you mean 'partition'"):
        Dataflow().add_stage("actor", partiton="gpu")
    with pytest.raises(ValueError, match="devices are assigned by to_resources"):
        Dataflow().add_stage("actor", device_ids=[3])
    with pytest.raises(ValueError, match="resources.actor.nodes"):
        Dataflow().add_stage("actor", nodes=0)


def test_invalid_strategy_and_missing_roles() -> None:
    with pytest.raises(ValueError, match=r"strategy 'vllm' is not valid for the actor role; use one of fsdp, hf"):
        Dataflow().add_stage("actor", strategy="vllm")
    with pytest.raises(ValueError, match="missing: rollout"):
        Dataflow().add_stage("actor").to_resources()
    with pytest.raises(ValueError, match="missing: actor"):
        Dataflow().add_stage("rollout", colocate_with="actor").to_resources()
    with pytest.raises(ValueError, match="colocated with an actor on CPU"):
        (Dataflow().add_stage("actor").add_stage("rollout", num_gpus_per_worker=1, colocate_with="actor")
         .to_resources())


def test_describe_is_readable() -> None:
    text = declared_flow().describe()
    assert "placement split" in text
    assert "actor    2 worker(s) x 1 GPU, cuda [0, 1], strategy fsdp" in text
    assert "rollout  1 worker(s) x 1 GPU, cuda [2], strategy vllm" in text
    assert "reward   2 worker(s) x CPU, cpu [0, 1], strategy data_parallel" in text
    assert "actor -> rollout" in text and "weight sync" in text
    assert "cpu (forced) [0, 1]" in declared_flow().describe(device_type="cpu")
    partial = Dataflow().add_stage("rollout", colocate_with="actor").describe()
    assert "devices not assigned" in partial and "no actor stage" in partial
    assert "missing (required by the pipeline): actor" in partial
    assert repr(declared_flow()) == ("Dataflow(stages=[rollout, reward, actor], "
                                 "edges=[rollout->reward, reward->actor, actor->rollout])")


def test_example_script_runs() -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "examples/dataflow_graph.py", "--dry-run"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "placement: split" in result.stdout
    assert "actor and rollout identical to the shipped config's: True" in result.stdout
    assert "process groups: trainer x2, rollout x1, reward x2" in result.stdout


@pytest.mark.slow
def test_example_runs_with_a_plain_python_and_trains(tmp_path: Path) -> None:
    """Not only the venv's python: a bare python3 re-runs it in ./.venv; then the placed graph trains."""
    import shutil

    plain = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "/usr/bin/python3"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    result = subprocess.run([plain, str(REPO / "examples" / "dataflow_graph.py"), "--steps", "2",
                             "--run-dir", str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trained the declared graph for 2 steps in {tmp_path / 'run'}" in result.stdout
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()
