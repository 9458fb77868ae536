"""How long a checkpoint stalls training, and how close its writes get to the disk's speed.

Saves the training state of a ~20M-parameter Qwen2 (preset "small", random init, plus the
AdamW state after one step: ~240 MB) with the CheckpointManager, synchronously and
asynchronously, next to a plain `dcp.save` and `dd ... conv=fsync` of the same number of
bytes into the same directory. Repetitions alternate between the methods so that drifts
in the disk or the page cache hit them alike. Reported (median, min-max over repetitions):

- stall ratio = time until an async `save()` returns / time of a synchronous save.
  Target <= 0.10: an async checkpoint should cost the training loop a tenth of a sync one.
- write ratio = checkpoint write throughput / dd throughput. Target >= 0.7: DCP plus our
  manifest (sha256 of every file, fsync) should not waste the disk.

Both ratios are given against the manager's sync save (what a run pays: DCP + manifest
hashes + commit) and against a bare `dcp.save` (the floor), because on a machine whose
disk is as fast as its memory copy the difference between the two is the sha256 pass.
The first async save allocates the reusable staging buffer; it is reported apart.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from verl_hpc.checkpoint.manager import CheckpointManager

STALL_TARGET, WRITE_TARGET = 0.10, 0.70
DD_BLOCK = 4 << 20


def build_state(preset: str, seed: int = 0) -> tuple[dict[str, Any], int, int]:
    """(state dict, parameter count, bytes of all tensors) after one AdamW step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from verl_hpc.models.tiny import PRESETS, build_model

    spec = PRESETS[preset]
    model = build_model(spec, spec.vocab_size, pad_id=0, eos_id=1, seed=seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(2, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    state = {"actor": {"model": msd, "optim": osd}}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    return state, sum(p.numel() for p in model.parameters()), nbytes


def _tensors(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _tensors(v)]
    if isinstance(node, list | tuple):
        return [t for v in node for t in _tensors(v)]
    return []


def _timed(fn: Any) -> float:
    _settle()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _settle() -> None:
    """Flush what earlier steps left (dirty pages, freed blocks) so that no method pays for another."""
    os.sync()
    time.sleep(0.05)


def _dd(directory: Path, nbytes: int) -> tuple[float, int]:
    """Seconds and bytes of `dd if=/dev/zero bs=4M conv=fsync` writing >= nbytes."""
    count = -(-nbytes // DD_BLOCK)
    target = directory / "ddfile"
    cmd = ["dd", "if=/dev/zero", f"of={target}", f"bs={DD_BLOCK}", f"count={count}", "conv=fsync",
           "status=none"]
    seconds = _timed(lambda: subprocess.run(cmd, check=True))
    target.unlink()
    return seconds, count * DD_BLOCK


def _clear(root: Path) -> None:
    """Remove earlier checkpoints outside the timed region (retention would time deletions)."""
    for entry in root.iterdir():
        shutil.rmtree(entry, ignore_errors=True)


def _one_rep(mgr: CheckpointManager, state: dict[str, Any], scratch: Path, step: int,
             nbytes: int) -> dict[str, float]:
    """One of each method, in a fixed order; files removed and the disk settled before each."""
    rep: dict[str, float] = {}
    rep["sync_s"] = _timed(lambda: mgr.save(step, state, {}, block=True))
    rep["ckpt_bytes"] = sum(f.stat().st_size for f in (mgr.root / f"step_{step:08d}").rglob("*") if f.is_file())
    _clear(mgr.root)
    _settle()
    start = time.perf_counter()
    mgr.save(step + 1, state, {})
    rep["async_stall_s"] = time.perf_counter() - start
    mgr.wait()
    rep["async_total_s"] = time.perf_counter() - start
    _clear(mgr.root)
    raw = scratch / "raw_dcp"
    rep["dcp_s"] = _timed(lambda: dcp.save(state, checkpoint_id=raw))
    shutil.rmtree(raw)
    rep["dd_s"], rep["dd_bytes"] = _dd(scratch, nbytes)
    return rep


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    """Measure; returns the JSON-able result (per-repetition numbers and their summaries)."""
    preset, reps = ("tiny", 3) if quick else ("small", 7)
    state, params, nbytes = build_state(preset)
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_ckpt_", dir=scratch))
    try:
        mgr = CheckpointManager(work / "checkpoints", keep_last=1000, keep_every=None, async_save=True)
        first = time.perf_counter()
        mgr.save(0, state, {})
        first_stall = time.perf_counter() - first
        mgr.wait()
        _clear(mgr.root)
        dcp.save(state, checkpoint_id=work / "warmup")  # imports and first-call costs out of the way
        shutil.rmtree(work / "warmup")
        rows = [_one_rep(mgr, state, work, 10 * (i + 1), nbytes) for i in range(reps)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {
        "stall_vs_manager_sync": [r["async_stall_s"] / r["sync_s"] for r in rows],
        "stall_vs_raw_dcp": [r["async_stall_s"] / r["dcp_s"] for r in rows],
        "write_manager_vs_dd": [(r["ckpt_bytes"] / r["sync_s"]) / (r["dd_bytes"] / r["dd_s"]) for r in rows],
        "write_raw_dcp_vs_dd": [(r["ckpt_bytes"] / r["dcp_s"]) / (r["dd_bytes"] / r["dd_s"]) for r in rows],
    }
    times = {k: _summary([r[k] for r in rows]) for k in ("sync_s", "async_stall_s", "async_total_s", "dcp_s", "dd_s")}
    return {"preset": preset, "params": params, "state_bytes": nbytes, "reps": reps, "quick": quick,
            "first_async_stall_s": first_stall, "times": times,
            "ratios": {k: _summary(v) for k, v in ratios.items()},
            "targets": {"stall": STALL_TARGET, "write": WRITE_TARGET}, "rows": rows}


def table(result: dict[str, Any]) -> str:
    """Human summary: times, then the ratios against their targets."""
    mb = result["state_bytes"] / 1e6
    lines = [f"checkpoint benchmark: preset {result['preset']} ({result['params'] / 1e6:.1f}M params, "
             f"{mb:.0f} MB of model+AdamW state), {result['reps']} alternating repetitions",
             f"{'measure':<34}{'median':>10}{'min':>10}{'max':>10}"]
    names = {"sync_s": "manager sync save (s)", "async_stall_s": "manager async save: stall (s)",
             "async_total_s": "manager async save: total (s)", "dcp_s": "bare dcp.save (s)",
             "dd_s": "dd conv=fsync, same bytes (s)"}
    for key, label in names.items():
        s = result["times"][key]
        lines.append(f"{label:<34}{s['median']:>10.3f}{s['min']:>10.3f}{s['max']:>10.3f}")
    lines.append(f"{'first async stall (allocates) (s)':<34}{result['first_async_stall_s']:>10.3f}")
    targets = {"stall_vs_manager_sync": ("<=", STALL_TARGET), "stall_vs_raw_dcp": ("<=", STALL_TARGET),
               "write_manager_vs_dd": (">=", WRITE_TARGET), "write_raw_dcp_vs_dd": (">=", WRITE_TARGET)}
    lines.append(f"{'ratio':<34}{'median':>10}{'min':>10}{'max':>10}  target")
    for key, (op, target) in targets.items():
        s = result["ratios"][key]
        ok = s["median"] <= target if op == "<=" else s["median"] >= target
        lines.append(f"{key:<34}{s['median']:>10.3f}{s['min']:>10.3f}{s['max']:>10.3f}  {op} {target} "
                     f"{'met' if ok else 'MISSED'}")
    return "\n".join(lines)
