"""The seeds' stage graph, turned into verl-hpc's `resources` and applied to a run config.

Why this example: seeds declare the RL loop as `Dataflow` stages and edges; verl-hpc runs
a fixed pipeline placed by `resources`. This shows the translation twice: the graph as
declared (GPUs and a vLLM rollout, for a cluster node), then the same graph forced onto
CPU and applied to `configs/quickstart_split.yaml`, which is what runs on a laptop.
It only prints; nothing is trained.

    python examples/seed_dataflow.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import verl_hpc
from verl_hpc import Dataflow
from verl_hpc.config import dump_config
from verl_hpc.config.placement import plan_for_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart_split.yaml"


def seed_flow(rollout_strategy: str = "vllm") -> Dataflow:
    """The seeds' declaration, verbatim apart from the rollout engine."""
    flow = Dataflow()
    flow.add_stage("rollout", num_workers=1, num_gpus_per_worker=1, strategy=rollout_strategy)
    flow.add_stage("reward", num_workers=2, num_gpus_per_worker=0)
    flow.add_stage("actor", num_workers=2, num_gpus_per_worker=1)
    flow.connect("rollout", "reward")
    flow.connect("reward", "actor")
    flow.connect("actor", "rollout")  # weight sync
    return flow


def main() -> int:
    declared = seed_flow()
    print("== The seed graph as declared (a GPU node) ==")
    print(declared.describe())
    print("\nresources:")
    print(dump_config(declared.to_resources()))

    # vLLM is checked when a run config is loaded; without it, generate with Hugging Face.
    engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    local = seed_flow(engine)
    cfg = local.apply(verl_hpc.load_config(CONFIG), device_type="cpu")
    print(f"== The same graph on CPU (rollout strategy {engine}), applied to {CONFIG.relative_to(REPO)} ==")
    print(local.describe(device_type="cpu"))
    print("\nresources:")
    print(dump_config(cfg.resources))
    shipped = verl_hpc.load_config(CONFIG).resources
    rollout = cfg.resources.rollout.model_copy(update={"strategy": shipped.rollout.strategy,  # the engine aside
                                                       "vllm_args": shipped.rollout.vllm_args})
    same = cfg.resources.actor == shipped.actor and rollout == shipped.rollout
    print(f"actor and rollout identical to the shipped config's: {same}")
    groups = ", ".join(f"{g.name} x{g.size}" for g in plan_for_config(cfg).groups)
    print(f"process groups: {groups}; the reward group runs {cfg.reward.function}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
