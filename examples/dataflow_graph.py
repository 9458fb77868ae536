"""A `Dataflow` stage graph, turned into verl-hpc's `resources` and applied to a run config.

Why this example: a user may declare the RL loop as `Dataflow` stages and edges; verl-hpc runs
a fixed pipeline placed by `resources`. This shows the translation twice: the graph as
declared (GPUs and a vLLM rollout, for a cluster node), then the same graph forced onto
CPU and applied to `configs/quickstart_split.yaml`, which is what runs on a laptop.
Then it trains the placed graph for a few steps (5 processes on this machine) and prints
where the run went; `--dry-run` stops after printing.

    python3 examples/dataflow_graph.py            # any python3: it re-runs itself in ./.venv
    python3 examples/dataflow_graph.py --dry-run --steps 20
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart_split.yaml"


def _in_project_env() -> None:
    """Re-run under the project's virtualenv when this interpreter does not have verl_hpc."""
    try:
        import verl_hpc  # noqa: F401
        return
    except ImportError:
        pass
    venv_python = REPO / ".venv" / "bin" / "python"
    if not venv_python.exists():
        raise SystemExit("verl_hpc is not installed: run `bash tools/install.sh` in the repository first")
    os.execv(str(venv_python), [str(venv_python), *sys.argv])


_in_project_env()
import verl_hpc  # noqa: E402
from verl_hpc import Dataflow  # noqa: E402
from verl_hpc.config import dump_config  # noqa: E402
from verl_hpc.config.placement import plan_for_config  # noqa: E402


def declared_flow(rollout_strategy: str = "vllm") -> Dataflow:
    """Rollout, reward and actor in a ring (the weight sync closes it); the rollout engine is the argument."""
    flow = Dataflow()
    flow.add_stage("rollout", num_workers=1, num_gpus_per_worker=1, strategy=rollout_strategy)
    flow.add_stage("reward", num_workers=2, num_gpus_per_worker=0)
    flow.add_stage("actor", num_workers=2, num_gpus_per_worker=1)
    flow.connect("rollout", "reward")
    flow.connect("reward", "actor")
    flow.connect("actor", "rollout")  # weight sync
    return flow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the graph and its resources; train nothing")
    parser.add_argument("--steps", type=int, default=3, help="training steps of the placed graph (default 3)")
    parser.add_argument("--run-dir", default="runs/dataflow_graph", help="where the run goes")
    args = parser.parse_args(argv)
    declared = declared_flow()
    print("== The graph as declared (a GPU node) ==")
    print(declared.describe())
    print("\nresources:")
    print(dump_config(declared.to_resources()))

    # vLLM is checked when a run config is loaded; without it, generate with Hugging Face.
    engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    local = declared_flow(engine)
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
    if args.dry_run:
        return 0
    # Train with the shipped config's engine: the tiny model's head size (24) is not one vLLM's
    # CPU attention supports, so the graph's vLLM rollout stays a declaration here.
    placed = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"rollout": rollout})})
    cfg = verl_hpc.load_config(data=placed.model_dump(by_alias=True),
                               overrides=[f"trainer.total_steps={args.steps}", "logging.progress=lines"])
    result = verl_hpc.HybridTrainer(config=cfg, run_dir=args.run_dir).train()
    print(f"trained the declared graph for {result.steps} steps in {result.run_dir}: "
          f"critic/score/mean {result.last_metrics.get('critic/score/mean', float('nan')):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
