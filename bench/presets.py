"""What each algorithm preset costs per step: s/step of every online preset, as a ratio to GRPO's.

Same model, prompts, group size, response length, batch and optimizer for all; each
preset at its own defaults (config/presets.py: PPO trains a critic, RLOO/REINFORCE++/ReMax
add the KL to the reward through the reference model, ReMax generates one greedy response
per prompt more, DAPO may generate several rounds to fill its batch with informative
groups). The reward is the share of 1s in a response, which the untrained model already
varies within a group (as in tests/algo/test_preset_learning.py), so DAPO's dynamic sampling
keeps most groups instead of running out of rounds.

Presets take turns in blocks inside one run: a round runs every preset's block of
`block + 1` steps (a fresh trainer each, its first step dropped as warm-up), and the next
round starts again, so a drift in machine load hits all of them alike. Each round's
ratio preset / GRPO is paired within the round; reported: the median ratio (min-max).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from verl_hpc.config.presets import PRESETS as ALGORITHM_PRESETS

MODEL_PRESET, PROMPTS, N, NEW_TOKENS, LR, THREADS = "tiny", 16, 8, 16, 1e-3, 1
ONLINE = ["grpo", *sorted(name for name in ALGORITHM_PRESETS if name not in ("grpo", "dpo"))]
# Presets whose step does GRPO's work (the same passes, other arithmetic on the advantages
# and the loss) must cost about what GRPO costs. The others add work by design, so their
# ratio is reported, not held to a target: PPO's critic, ReMax's greedy generation, DAPO's
# generation rounds, and the KL in the reward of RLOO / REINFORCE++ / ReMax, which needs the
# old policy's log-probs: one more forward that on-policy GRPO (one update per batch) skips.
SAME_WORK, SAME_WORK_TARGET = {"dr_grpo", "gspo"}, 1.15


def ones(prompt: str, response: str, **_: object) -> float:
    """The share of the response's characters that are the digit 1."""
    return response.count("1") / max(len(response), 1)


def _config(name: str, model_dir: Path, total_steps: int) -> dict[str, Any]:
    return {
        "model": {"path": str(model_dir), "init_preset": MODEL_PRESET, "init_seed": 0},
        "data": {"task": {"name": "arithmetic", "num_prompts": 512, "max_operand": 4, "seed": 0}},
        "reward": {"function": "bench.presets:ones"},
        "algorithm": {"name": name, "sampling": {"n": N, "temperature": 1.0, "max_new_tokens": NEW_TOKENS}},
        "trainer": {"total_steps": total_steps, "batch_size": PROMPTS * N, "seed": 0, "save_hf_model": False,
                    "torch_threads": THREADS, "actor_optim": {"lr": LR, "grad_clip": 1.0}},
        "checkpoint": {"interval_steps": 10**6},
        "logging": {"tensorboard": False, "progress": "off", "sample_every": 10**6, "num_samples": 0,
                    "log_every": 10**6},
    }


def _block(name: str, model_dir: Path, steps: int, run_dir: Path) -> tuple[list[float], list[float]]:
    """One preset's fresh run of `steps`: seconds of each step, and generation rounds of each."""
    from verl_hpc import HybridTrainer
    from verl_hpc.runtime.step.loop import RLTrainer

    seconds: list[float] = []
    rounds: list[float] = []
    inner = RLTrainer.train_step

    def timed_step(self: RLTrainer, *args: Any, **kwargs: Any) -> dict[str, float] | None:
        start = time.perf_counter()
        out = inner(self, *args, **kwargs) or {}
        seconds.append(time.perf_counter() - start)
        rounds.append(out.get("filter_groups/num_gen_batches", 1.0))
        return out

    RLTrainer.train_step = timed_step  # type: ignore[method-assign]
    try:
        HybridTrainer(_config(name, model_dir, steps), run_dir=run_dir).train()
    finally:
        RLTrainer.train_step = inner  # type: ignore[method-assign]
    return seconds, rounds


def measure(reps: int, block: int, work: Path, presets: list[str]) -> dict[str, Any]:
    from verl_hpc.models.tiny import init_model

    torch.set_num_threads(THREADS)
    model_dir = work / "model"
    init_model(model_dir, preset=MODEL_PRESET, seed=0)
    per_round: dict[str, list[float]] = {name: [] for name in presets}
    gen_rounds: dict[str, list[float]] = {name: [] for name in presets}
    for rep in range(reps):
        for name in presets:
            seconds, rounds = _block(name, model_dir, block + 1, work / f"{name}-{rep}")
            per_round[name].append(statistics.median(seconds[1:]))
            gen_rounds[name].extend(rounds[1:])
    ratios = {name: [s / g for s, g in zip(per_round[name], per_round["grpo"], strict=True)] for name in presets}
    return {"step_s": {name: _summary(v) for name, v in per_round.items()},
            "generation_rounds": {name: statistics.mean(v) for name, v in gen_rounds.items()},
            "ratios": {f"{name}_vs_grpo": _summary(v) for name, v in ratios.items() if name != "grpo"},
            "raw": per_round}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_presets_", dir=scratch))
    try:
        if quick:
            result = measure(reps=1, block=1, work=work, presets=["grpo", "gspo", "ppo", "dapo"])
        else:
            result = measure(reps=5, block=3, work=work, presets=ONLINE)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["setup"] = {"model": MODEL_PRESET, "prompts": PROMPTS, "n": N, "max_new_tokens": NEW_TOKENS,
                       "lr": LR, "threads": THREADS}
    return result


def table(result: dict[str, Any]) -> str:
    s = result["setup"]
    lines = [f"Preset step cost: {s['model']} model, {s['prompts']} prompts x {s['n']} samples x "
             f"{s['max_new_tokens']} tokens, {s['threads']} thread; s/step median over rounds (min-max)",
             f"{'preset':<24}{'s/step':>8}{'gen rounds':>12}  ratio to grpo"]
    for name, step in result["step_s"].items():
        ratio = result["ratios"].get(f"{name}_vs_grpo")
        shown = f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "1 (baseline)"
        if ratio and name in SAME_WORK:
            shown += f"  target <= {SAME_WORK_TARGET} {'met' if ratio['median'] <= SAME_WORK_TARGET else 'MISSED'}"
        lines.append(f"{name:<24}{step['median']:>8.3f}{result['generation_rounds'][name]:>12.2f}  {shown}")
    return "\n".join(lines)
