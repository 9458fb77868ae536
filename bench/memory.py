"""Peak memory of a whole GRPO step on SmolLM2-135M-Instruct, each memory switch set against none.

What a user's step holds: the policy and its AdamW state, the reference policy, generation
(KV cache, tokenizer, prompts), scoring, old and reference log-probs and the update. This runs
the real thing — `verl-hpc train configs/smollm2_gsm8k.yaml` at 8 prompts x 4 samples, 64 new
tokens, KL on so the reference exists, 2 steps so AdamW's state exists — once per variant, each
in a fresh process, and samples the resident set of its process tree every 0.1 s. The figure
held to the bound is the run's own `memory/peak_rss_gb` at its last step, logged before the
final checkpoint is written (its staging copy is `bench checkpoint`'s subject); the tree's
peak, save included, is shown beside it.

Each run keeps the product's own allocator choice (`resources.host_allocator: auto`: TCMalloc
where it is installed), as a user's run does; `defaults_glibc` is the defaults under glibc's
malloc, the baseline that choice is measured against.

The bound: 1.5 x (weights + gradients + AdamW's two moments + the reference's weights), all
fp32 — 5 copies of the parameters, ~2.7 GB for SmolLM2, so ~4.0 GB.

    .venv/bin/python -m bench memory        # minutes; needs tools/make_smollm2.py's model
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from bench import REPO, SMOLLM2, SMOLLM2_MISSING, read_metrics, single, watch_peak

BOUND_FACTOR = 1.5
DEFAULTS_TIME_TARGET = 1.15  # the defaults' step time against the best hand-set switches
PLAIN = ["model.logprob_chunk_tokens=0", "model.remove_padding=false", "model.gradient_checkpointing=false"]
ALL = ["model.remove_padding=true", "model.gradient_checkpointing=true"]
VARIANTS: dict[str, list[str]] = {
    "plain": PLAIN,                                    # whole logits, padded rows, every activation kept
    "defaults": [],                                    # chunked log-probs (the default)
    "defaults_glibc": ["resources.host_allocator=glibc"],  # the same under glibc's malloc
    "remove_padding": ["model.remove_padding=true"],
    "gradient_checkpointing": ["model.gradient_checkpointing=true"],
    "all": ALL,
    "all_lora_r16": [*ALL, "model.lora={rank: 16, alpha: 32}"],
}
SHAPE = ["trainer.batch_size=32", "algorithm.sampling.n=4", "algorithm.sampling.max_new_tokens=64",
         "trainer.total_steps=2", "checkpoint.interval_steps=100", "trainer.torch_threads=2",
         "logging.progress=off", "algorithm.kl.coef=0.001",
         "~data.val_files", "~trainer.test_freq", "trainer.val_before_train=false"]  # the step alone, no validation
QUICK_SHAPE = [*SHAPE, "trainer.batch_size=4", "algorithm.sampling.n=2", "algorithm.sampling.max_new_tokens=8"]


def _gsm8k(out_dir: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_data", REPO / "examples" / "gsm8k" / "make_data.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.write(out_dir, count=64)


def model_state_bytes(model_dir: Path) -> int:
    """5 fp32 copies of the parameters: weights, gradients, AdamW's two moments, the reference."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    return 5 * 4 * sum(p.numel() for p in model.parameters())


def measure(name: str, overrides: list[str], data: Path, work: Path, shape: list[str] = SHAPE) -> dict[str, Any]:
    """One fresh `verl-hpc train` run: its process tree's peak RSS and its steps' seconds."""
    run_dir = work / name
    cmd = [sys.executable, "-m", "verl_hpc", "train", str(REPO / "configs" / "smollm2_gsm8k.yaml"),
           "--run-dir", str(run_dir), f"model.path={SMOLLM2}", f"data.train_files=[{data}]", *shape, *overrides]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    peak = [0]
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as popen:
        watcher = threading.Thread(target=watch_peak, args=(popen, peak), daemon=True)
        watcher.start()
        _, err = popen.communicate(timeout=3600)
        watcher.join()
    if popen.returncode != 0:
        return {"failed": f"exit {popen.returncode}: {err[-1500:]}"}
    rows = read_metrics(run_dir)
    return {"peak_rss_bytes": peak[0], "step_s": [r["timing_s/step"] for r in rows],
            "rank_peak_rss_gb": max(r.get("memory/peak_rss_gb", 0.0) for r in rows),
            "score": rows[-1].get("critic/score/mean")}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    shape = QUICK_SHAPE if quick else SHAPE  # quick: a smoke test of the code at a toy shape
    out: dict[str, Any] = {"quick": quick, "shape": shape, "variants": {}, "ratios": {}}
    if not (SMOLLM2 / "config.json").exists():
        out["skipped"] = SMOLLM2_MISSING
        return out
    bound = BOUND_FACTOR * model_state_bytes(SMOLLM2)
    out["bound_bytes"] = bound
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_memory_", dir=scratch))
    try:
        data = _gsm8k(work / "gsm8k")
        chosen = os.environ.get("BENCH_MEMORY_VARIANTS")  # e.g. "all,all_lora_r16": a subset, faster
        # quick: one SmolLM2 run with every switch on (each run is minutes of CPU in CI's smoke test)
        names = ["all"] if quick else chosen.split(",") if chosen else list(VARIANTS)
        out["variants"] = {name: measure(name, VARIANTS[name], data, work, shape) for name in names}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plain = out["variants"].get("plain", {}).get("peak_rss_bytes")
    for name, v in out["variants"].items():
        if "peak_rss_bytes" in v:
            out["ratios"][f"peak_vs_bound/{name}"] = single(_step_peak(v) / bound)
            if plain and name != "plain":
                out["ratios"][f"peak_vs_plain/{name}"] = single(_step_peak(v) / _step_peak(out["variants"]["plain"]))
    out["ratios"].update(defaults_vs_hand_set(out["variants"]))
    return out


def defaults_vs_hand_set(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The defaults (`memory_plan: auto`) against the fastest hand-set variant that fits the bound:
    the target is the defaults' step at <= DEFAULTS_TIME_TARGET x its seconds (last step: the first
    holds the start-up). Empty unless the defaults and a hand-set variant both ran."""
    defaults = variants.get("defaults", {})
    hand_set = [v for name, v in variants.items() if name not in ("defaults", "defaults_glibc", "plain") and "step_s" in v]
    if "step_s" not in defaults or not hand_set:
        return {}
    best = min(v["step_s"][-1] for v in hand_set)
    return {"step_time_vs_best_hand_set/defaults": single(defaults["step_s"][-1] / best)}


def _step_peak(variant: dict[str, Any]) -> float:
    """Bytes: the process's peak through its last step, before the final checkpoint."""
    return variant["rank_peak_rss_gb"] * 2**30


def table(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return f"memory benchmark: whole GRPO step on SmolLM2-135M-Instruct: skipped: {result['skipped']}"
    bound = result["bound_bytes"]
    lines = [f"memory benchmark: whole GRPO step on SmolLM2-135M-Instruct, {' '.join(result['shape'][:3])}; peak RSS of the "
             f"process tree; bound = {BOUND_FACTOR} x (weights + grads + AdamW + ref) = {bound / 1e9:.2f} GB",
             f"{'variant':<24}{'step peak GB':>13}{'x bound':>9}{'x plain':>9}{'with save GB':>13}{'s/step':>9}"]
    plain_v = result["variants"].get("plain", {})
    plain = _step_peak(plain_v) if "peak_rss_bytes" in plain_v else None
    for name, v in result["variants"].items():
        if "failed" in v:
            lines.append(f"{name:<24} failed: {v['failed'][-300:]}")
            continue
        peak = _step_peak(v)
        vs_plain = f"{peak / plain:>9.2f}" if plain else f"{'-':>9}"
        lines.append(f"{name:<24}{peak / 1e9:>13.2f}{peak / bound:>9.2f}{vs_plain}{v['peak_rss_bytes'] / 1e9:>13.2f}"
                     f"{v['step_s'][-1]:>9.1f}")
    timing = result.get("ratios", {}).get("step_time_vs_best_hand_set/defaults")
    if timing is not None:
        lines.append(f"target: the defaults at <= {DEFAULTS_TIME_TARGET}x the best hand-set time: "
                     f"{'met' if timing['median'] <= DEFAULTS_TIME_TARGET else 'MISSED'} ({timing['median']:.2f}x)")
    best = min((_step_peak(v) for v in result["variants"].values() if "peak_rss_bytes" in v), default=None)
    if best is not None:
        lines.append(f"target: peak <= bound with the switches on: {'met' if best <= bound else 'MISSED'} "
                     f"({best / bound:.2f}x at best)")
    return "\n".join(lines)
