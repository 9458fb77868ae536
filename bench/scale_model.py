"""A scale model you can check: the bytes and messages each trainer rank takes in per step, counted.

Why counts, not times: on a noisy 2-core box a time says little about 512 GPUs, but the
number of bytes that cross trainer rank 0 is exact here and decides whether rank 0 is the
bottleneck there (issue 19; OpenRLHF#533, NeMo-RL#945). For W trainer ranks and R rollout
replicas (processes on loopback), `verl-hpc train configs/quickstart_split.yaml` runs a
few steps and the trainer's own counters are read back from its metrics
(`perf/rollout_intake_{bytes,messages,rows}`: rank 0's own, the largest rank's, the
total; `perf/weight_sync_bytes`: what rank 0 sends per sync). The rank-0 funnel it
replaced is shown beside it, computed from the same step's bytes: rank 0 took the whole
batch in and broadcast it to the W - 1 others, W x the batch through one NIC.

Then the extrapolation to 8 / 64 / 512 GPUs with docs/benchmarks.md's cost model: rank
0's rollout bytes per step for a batch the size of the issue's (the bytes per row measured
here x rows), and the seconds they take on a 50 GB/s link, direct against the funnel.

    .venv/bin/python -m bench scale_model
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LINK_BYTES_PER_S = 50e9       # 400 Gb/s, docs/benchmarks.md's cost model
EXTRAPOLATE_GPUS = (8, 64, 512)
EXTRAPOLATE_ROWS = 8192       # a large GRPO batch: 1024 prompts x 8 samples
EXTRAPOLATE_ROW_BYTES = 4 * (1024 + 2048) * 3  # ids + rollout log-probs + one more float column, 3k tokens


def _run(world: int, replicas: int, steps: int, run_dir: Path) -> list[dict[str, float]]:
    actor = ",".join(str(i) for i in range(world))
    rollout = ",".join(str(world + i) for i in range(replicas))
    cmd = [sys.executable, "-m", "verl_hpc", "train", str(REPO / "configs" / "quickstart_split.yaml"),
           "--run-dir", str(run_dir), f"trainer.total_steps={steps}", "logging.progress=off",
           f"resources.actor.device_ids=[{actor}]", f"resources.rollout.device_ids=[{rollout}]",
           f"resources.reward.device_ids=[{world + replicas}]", "trainer.save_hf_model=false",
           "checkpoint.interval_steps=1000", "trainer.batch_size=96", "algorithm.sampling.n=4"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"W={world} R={replicas} failed: {done.stderr[-2000:]}")
    lines = (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def measure(world: int, replicas: int, steps: int, work: Path) -> dict[str, Any]:
    """Median per-step counts over the steps after the first (which also moved the startup sync)."""
    rows = _run(world, replicas, steps, work / f"w{world}-r{replicas}")[1:]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    total = median("perf/rollout_intake_bytes_total")
    return {"world": world, "replicas": replicas,
            "rank0_bytes": median("perf/rollout_intake_bytes"),
            "max_rank_bytes": median("perf/rollout_intake_bytes_max_rank"),
            "total_bytes": total, "rows": median("perf/rollout_intake_rows_total"),
            "rank0_messages": median("perf/rollout_intake_messages"),
            "total_messages": median("perf/rollout_intake_messages_total"),
            "funnel_rank0_bytes": world * total,  # in once, then out to W - 1 ranks
            "weight_sync_bytes": median("perf/weight_sync_bytes")}


def extrapolate(bytes_per_row: float) -> list[dict[str, float]]:
    """Rank 0's rollout bytes and link seconds per step at scale, direct intake vs the funnel."""
    batch = EXTRAPOLATE_ROWS * bytes_per_row
    return [{"gpus": w, "direct_bytes": batch / w, "funnel_bytes": batch * w,
             "direct_s": batch / w / LINK_BYTES_PER_S, "funnel_s": batch * w / LINK_BYTES_PER_S}
            for w in EXTRAPOLATE_GPUS]


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    shapes = [(1, 1), (2, 1)] if quick else [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 2)]
    steps = 3 if quick else 4
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_scale_model_", dir=scratch))
    try:
        cases = [measure(w, r, steps, work) for w, r in shapes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {f"rank0_share/w{c['world']}_r{c['replicas']}": _one(c["rank0_bytes"] / c["total_bytes"])
              for c in cases if c["total_bytes"]}
    ratios.update({f"rank0_vs_funnel/w{c['world']}_r{c['replicas']}": _one(c["rank0_bytes"] / c["funnel_rank0_bytes"])
                   for c in cases if c["funnel_rank0_bytes"]})
    per_row = statistics.median(c["total_bytes"] / c["rows"] for c in cases if c["rows"])
    return {"quick": quick, "cases": cases, "ratios": ratios, "measured_bytes_per_row": per_row,
            "extrapolation": extrapolate(EXTRAPOLATE_ROW_BYTES),
            "extrapolation_setup": {"rows": EXTRAPOLATE_ROWS, "bytes_per_row": EXTRAPOLATE_ROW_BYTES,
                                    "link_bytes_per_s": LINK_BYTES_PER_S}}


def _one(value: float) -> dict[str, float]:
    return {"median": value, "min": value, "max": value}


def table(result: dict[str, Any]) -> str:
    lines = ["scale model: rollout bytes per step taken in by trainer ranks (counted), split placement, "
             "quickstart_split at batch 96",
             f"{'W':>2}{'R':>3}{'batch B':>10}{'rank 0 B':>10}{'share':>7}{'1/W':>6}{'max rank B':>11}"
             f"{'funnel rank 0 B':>16}{'msgs@0':>7}{'sync B':>10}"]
    for c in result["cases"]:
        share = c["rank0_bytes"] / c["total_bytes"] if c["total_bytes"] else float("nan")
        lines.append(f"{c['world']:>2}{c['replicas']:>3}{c['total_bytes']:>10.0f}{c['rank0_bytes']:>10.0f}"
                     f"{share:>7.3f}{1 / c['world']:>6.3f}{c['max_rank_bytes']:>11.0f}"
                     f"{c['funnel_rank0_bytes']:>16.0f}{c['rank0_messages']:>7.0f}{c['weight_sync_bytes']:>10.0f}")
    # Rows hold responses of different lengths, so a rank's bytes are 1/W of the batch's only to a margin.
    ok = all(c["rank0_bytes"] <= 1.5 * c["total_bytes"] / c["world"] for c in result["cases"])
    lines.append(f"target: bytes through trainer rank 0 O(batch / W) (<= 1.5 x batch / W in every case): "
                 f"{'met' if ok else 'MISSED'}")
    setup = result["extrapolation_setup"]
    lines.append(f"extrapolated (cost model): {setup['rows']} rows x {setup['bytes_per_row'] / 1e3:.0f} kB per step, "
                 f"{setup['link_bytes_per_s'] / 1e9:.0f} GB/s link; rank 0's rollout bytes and seconds per step")
    for e in result["extrapolation"]:
        lines.append(f"  {e['gpus']:>4} GPUs: direct {e['direct_bytes'] / 1e6:>9.1f} MB {e['direct_s'] * 1e3:>8.2f} ms"
                     f"   funnel {e['funnel_bytes'] / 1e9:>8.2f} GB {e['funnel_s']:>7.2f} s")
    return "\n".join(lines)
