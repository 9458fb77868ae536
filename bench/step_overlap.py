"""The overlapped step alone: split placement, `max_staleness: 1`, vs the floor and vs TRL.

Why its own name: `python -m bench step` runs the synchronous comparison first (about
15 minutes on 2 cores); this is the part that answers "how does the project's fastest
configuration compare with TRL" and is worth re-running on its own. Same code as the
overlap part of `bench/step.py`.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.step import TINY, measure_overlap, overlap_lines


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_step_overlap_", dir=scratch))
    try:
        plan = [("tiny", 1, 3, False)] if quick else [("tiny", 3, 10, True), ("small", 2, 6, True)]
        overlap = [measure_overlap(preset, reps, steps, work, with_trl) for preset, reps, steps, with_trl in plan]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"setup": TINY.setup(),
            "overlap": overlap,
            "ratios": {f"{k}_{o['preset']}": v for o in overlap for k, v in o["ratios"].items()}}


def table(result: dict[str, Any]) -> str:
    s = result["setup"]
    head = (f"overlapped step: {s['prompts']} prompts x {s['n']} samples x {s['max_new_tokens']} tokens, "
            f"{s['threads']} thread per process; s/step medians per repetition, ratios paired")
    return "\n".join([head, *overlap_lines(result["overlap"])])
