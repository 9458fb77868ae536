"""The RL step on a real model: verl-hpc's GRPO step on SmolLM2-135M-Instruct vs the raw floor vs TRL.

`python -m bench step --model smollm2` (issue 16). The tiny-model step benchmark
(bench/step.py) cannot show what a real vocabulary (49k) and real lengths cost; this one
runs the same three sides on SmolLM2-135M-Instruct with the issue's shape: 8 prompts x 4
samples, 64 new tokens, AdamW, no KL/ref, the project at its defaults plus the memory
switches a user of a real model turns on (chunked log-probs are the default; padding
removal on). The three alternate in blocks of one step inside one run (bench/step.py's
wrapper around `train_step`), so the machine's load drifts over all of them alike; the
first block of each is a warm-up and is dropped.

Needs the model (`.venv/bin/python tools/make_smollm2.py`) and, for TRL, bench/.venv-trl
(`bash bench/trl_env.sh`); a missing one is named in the result instead of a number.
Minutes per repetition on 2 CPU cores: opt-in, not part of `bench all`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.logprob_memory import SMOLLM2
from bench.step import FLOOR_TARGET, TRL_TARGET, Shape, measure, measure_overlap, overlap_lines
from bench.step import table as step_table

SHAPE = Shape(prompts=8, n=4, new_tokens=64, threads=int(os.environ.get("BENCH_SMOLLM2_THREADS", "2")))
REPS = int(os.environ.get("BENCH_SMOLLM2_REPS", "3"))
# "step": the interleaved synchronous step; "overlap": split placement with max_staleness 1,
# one thread per process, against the floor and TRL given both cores (issue 16's third target).
PARTS = os.environ.get("BENCH_SMOLLM2_PARTS", "step,overlap").split(",")
OVERLAP_REPS, OVERLAP_STEPS = 2, 3
# The project's switches for a real model beyond its defaults (docs/memory.md).
OVERRIDES = ["model.remove_padding=true"]


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    setup = {**SHAPE.setup(), "model": str(SMOLLM2)}
    out: dict[str, Any] = {"quick": quick, "setup": setup, "cases": [], "overlap": [], "ratios": {},
                           "targets": {"verl_hpc_vs_floor": FLOOR_TARGET, "throughput_verl_hpc_vs_trl": TRL_TARGET}}
    if not (SMOLLM2 / "config.json").exists():
        out["skipped"] = f"{SMOLLM2} missing: run `.venv/bin/python tools/make_smollm2.py`"
        return out
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_step_smollm2_", dir=scratch))
    try:
        if quick or "step" in PARTS:
            out["cases"] = [measure("smollm2", reps=1 if quick else REPS, block=1, with_trl=not quick, work=work,
                                    shape=SHAPE, model_dir=SMOLLM2, overrides=OVERRIDES)]
        if not quick and "overlap" in PARTS:
            out["overlap"] = [measure_overlap("smollm2", OVERLAP_REPS, OVERLAP_STEPS, work, model_dir=SMOLLM2,
                                              shape=SHAPE, extra=OVERRIDES, trl_threads=(("trl_2threads", 2),))]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["ratios"] = {f"{k}_smollm2": v for c in [*out["cases"], *out["overlap"]] for k, v in c["ratios"].items()}
    return out


def table(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return f"RL step benchmark (SmolLM2-135M-Instruct): skipped: {result['skipped']}"
    lines = step_table({**result, "overlap": []}).splitlines()
    for case in result["cases"]:
        for side, row in case.get("phases_s", {}).items():
            lines.append(f"  {side} phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    lines += overlap_lines(result.get("overlap", []))
    return "\n".join(lines)
