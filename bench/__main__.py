"""`python -m bench NAME [--quick]`: run one benchmark, print its table, save its JSON.

Why a tiny runner of our own: each benchmark is a module with `run(quick) -> dict` and
`table(result) -> str` (a real-model variant: `run(quick, model=...)`); results land in
bench/results/<name>.json (<name>-quick.json for --quick) so runs on different machines can
be compared file to file. `all` runs every
benchmark in turn (CI runs `python -m bench all --quick` as a smoke test). Every result
carries `ratios`: {name: {median, min, max}} — the numbers the docs quote.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

BENCHMARKS = {"step": "bench.step", "memory": "bench.memory", "checkpoint": "bench.checkpoint",
              "preemption": "bench.preemption", "transport": "bench.transport", "weight_sync": "bench.weight_sync",
              "agent_step": "bench.agent_step", "env_step": "bench.env_step"}
# Not in `all`: minutes of a local Slurm cluster (`preemption --slurm`), and the real-model step (a built
# SmolLM2, TRL's venv, minutes: `step --model smollm2`), the plan's estimate per model (SmolLM2 at 512 tokens). "module:model" runs the module with `model=`.
OPT_IN = {"preemption_slurm": "bench.preemption_slurm", "step_smollm2": "bench.step:smollm2",
          "plan_estimate": "bench.plan_estimate"}
# `--model NAME` picks a benchmark's real-model variant: (benchmark, model) -> the name above.
MODEL_VARIANTS = {("step", "smollm2"): "step_smollm2"}
RESULTS = Path(__file__).resolve().parent / "results"


def run_one(name: str, quick: bool, scratch: str | None, results: Path = RESULTS) -> Path:
    """Run benchmark `name`, print its table, write its JSON; returns the JSON's path."""
    module_name, _, model = {**BENCHMARKS, **OPT_IN}[name].partition(":")
    module = importlib.import_module(module_name)
    start = time.perf_counter()
    result = module.run(quick=quick, scratch=scratch, **({"model": model} if model else {}))
    result["benchmark"], result["quick"] = name, quick
    result["wall_s"] = time.perf_counter() - start
    result["machine"] = {"host": platform.node(), "python": platform.python_version(),
                         "platform": platform.platform(), "cpus": os.cpu_count(),
                         "load_avg_1_5_15": list(os.getloadavg()),  # shared machines: say how busy
                         "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(module.table(result), flush=True)
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"{name}{'-quick' if quick else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    load = ", ".join(f"{x:.1f}" for x in result["machine"]["load_avg_1_5_15"])
    print(f"results: {out} ({result['wall_s']:.0f} s; load average {load} on {os.cpu_count()} CPUs)\n", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=[*sorted(BENCHMARKS), *sorted(OPT_IN), "all"])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller inputs")
    parser.add_argument("--dir", help="scratch directory for files the benchmark writes (default: tmp)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON results go (default: %(default)s)")
    parser.add_argument("--slurm", action="store_true",
                        help="preemption only: a real preemption on the local Slurm cluster (preemption_slurm)")
    parser.add_argument("--model", choices=sorted({m for _, m in MODEL_VARIANTS}),
                        help="step only: the same benchmark on a real model (step --model smollm2)")
    args = parser.parse_args(argv)
    if args.slurm:
        if args.name != "preemption":
            parser.error("--slurm goes with the preemption benchmark only")
        args.name = "preemption_slurm"
    if args.model:
        if (args.name, args.model) not in MODEL_VARIANTS:
            parser.error(f"--model {args.model} goes with: "
                         + ", ".join(b for b, m in MODEL_VARIANTS if m == args.model))
        args.name = MODEL_VARIANTS[(args.name, args.model)]
    for name in BENCHMARKS if args.name == "all" else [args.name]:
        run_one(name, args.quick, args.dir, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
