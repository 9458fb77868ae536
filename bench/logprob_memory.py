"""Peak memory and time of the actor's pass (forward + backward): chunked log-probs vs whole logits.

What is measured: one `response_logprobs(..., with_entropy=True)` pass with its backward,
the loss the actor's update takes (log-probs and entropy of every response token), on the
same model and batch, in three variants: `model.logprob_chunk_tokens: 0` (the whole
`[tokens, vocab]` logits at once, the baseline), the default chunks, and the default chunks
with `model.gradient_checkpointing` on. Each variant runs in a fresh
process so one's freed memory cannot hide the other's peak, and the pass runs twice there:
the second is measured, as the steady state every training step repeats. A sampling thread
reads the process's resident set every 2 ms during it; the figure is the peak minus the
resident set just before it (model and gradients, no optimizer). The log-probs of both are compared,
so a cheap but wrong pass cannot pass.

Models: SmolLM2-135M-Instruct (vocab 49k) when `tools/make_smollm2.py` has built it, else a
random model of the same vocab and a small body, which shows the same logits term.
`--quick`: the small body, a small batch in chunks of 128 tokens, one repetition (a smoke
test in CI).
Reported: ratios variant / whole of the pass's peak memory and of its time (median, min-max).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SMOLLM2 = Path("~/.cache/verl-hpc/models/smollm2-135m-instruct").expanduser()
VOCAB = 49152  # SmolLM2's
CHUNK = 1024  # the config default, model.logprob_chunk_tokens
QUICK_CHUNK = 128  # --quick's batch is 512 tokens: a chunk must be smaller to show anything


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _model(model: str):  # -> a causal LM
    import torch
    from transformers import AutoModelForCausalLM

    from verl_hpc.models.tiny import ModelPreset, build_model

    if model == "smollm2":
        return AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    body = ModelPreset(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                       vocab_size=VOCAB, family="llama")
    return build_model(body, VOCAB, pad_id=0, eos_id=1, seed=0)


def measure(model: str, rows: int, prompt: int, response: int, chunk: int, recompute: bool = False,
            ) -> dict[str, Any]:
    """In this process: one pass and its backward; peak extra resident bytes, seconds, a checksum."""
    import gc

    import torch

    from verl_hpc.roles.forward import response_logprobs

    torch.manual_seed(0)
    net = _model(model)
    if recompute:
        from verl_hpc.roles.fsdp import checkpoint_activations

        checkpoint_activations(net).train()
    vocab = net.config.vocab_size
    ids = torch.randint(2, vocab, (rows, prompt + response))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(prompt + response).expand(rows, -1),
             "response_mask": torch.ones(rows, response)}
    def one_pass() -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        logprobs, entropy = response_logprobs(net, batch, 1.0, with_entropy=True, chunk_tokens=chunk)
        (logprobs.sum() + 0.01 * entropy.sum()).backward()
        return logprobs.detach(), time.perf_counter() - start

    # The same pass once before: training repeats it every step, so the steady state is what
    # counts, not the heap's and the kernels' one-time growth (a first pass measured ~200 MB more).
    one_pass()
    net.zero_grad(set_to_none=False)  # the gradients' memory exists before the pass, as in training
    gc.collect()
    base, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    logprobs, seconds = one_pass()
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _rss_bytes())
    return {"peak_extra_bytes": peak[0] - base, "seconds": seconds, "vocab": vocab,
            "logprob_sum": float(logprobs.double().sum())}


def _in_fresh_process(model: str, rows: int, prompt: int, response: int, chunk: int,
                      recompute: bool = False) -> dict[str, Any]:
    code = ("import json, sys; from bench.logprob_memory import measure; "
            f"print(json.dumps(measure({model!r}, {rows}, {prompt}, {response}, {chunk}, {recompute})))")
    # A fixed mmap threshold: glibc otherwise raises it after large frees and keeps later large
    # tensors on its heap, so a freed tensor's pages would stay resident and hide the next peak.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1], env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


VARIANTS = ("whole", "chunked", "chunked+recompute")  # the first is the baseline


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    model = "smollm2" if SMOLLM2.is_dir() and not quick else "random-49k"
    # Full: the SmolLM2 batch, 8 prompts x 4 samples of 128 + 64 tokens (2 chunks).
    rows, prompt, response = (8, 16, 64) if quick else (32, 128, 64)
    reps, chunk = (1, QUICK_CHUNK) if quick else (2, CHUNK)
    settings = {"whole": (0, False), "chunked": (chunk, False), "chunked+recompute": (chunk, True)}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for _ in range(reps):  # alternated, so a busier moment of the machine hits every variant
        for name in VARIANTS:
            samples[name].append(_in_fresh_process(model, rows, prompt, response, *settings[name]))
    whole = samples["whole"]
    agree = all(abs(r["logprob_sum"] - w["logprob_sum"]) <= 1e-4 * max(1.0, abs(w["logprob_sum"]))
                for name in VARIANTS[1:] for r, w in zip(samples[name], whole, strict=True))
    ratios = {}
    for name in VARIANTS[1:]:
        pairs = list(zip(samples[name], whole, strict=True))
        ratios[f"peak_memory/{name}"] = _ratio([r["peak_extra_bytes"] / max(w["peak_extra_bytes"], 1)
                                                for r, w in pairs])
        ratios[f"time/{name}"] = _ratio([r["seconds"] / w["seconds"] for r, w in pairs])
    return {"model": model, "rows": rows, "prompt": prompt, "response": response, "chunk_tokens": chunk,
            "vocab": whole[0]["vocab"], "samples": samples, "logprobs_agree": agree, "ratios": ratios}


def table(result: dict[str, Any]) -> str:
    tokens = result["rows"] * result["response"]
    lines = [f"actor pass (forward + backward) on {result['model']} (vocab {result['vocab']}), "
             f"{result['rows']} rows x ({result['prompt']} prompt + {result['response']} response) = "
             f"{tokens} response tokens; chunks of {result['chunk_tokens']} tokens against the whole logits",
             f"{'variant':<20}{'peak extra MB':>15}{'seconds':>10}"]
    for name in result["samples"]:
        runs = result["samples"][name]
        lines.append(f"{name:<20}{statistics.median(r['peak_extra_bytes'] for r in runs) / 2**20:>15.0f}"
                     f"{statistics.median(r['seconds'] for r in runs):>10.2f}")
    for name, r in result["ratios"].items():
        lines.append(f"ratio {name} / whole: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
    lines.append(f"log-probs agree: {result['logprobs_agree']}")
    return "\n".join(lines)
