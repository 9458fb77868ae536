"""Agent steps: tool latency hidden by concurrency, and what tools cost a real model's step.

`python -m bench agent_step`. Two measurements, each side by side with its baseline in one run:

- **Tool latency** (64 episodes of 4 turns, every turn a tool call): one embedded GRPO run per
  model whose steps alternate the tool's behaviour — instant, sleeping 100 ms, and sleeping
  100 ms one call at a time (the serial arrangement: what a loop that runs episodes' tools one
  after another would pay). Target: the sleeping step <= 1.2x the instant one, on `small-agent`
  (~20M parameters, compute-bound like a real model's step). `tiny-agent` is reported beside it:
  its whole instant step (~0.5 s) is shorter than an episode's three dependent 100 ms waits, so
  no concurrency can bring it under (0.5 + 0.3) / 0.5 = 1.6x.
- **Real model** (SmolLM2-135M-Instruct, the GSM8K-style example with a calculator tool and the
  hermes template, each prompt opening with six problems solved through the calculator, so that
  the model calls it): each multi-turn step of the project is followed by the floor for the same
  rows — one plain HF generate of exactly as many new tokens per row as the step's episodes
  sampled (their model tokens, tool replies not counted) from the same prompts, then the
  training the step does for them: a reference forward (the config has a KL) and one
  forward/backward/AdamW, checkpointed when the run's memory plan switched checkpointing on (it
  does on CPU). Target: the step with tools <= 1.3x that floor. Needs the
  model (`.venv/bin/python tools/make_smollm2.py`); skipped, with the reason, without it or in
  --quick mode.

Steps alternate within one run, so a drift in the machine's load hits every side alike; the
first step of each run is a warm-up and is dropped.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import SMOLLM2, SMOLLM2_MISSING
from bench import summary as _summary

HERE = Path(__file__).resolve().parent
LATENCY_TARGET, REAL_MODEL_TARGET = 1.2, 1.3
TOOL_SLEEP_S = 0.1
MODES = ("instant", "sleep", "serial")
MODE = "instant"  # how `peek` behaves in the current step (set between steps)
_ONE_AT_A_TIME = threading.Lock()


def peek(**state: Any) -> str:
    """Look inside the box and tell what digit it holds."""
    if MODE == "sleep":
        time.sleep(TOOL_SLEEP_S)
    elif MODE == "serial":
        with _ONE_AT_A_TIME:
            time.sleep(TOOL_SLEEP_S)
    return str(state.get("digit", "empty"))


def _timed_steps(trainer: Any, after: Callable[[Any, int], None]) -> list[tuple[float, dict[str, float]]]:
    """Run `trainer` to its end, timing every `train_step`; `after(rl_trainer, step)` runs after each."""
    from verl_hpc.runtime.step.loop import RLTrainer

    inner, steps = RLTrainer.train_step, []

    def timed(self: RLTrainer, *args: Any, **kwargs: Any) -> dict[str, float] | None:
        start = time.perf_counter()
        out = inner(self, *args, **kwargs) or {}
        steps.append((time.perf_counter() - start, dict(out)))
        after(self, len(steps))
        return out

    RLTrainer.train_step = timed  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        RLTrainer.train_step = inner  # type: ignore[method-assign]
    return steps


def _always_calling(model_dir: Path) -> torch.nn.Module:
    """The tiny-agent policy with a head that always writes the one-token `peek` call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.models.tiny_agent import PEEK_CALL

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-20.0)
        head.bias[AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(PEEK_CALL)] = 20.0
    model.lm_head = head
    return model


def measure_latency(work: Path, episodes: int, reps: int, preset: str) -> dict[str, Any]:
    """Step seconds with an instant, a sleeping and a serially sleeping tool, alternating step by step."""
    global MODE
    from verl_hpc import HybridTrainer
    from verl_hpc.models.tiny import init_model

    model_dir = init_model(work / preset, preset=preset, seed=0)
    order = ["instant", *[m for _ in range(reps) for m in MODES]]  # step 1: a warm-up
    config = {
        "model": {"path": str(model_dir)},
        "data": {"task": {"name": "hidden_digit", "num_prompts": 64, "max_operand": 3, "seed": 0}},
        "reward": {"function": "verl_hpc.data.tasks.hidden_digit:score"},
        "rollout": {"multi_turn": {"enable": True, "tools": ["bench.agent_step:peek"], "max_assistant_turns": 4,
                                   "tool_workers": episodes, "tool_timeout_seconds": 60}},
        "algorithm": {"name": "grpo", "sampling": {"n": 8, "max_new_tokens": 8}, "kl": {"coef": 0.0}},
        "trainer": {"total_steps": len(order), "batch_size": episodes, "seed": 0, "torch_threads": 1,
                    "save_hf_model": False, "actor_optim": {"lr": 1e-7}},  # the forced policy stays forced
        "checkpoint": {"interval_steps": 10**6},
        "logging": {"tensorboard": False, "progress": "off", "num_samples": 0, "sinks": []}}
    MODE = order[0]

    def next_mode(_: Any, done: int) -> None:
        global MODE
        MODE = order[min(done, len(order) - 1)]

    trainer = HybridTrainer(config, actor_model=_always_calling(model_dir), run_dir=work / f"latency-{preset}")
    steps = _timed_steps(trainer, next_mode)
    MODE = "instant"
    seconds = {m: [s for (s, _), mode in zip(steps[1:], order[1:], strict=True) if mode == m] for m in MODES}
    turns = statistics.median(out.get("agent/num_turns/mean", 0.0) for _, out in steps)
    calls = statistics.median(out.get("agent/tool_calls/mean", 0.0) for _, out in steps)
    return {"model": preset, "episodes": episodes, "turns": turns, "tool_calls_per_episode": calls, "tool_sleep_s": TOOL_SLEEP_S,
            "step_s": {m: _summary(v) for m, v in seconds.items()},
            "ratios": {"sleeping_tool_vs_instant": _summary([s / i for s, i in zip(seconds["sleep"],
                                                                                    seconds["instant"], strict=True)]),
                       "serial_tool_vs_instant": _summary([s / i for s, i in zip(seconds["serial"],
                                                                                  seconds["instant"], strict=True)])}}


class TokenFloor:
    """The floor for a step's rows: generate exactly their model tokens from their prompts, then the
    training the project's step does for them — a reference forward when the run has a KL, and one
    forward/backward/AdamW, with activation checkpointing when the run's plan switched it on — and
    nothing else (no tools, no turns, no metrics)."""

    def __init__(self, model_dir: Path, lr: float) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.ref: torch.nn.Module | None = None
        self.checkpointing = False

    def like(self, checkpointing: bool, ref: bool) -> None:
        """Train as the project's step does: its plan's checkpointing, its reference forward."""
        if checkpointing and not self.checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.checkpointing = checkpointing
        if ref and self.ref is None:
            self.ref = copy.deepcopy(self.model).eval()

    def step(self, prompt_ids: list[list[int]], new_tokens: int) -> float:
        start = time.perf_counter()
        width = max(len(p) for p in prompt_ids)
        pad = self.tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
        attention = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompt_ids])[:, None]).long()
        self.model.eval()
        with torch.no_grad():
            seqs = self.model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=1.0,
                                       top_k=0, top_p=1.0, min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                                       pad_token_id=pad)
        mask = torch.cat([attention, torch.ones_like(seqs[:, width:])], dim=1)
        if self.ref is not None:
            with torch.no_grad():
                self.ref(input_ids=seqs, attention_mask=mask, logits_to_keep=new_tokens + 1)
        self.model.train()
        logits = self.model(input_ids=seqs, attention_mask=mask, logits_to_keep=new_tokens + 1).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seqs[:, width:, None]).squeeze(-1)
        loss = -(logp * torch.randn(seqs.shape[0], 1)).mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def _gsm8k_data(work: Path, count: int) -> Path:
    spec = importlib.util.spec_from_file_location("gsm8k_make_data", HERE.parent / "examples" / "gsm8k" / "make_data.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.write(work / "gsm8k", count=count, tool_shots=6)  # the tools config's data


def measure_real_model(work: Path, reps: int) -> dict[str, Any]:
    """SmolLM2 with the calculator: each project step, then the floor for the same rows' model tokens."""
    from verl_hpc import HybridTrainer
    from verl_hpc.config.loader import load_config

    config = load_config(HERE.parent / "configs" / "smollm2_gsm8k_tools.yaml", [
        f"model.path={SMOLLM2}", f"data.train_files=[{_gsm8k_data(work, 16)}]", f"trainer.total_steps={reps + 1}",
        "algorithm.sampling.max_new_tokens=64",  # a call is ~30 tokens: room for it and the answer after
        "logging.progress=off", "logging.num_samples=0", "logging.sinks=[]", "checkpoint.interval_steps=1000000",
        "trainer.torch_threads=2"])
    floor = TokenFloor(SMOLLM2, config.trainer.actor_optim.lr)
    pairs: list[tuple[float, float, float]] = []  # (project s, floor s, model tokens per row)

    def floor_after(rl: Any, _: int) -> None:
        floor.like(rl.cfg.model.gradient_checkpointing, ref=rl.cfg.algorithm.needs_ref)
        batch = rl.last_batch
        per_row = float(batch.loss_mask().sum()) / len(batch)
        pairs.append((0.0, floor.step(batch.column("prompt_ids").to_pylist(), max(1, round(per_row))), per_row))

    trainer = HybridTrainer(config.model_dump(mode="json", by_alias=True), run_dir=work / "smollm2")
    steps = _timed_steps(trainer, floor_after)
    rows = [(s, f, t, out) for (s, out), (_, f, t) in zip(steps, pairs, strict=True)][1:]
    return {"model": str(SMOLLM2), "rows_per_step": config.trainer.batch_size,
            "model_tokens_per_row": statistics.median(t for _, _, t, _ in rows),
            "tool_calls_per_episode": statistics.median(o.get("agent/tool_calls/mean", 0.0) for *_, o in rows),
            "turns": statistics.median(o.get("agent/num_turns/mean", 0.0) for *_, o in rows),
            "step_s": {"with_tools": _summary([s for s, *_ in rows]), "floor": _summary([f for _, f, *_ in rows])},
            "ratios": {"tools_step_vs_floor": _summary([s / f for s, f, *_ in rows])}}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_agent_", dir=scratch))
    out: dict[str, Any] = {"quick": quick, "targets": {"sleeping_tool_vs_instant": LATENCY_TARGET,
                                                       "tools_step_vs_floor": REAL_MODEL_TARGET}}
    try:
        episodes, reps = (16, 1) if quick else (64, 3)  # --quick: the code path on the tiny model only
        out["latency"] = measure_latency(work, episodes, reps, preset="tiny-agent" if quick else "small-agent")
        if not quick:
            out["latency_tiny"] = measure_latency(work, episodes, reps, preset="tiny-agent")
        if quick:
            out["real_model"] = {"skipped": "not run in --quick mode (minutes of SmolLM2 steps)"}
        elif not (SMOLLM2 / "config.json").exists():
            out["real_model"] = {"skipped": SMOLLM2_MISSING}
        else:
            out["real_model"] = measure_real_model(work, reps=3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tiny = {f"tiny_agent_{key}": r for key, r in out.get("latency_tiny", {}).get("ratios", {}).items()}
    out["ratios"] = {**out["latency"]["ratios"], **tiny, **out["real_model"].get("ratios", {})}
    return out


def _verdict(key: str, value: float, targets: dict[str, float]) -> str:
    target = targets.get(key)
    return "" if target is None else f"  target <= {target} {'met' if value <= target else 'MISSED'}"


def _latency_lines(lat: dict[str, Any], targets: dict[str, float]) -> list[str]:
    st = lat["step_s"]
    lines = [f"  {lat['model']}: {lat['episodes']} episodes, {lat['turns']:.1f} turns, "
             f"{lat['tool_calls_per_episode']:.1f} tool calls each; s/step median (min-max)",
             f"    instant tool {st['instant']['median']:.3f}, tool sleeping {lat['tool_sleep_s']:.1f} s "
             f"{st['sleep']['median']:.3f}, the same tool one call at a time (serial) {st['serial']['median']:.3f}"]
    for key, r in lat["ratios"].items():
        lines.append(f"    {key:<26}{r['median']:>6.2f} ({r['min']:.2f}-{r['max']:.2f}){_verdict(key, r['median'], targets)}")
    return lines


def table(result: dict[str, Any]) -> str:
    targets = result["targets"]
    lines = ["agent step benchmark:", *_latency_lines(result["latency"], targets)]
    if "latency_tiny" in result:  # beside it, not judged: the tiny model's step is shorter than the waits
        lines += _latency_lines(result["latency_tiny"], {})
    real = result["real_model"]
    if real.get("skipped"):
        lines.append(f"  SmolLM2 with a calculator: skipped: {real['skipped']}")
        return "\n".join(lines)
    r = real["ratios"]["tools_step_vs_floor"]
    lines.append(f"  SmolLM2 with a calculator: {real['rows_per_step']} episodes, {real['turns']:.1f} turns, "
                 f"{real['tool_calls_per_episode']:.1f} calls, {real['model_tokens_per_row']:.0f} model tokens each: "
                 f"step {real['step_s']['with_tools']['median']:.2f} s vs floor {real['step_s']['floor']['median']:.2f} s")
    lines.append(f"  {'tools_step_vs_floor':<28}{r['median']:>6.2f} ({r['min']:.2f}-{r['max']:.2f})"
                 f"{_verdict('tools_step_vs_floor', r['median'], targets)}")
    return "\n".join(lines)
