"""Peak memory and time of the actor's update with each memory switch on, against all of them off.

What is measured: the actor's PPO update (`Actor.update`: forward, backward, AdamW step) on
one rollout-shaped batch: left-padded prompts of half to full `prompt` tokens, right-padded
responses of an eighth to all of `response` tokens, as a GSM8K batch looks. Variants:
`plain` (whole logits, no recomputation, padded rows: the baseline), then each switch on
its own — `model.logprob_chunk_tokens`, `model.gradient_checkpointing`,
`model.remove_padding`, `model.lora` (rank 16) — and all of them together. Each variant runs
in a fresh process; the figure is the process's peak resident set (weights, gradients,
AdamW state, activations: what a trainer rank needs) and the median of `steps` timed
updates after a warm-up one.

Then every switch on, the peak at 64, 256 and 1024 response tokens (8 rows): the growth
per added token late against early, 1.0 for linear growth.

Models: SmolLM2-135M-Instruct when `tools/make_smollm2.py` has built it (not --quick), else the
`small` preset (`--quick`: `tiny`).
Reported: ratios variant / plain of peak memory and of step time, and the length growth.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.logprob_memory import SMOLLM2

SWITCHES = {"plain": {}, "chunked": {"chunk": 1024}, "recompute": {"recompute": True},
            "remove_padding": {"remove_padding": True}, "lora_r16": {"lora": 16},
            "all": {"chunk": 1024, "recompute": True, "remove_padding": True, "lora": 16}}


def _model(name: str):  # -> a causal LM
    from transformers import AutoModelForCausalLM

    from verl_hpc.models.tiny import PRESETS, build_model

    if name == "smollm2":
        return AutoModelForCausalLM.from_pretrained(SMOLLM2)
    return build_model(PRESETS[name], 512, pad_id=0, eos_id=1, seed=0)


def rollout_batch(vocab: int, rows: int, prompt: int, response: int) -> dict[str, Any]:
    """A seeded batch with rollout padding: prompts left-padded, responses right-padded."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(max(1, prompt // 2), prompt + 1, (rows,), generator=gen)
    resp_lens = torch.randint(max(1, response // 8), response + 1, (rows,), generator=gen)
    attention = torch.zeros(rows, prompt + response, dtype=torch.long)
    for i in range(rows):
        attention[i, prompt - int(prompt_lens[i]):prompt + int(resp_lens[i])] = 1
    ids = torch.randint(2, vocab, (rows, prompt + response), generator=gen) * attention
    mask = attention[:, prompt:].float()
    return {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "response_mask": mask, "advantages": torch.randn(rows, response, generator=gen) * mask}


def measure(model: str, switches: dict[str, Any], rows: int, prompt: int, response: int,
            steps: int) -> dict[str, Any]:
    """In this process: a warm-up update and `steps` timed ones; peak RSS and the median step."""
    import resource

    import torch

    from verl_hpc.config import AlgorithmConfig
    from verl_hpc.config.schema import LoraConfig, OptimConfig
    from verl_hpc.roles.actor import Actor, UpdatePlan
    from verl_hpc.roles.fsdp import checkpoint_activations
    from verl_hpc.roles.lora import apply_lora

    torch.manual_seed(0)
    torch.set_num_threads(2)
    net = _model(model)
    if switches.get("lora"):
        apply_lora(net, LoraConfig(rank=switches["lora"], alpha=2.0 * switches["lora"]), seed=0)
    if switches.get("recompute"):
        checkpoint_activations(net)
    actor = Actor(net, AlgorithmConfig(), OptimConfig(lr=1e-5), total_steps=steps + 1,
                  chunk_tokens=switches.get("chunk", 0), remove_padding=switches.get("remove_padding", False))
    batch = rollout_batch(net.config.vocab_size, rows, prompt, response)
    plan = UpdatePlan(rows, max(1, rows // 2), 1)
    times, stats = [], {}
    for i in range(steps + 1):
        start = time.perf_counter()
        stats = actor.update(batch, plan)
        if i:
            times.append(time.perf_counter() - start)
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_seconds": statistics.median(times), "pg_loss": stats["pg_loss"],
            "trained_params": sum(p.numel() for p in net.parameters() if p.requires_grad),
            "real_tokens": int(batch["attention_mask"].sum()), "padded_tokens": batch["attention_mask"].numel()}


def in_fresh_process(module: str, *args: Any) -> dict[str, Any]:
    """`module.measure(*args)` in a new interpreter (so one variant's freed pages cannot hide another's peak)."""
    code = f"import json; from {module} import measure; print(json.dumps(measure(*{args!r})))"
    # A fixed mmap threshold (as bench/logprob_memory.py): glibc otherwise raises it after large
    # frees and serves later large tensors from its heap, where freed pages stay resident, so the
    # peak would measure the allocator's history (LoRA's many small tensors showed +17% that way).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1], env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    model = "tiny" if quick else "smollm2" if SMOLLM2.is_dir() else "small"
    rows, prompt, response = (8, 8, 8) if quick else (32, 128, 64)
    names = ["plain", "all"] if quick else list(SWITCHES)  # quick: every switch at once, a smoke test
    steps = 1
    # --quick measures in this process (a smoke test of the code, seconds in CI); a figure needs fresh ones.
    run_one = (lambda *args: measure(*args)) if quick else (lambda *args: in_fresh_process("bench.memory", *args))
    samples = {name: run_one(model, SWITCHES[name], rows, prompt, response, steps) for name in names}
    plain = samples["plain"]
    ratios = {}
    for name in names[1:]:
        ratios[f"peak_memory/{name}"] = summary([samples[name]["peak_rss_bytes"] / plain["peak_rss_bytes"]])
        ratios[f"step_time/{name}"] = summary([samples[name]["step_seconds"] / plain["step_seconds"]])
    # Peak against response length, every switch on: linear growth means each added token costs
    # the same (increment ratio / length ratio near 1); the whole logits' softmax would not.
    lengths = [8, 16, 32] if quick else [64, 256, 1024]
    sweep = {str(n): run_one(model, SWITCHES["all"], 4 if quick else 8, prompt, n, 1) for n in lengths}
    peaks = [sweep[str(n)]["peak_rss_bytes"] for n in lengths]
    growth = ((peaks[2] - peaks[1]) / max(peaks[1] - peaks[0], 1)) / ((lengths[2] - lengths[1]) / (lengths[1] - lengths[0]))
    ratios["length_growth/increment_vs_linear"] = summary([max(growth, 1e-6)])
    return {"model": model, "rows": rows, "prompt": prompt, "response": response, "steps": steps,
            "samples": samples, "ratios": ratios, "sweep": sweep, "lengths": lengths}


def table(result: dict[str, Any]) -> str:
    plain = result["samples"]["plain"]
    lines = [f"memory benchmark: {result['model']}, {result['rows']} rows of up to {result['prompt']} + "
             f"{result['response']} tokens ({plain['real_tokens']} real of {plain['padded_tokens']} padded)",
             f"{'variant':<15} {'peak RSS GiB':>13} {'x plain':>8} {'s/step':>8} {'x plain':>8}"]
    for name, sample in result["samples"].items():
        lines.append(f"{name:<15} {sample['peak_rss_bytes'] / 2**30:>13.2f} "
                     f"{sample['peak_rss_bytes'] / plain['peak_rss_bytes']:>8.2f} {sample['step_seconds']:>8.2f} "
                     f"{sample['step_seconds'] / plain['step_seconds']:>8.2f}")
    lines.append("peak with every switch on, by response length: " + ", ".join(
        f"{n}: {result['sweep'][str(n)]['peak_rss_bytes'] / 2**30:.2f} GiB" for n in result["lengths"]))
    growth = result["ratios"]["length_growth/increment_vs_linear"]["median"]
    lines.append(f"growth per added token, late vs early: {growth:.2f}x of linear")
    best = min(s["peak_rss_bytes"] for s in result["samples"].values()) / plain["peak_rss_bytes"]
    lines.append(f"target: some switch lowers the peak: {'met' if best < 1 else 'MISSED'} ({best:.2f}x at best)")
    return "\n".join(lines)
