"""RL step throughput: verl-hpc's GRPO step vs the raw floor vs TRL's GRPOTrainer.

Same model, prompts (the arithmetic task), group size, response length, batch and optimizer
(AdamW, lr 1e-3, no weight decay, grad clip 1.0, no KL/ref model) for all three, on CPU:
- verl-hpc: `HybridTrainer.train()` on a config like configs/quickstart.yaml, each
  `train_step` (generate, reward, advantages, PPO loss, backward, AdamW) timed;
- floor: what any GRPO step must at least do — one plain HF `generate` of as many completions
  and one forward+backward+AdamW over the same tokens (a REINFORCE-style loss, no metrics);
- TRL: bench/trl_grpo.py in bench/.venv-trl (bench/trl_env.sh), a process that idles between
  its blocks; skipped, with the reason in the result, where absent.
They alternate in blocks of `block` steps inside one run (a wrapper around the trainer's
`train_step` runs the others' blocks between the project's), so load drifts hit all alike.
Targets: verl-hpc / floor <= 1.1, throughput vs TRL >= 1.3. The full run adds the overlapped
step (split placement, `max_staleness: 1`): its throughput above the floor's, and vs TRL.
`--model smollm2`: the same on SmolLM2-135M-Instruct (8 prompts x 4 samples x 64 new tokens,
the memory switches a real model wants on); needs tools/make_smollm2.py's model, and minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import REPO, SMOLLM2, SMOLLM2_MISSING, read_metrics, summary
from verl_hpc.config.loader import apply_overrides
from verl_hpc.data.tasks.arithmetic import make_examples

HERE = Path(__file__).resolve().parent
TRL_PYTHON = HERE / ".venv-trl" / "bin" / "python"
FLOOR_TARGET, TRL_TARGET = 1.1, 1.3
# One intra-op thread for all three: on a shared 2-core machine two OpenMP threads spin
# against other tenants' processes and a step swings 10-100x; one thread stays comparable.
PROMPTS, N, NEW_TOKENS, LR, THREADS = 16, 8, 16, 1e-3, 1


@dataclass(frozen=True)
class Shape:
    """One step's work, the same for all three sides: prompts x samples x new tokens, AdamW lr, threads."""

    prompts: int = PROMPTS
    n: int = N
    new_tokens: int = NEW_TOKENS
    lr: float = LR
    threads: int = THREADS

    def setup(self) -> dict[str, Any]:
        """The shape as every step result records it (`table` reads these keys)."""
        return {"prompts": self.prompts, "n": self.n, "max_new_tokens": self.new_tokens, "lr": self.lr,
                "threads": self.threads}


TINY = Shape()
SMOLLM2_SHAPE = Shape(prompts=8, n=4, new_tokens=64, threads=int(os.environ.get("BENCH_SMOLLM2_THREADS", "2")))
SMOLLM2_REPS = int(os.environ.get("BENCH_SMOLLM2_REPS", "3"))
# "step": the interleaved synchronous step; "overlap": split placement with max_staleness 1, one
# thread per process, against the floor and TRL given both cores.
SMOLLM2_PARTS = os.environ.get("BENCH_SMOLLM2_PARTS", "step,overlap").split(",")
SMOLLM2_OVERRIDES = ["model.remove_padding=true"]  # beyond the defaults (docs/memory.md)


def _config(model_dir: Path, init_preset: str | None, total_steps: int, shape: Shape = TINY,
            overrides: list[str] | None = None) -> dict[str, Any]:
    """The project's side; `overrides` are the CLI's `key.path=value` strings."""
    model: dict[str, Any] = {"path": str(model_dir)}
    if init_preset is not None:  # a locally made random model, rebuilt from its preset if missing
        model.update(init_preset=init_preset, init_seed=0)
    return apply_overrides({
        "model": model,
        "data": {"task": {"name": "arithmetic", "num_prompts": 512, "max_operand": 4, "seed": 0}},
        "reward": {"function": "verl_hpc.data.tasks.arithmetic:score"},
        "algorithm": {"name": "grpo", "sampling": {"n": shape.n, "temperature": 1.0,
                                                   "max_new_tokens": shape.new_tokens},
                      "kl": {"coef": 0.0}},
        "trainer": {"total_steps": total_steps, "batch_size": shape.prompts * shape.n, "seed": 0,
                    "save_hf_model": False, "torch_threads": shape.threads,
                    "actor_optim": {"lr": shape.lr, "grad_clip": 1.0}},
        "checkpoint": {"interval_steps": 10**6},
        "logging": {"tensorboard": False, "progress": "off", "sample_every": 10**6, "num_samples": 0,
                    "log_every": 10**6},
    }, overrides or [])


class Floor:
    """The raw floor: plain generate + one forward/backward/AdamW over the same tokens."""

    def __init__(self, model_dir: Path, prompts: list[str], shape: Shape = TINY) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=shape.lr, weight_decay=0.0)
        self.prompts, self.cursor, self.shape = prompts, 0, shape
        self.phases: list[dict[str, float]] = []  # per step: gen and total seconds

    def step(self) -> float:
        shape = self.shape
        batch = [self.prompts[(self.cursor + i) % len(self.prompts)] for i in range(shape.prompts)
                 for _ in range(shape.n)]
        self.cursor += shape.prompts
        start = time.perf_counter()
        enc = self.tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            seqs = self.model.generate(**enc, do_sample=True, max_new_tokens=shape.new_tokens, temperature=1.0,
                                       top_k=0, top_p=1.0,  # the full distribution, like verl-hpc and TRL
                                       pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
        self.phases.append({"gen": time.perf_counter() - start})
        width = enc["input_ids"].shape[1]
        mask = torch.cat([enc["attention_mask"], (seqs[:, width:] != self.tok.pad_token_id).long()], dim=1)
        logits = self.model(input_ids=seqs, attention_mask=mask, logits_to_keep=seqs.shape[1] - width + 1).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seqs[:, width:, None]).squeeze(-1)
        adv = torch.randn(seqs.shape[0], 1)
        loss = -(logp * adv * mask[:, width:]).sum() / mask[:, width:].sum().clamp(min=1)
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.phases[-1]["step"] = time.perf_counter() - start
        return self.phases[-1]["step"]


class TRLProcess:
    """bench/trl_grpo.py in the TRL venv, run block by block."""

    def __init__(self, model_dir: Path, prompts: list[str], answers: list[str], max_steps: int, out: Path,
                 threads: int = THREADS, shape: Shape = TINY) -> None:
        settings = {"model_dir": str(model_dir), "prompts": prompts, "answers": answers,
                    "batch_size": shape.prompts * shape.n, "n": shape.n, "max_new_tokens": shape.new_tokens,
                    "lr": shape.lr, "max_steps": max_steps, "seed": 0, "threads": threads, "output_dir": str(out)}
        env = {**os.environ, "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"}
        (out / "settings.json").write_text(json.dumps(settings))
        self.proc = subprocess.Popen([str(TRL_PYTHON), str(HERE / "trl_grpo.py"), str(out / "settings.json")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=out)
        self._expect("ready")

    def _expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(word) or (word == "{" and line.startswith("{")):
                return line
        raise RuntimeError(f"TRL process ended (exit {self.proc.wait()}) before printing {word!r}")

    def block(self, steps: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"go {steps}\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("{"))["step_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def trl_unavailable() -> str | None:
    """Why TRL cannot be measured here, or None."""
    missing = f"{TRL_PYTHON} missing: run `bash bench/trl_env.sh` (TRL is not a project dependency)"
    return None if TRL_PYTHON.exists() else missing


def _model_and_prompts(preset: str, model_dir: Path | None) -> tuple[Path, bool, list[str], list[str]]:
    """`model_dir`, or `preset`'s random model made here (then `made`); the task's prompts and answers."""
    made = model_dir is None
    if model_dir is None:
        from verl_hpc.models.tiny import init_model

        model_dir = init_model(Path.home() / ".cache" / "verl-hpc" / "models" / f"{preset}-seed0", preset=preset)
    examples = make_examples(512, 4, 0)
    return model_dir, made, [e["prompt"] for e in examples], [e["ground_truth"] for e in examples]


def measure(preset: str, reps: int, block: int, with_trl: bool, work: Path, shape: Shape = TINY,
            model_dir: Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """One interleaved run for one model; warm-up blocks of each method are dropped.

    `model_dir` None: the random model of `preset`, made here; else an existing HF directory.
    """
    from verl_hpc import HybridTrainer

    model_dir, made, prompts, answers = _model_and_prompts(preset, model_dir)
    total = block * (reps + 1)
    trainer = HybridTrainer(_config(model_dir, preset if made else None, total, shape, overrides),
                            run_dir=work / f"run-{preset}")
    floor = Floor(model_dir, prompts, shape)
    trl_reason = trl_unavailable() if with_trl else "not run in --quick mode"
    (work / f"trl-{preset}").mkdir(exist_ok=True)
    trl = TRLProcess(model_dir, prompts, answers, total, work / f"trl-{preset}", threads=shape.threads,
                     shape=shape) if trl_reason is None else None
    times: dict[str, list[list[float]]] = {"verl_hpc": [], "floor": [], "trl": []}
    current: list[float] = []
    verl_phases: list[dict[str, float]] = []
    from verl_hpc.runtime.step.loop import RLTrainer

    inner = RLTrainer.train_step

    def timed_step(self: RLTrainer, *args: Any, **kwargs: Any) -> dict[str, float]:
        start = time.perf_counter()
        out = inner(self, *args, **kwargs) or {}
        current.append(time.perf_counter() - start)
        verl_phases.append({k.removeprefix("timing_s/"): v for k, v in out.items() if k.startswith("timing_s/")})
        if len(current) == block:  # a project block ended: run the others' blocks now
            times["verl_hpc"].append(current.copy())
            current.clear()
            times["floor"].append([floor.step() for _ in range(block)])
            if trl is not None:
                times["trl"].append(trl.block(block))
        return out

    RLTrainer.train_step = timed_step  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        RLTrainer.train_step = inner  # type: ignore[method-assign]
        if trl is not None:
            trl.close()
    result = _summarise(preset, sum(p.numel() for p in floor.model.parameters()), times, trl_reason)
    result["phases_s"] = {"verl_hpc": _phase_medians(verl_phases[block:]), "floor": _phase_medians(floor.phases[block:])}
    return result


def _phase_medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per phase (the trainer's own timers; the floor's gen and step)."""
    keys = sorted({k for r in rows for k in r})
    return {k: statistics.median([r.get(k, 0.0) for r in rows]) for k in keys}


def _split_run(preset: str | None, model_dir: Path, steps: int, run_dir: Path, shape: Shape = TINY,
               extra: list[str] | None = None) -> list[float]:
    """The trainer's s/step of a split run with `max_staleness: 1` (actor, rollout, reward: a process
    each, one thread each): step k+1 generates while step k trains. `preset` None: a real model."""
    init = [f"model.init_preset={preset}" if preset else "model.init_preset=null"]  # the config names one
    overrides = [f"model.path={model_dir}", *init, f"trainer.total_steps={steps}",
                 f"trainer.batch_size={shape.prompts * shape.n}", f"algorithm.sampling.n={shape.n}",
                 "algorithm.max_staleness=1", f"algorithm.sampling.max_new_tokens={shape.new_tokens}",
                 "algorithm.kl.coef=0", "algorithm.entropy_coef=0", f"trainer.torch_threads={THREADS}",
                 "resources.actor.device_ids=[0]", "resources.rollout.device_ids=[1]",
                 "resources.reward.device_ids=[2]", "trainer.save_hf_model=false", "logging.progress=off",
                 "trainer.actor_optim.grad_clip=1.0", f"trainer.actor_optim.lr={shape.lr}", *(extra or [])]
    cmd = [sys.executable, "-m", "verl_hpc", "train", str(REPO / "configs" / "quickstart_split.yaml"),
           "--run-dir", str(run_dir), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise RuntimeError(f"split run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [r["timing_s/step"] for r in read_metrics(run_dir)]


def measure_overlap(preset: str, reps: int, steps: int, work: Path, with_trl: bool = True,
                    model_dir: Path | None = None, shape: Shape = TINY, extra: list[str] | None = None,
                    trl_threads: tuple[tuple[str, int], ...] = (("trl", THREADS), ("trl_2threads", 2)),
                    ) -> dict[str, Any]:
    """Alternate a floor block, a split max_staleness=1 run and TRL blocks; ratios paired per repetition.

    TRL runs twice per repetition: with one intra-op thread like every process of the
    others, and with two — the cores the overlapped run's processes share — so the
    comparison does not hand the project more hardware than its baseline. `model_dir`: a
    real model (SmolLM2) instead of `preset`'s random one; the floor takes `shape.threads`.
    """
    torch.set_num_threads(shape.threads)
    model_dir, made, prompts, answers = _model_and_prompts(preset, model_dir)
    floor = Floor(model_dir, prompts, shape)
    floor.step()  # warm-up
    trl_reason = trl_unavailable() if with_trl else "not asked for"
    trls: dict[str, TRLProcess] = {}
    if trl_reason is None:
        for name, threads in trl_threads:
            (work / f"{name}-{preset}").mkdir(exist_ok=True)
            trls[name] = TRLProcess(model_dir, prompts, answers, (steps + 1) * reps, work / f"{name}-{preset}",
                                    threads=threads, shape=shape)
    times: dict[str, list[float]] = {"floor": [], "overlapped": [], **{name: [] for name in trls}}
    try:
        for rep in range(reps):
            times["floor"].append(statistics.median([floor.step() for _ in range(steps)]))
            run = _split_run(preset if made else None, model_dir, steps + 2, work / f"split-{preset}-{rep}",
                             shape, extra)
            times["overlapped"].append(statistics.median(run[2:]))
            for name, trl in trls.items():
                times[name].append(statistics.median(trl.block(steps + 1)[1:]))  # first step: warm-up
    finally:
        for trl in trls.values():
            trl.close()
    ratios = {"throughput_overlapped_vs_floor": [f / o for f, o in zip(times["floor"], times["overlapped"],
                                                                        strict=True)]}
    for name in trls:
        ratios[f"throughput_overlapped_vs_{name}"] = [t / o for t, o in zip(times[name], times["overlapped"],
                                                                            strict=True)]
    return {"preset": preset, "trl_skipped": trl_reason, "floor_s": summary(times["floor"]),
            "overlapped_s": summary(times["overlapped"]), "raw": times,
            **{f"{name}_s": summary(times[name]) for name in trls},
            "ratios": {k: summary(v) for k, v in ratios.items()}}


def _summarise(preset: str, params: int, times: dict[str, list[list[float]]], trl_reason: str | None) -> dict:
    """Per-block medians (block 0 dropped as warm-up), then ratios of paired blocks."""
    per_block = {k: [statistics.median(b) for b in v[1:]] for k, v in times.items() if v}
    out: dict[str, Any] = {"preset": preset, "params": params, "trl_skipped": trl_reason,
                           "step_s": {k: summary(v) for k, v in per_block.items()}, "raw": times}
    ratios = {"verl_hpc_vs_floor": [v / f for v, f in zip(per_block["verl_hpc"], per_block["floor"], strict=True)]}
    if "trl" in per_block:
        ratios["throughput_verl_hpc_vs_trl"] = [t / v for v, t in zip(per_block["verl_hpc"], per_block["trl"],
                                                                      strict=True)]
        ratios["trl_vs_floor"] = [t / f for t, f in zip(per_block["trl"], per_block["floor"], strict=True)]
    out["ratios"] = {k: summary(v) for k, v in ratios.items()}
    return out


def run(quick: bool = False, scratch: str | None = None, model: str | None = None) -> dict[str, Any]:
    """The tiny and small random models; `model="smollm2"`: the real model instead."""
    targets = {"verl_hpc_vs_floor": FLOOR_TARGET, "throughput_verl_hpc_vs_trl": TRL_TARGET}
    if model == "smollm2":
        return {"quick": quick, "targets": targets, **_run_smollm2(quick, scratch)}
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_step_", dir=scratch))
    try:
        if quick:
            cases = [measure("tiny", reps=3, block=1, with_trl=False, work=work)]
        else:
            cases = [measure("tiny", reps=12, block=1, with_trl=True, work=work),
                     measure("small", reps=5, block=1, with_trl=True, work=work)]
        overlap = [] if quick else [measure_overlap("tiny", 3, 10, work), measure_overlap("small", 2, 6, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {f"{k}_{c['preset']}": v for c in [*cases, *overlap] for k, v in c["ratios"].items()}
    return {"quick": quick, "setup": TINY.setup(), "targets": targets, "cases": cases, "overlap": overlap,
            "ratios": ratios}


def _run_smollm2(quick: bool, scratch: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"setup": {**SMOLLM2_SHAPE.setup(), "model": str(SMOLLM2)}, "cases": [], "overlap": [],
                           "ratios": {}}
    if not (SMOLLM2 / "config.json").exists():
        return {**out, "skipped": SMOLLM2_MISSING}
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_step_smollm2_", dir=scratch))
    try:
        if quick or "step" in SMOLLM2_PARTS:
            out["cases"] = [measure("smollm2", reps=1 if quick else SMOLLM2_REPS, block=1, with_trl=not quick,
                                    work=work, shape=SMOLLM2_SHAPE, model_dir=SMOLLM2, overrides=SMOLLM2_OVERRIDES)]
        if not quick and "overlap" in SMOLLM2_PARTS:
            out["overlap"] = [measure_overlap("smollm2", 2, 3, work, model_dir=SMOLLM2, shape=SMOLLM2_SHAPE,
                                              extra=SMOLLM2_OVERRIDES, trl_threads=(("trl_2threads", 2),))]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["ratios"] = {f"{k}_smollm2": v for c in [*out["cases"], *out["overlap"]] for k, v in c["ratios"].items()}
    return out


def table(result: dict[str, Any]) -> str:
    s = result["setup"]
    if result.get("skipped"):
        return f"RL step benchmark (SmolLM2-135M-Instruct): skipped: {result['skipped']}"
    name = " (SmolLM2-135M-Instruct)" if "model" in s else ""
    lines = [f"RL step benchmark{name}: {s['prompts']} prompts x {s['n']} samples x {s['max_new_tokens']} tokens, "
             f"AdamW lr {s['lr']}, {s['threads']} threads; s/step median over blocks (min-max)",
             f"{'model':<7}{'params':>8}{'verl-hpc s':>12}{'floor s':>10}{'TRL s':>9}  ratios"]
    for c in result["cases"]:
        st = c["step_s"]
        trl = f"{st['trl']['median']:>9.3f}" if "trl" in st else f"{'-':>9}"
        lines.append(f"{c['preset']:<7}{c['params'] / 1e6:>7.2f}M{st['verl_hpc']['median']:>12.3f}"
                     f"{st['floor']['median']:>10.3f}{trl}")
        for key, r in c["ratios"].items():
            target = result["targets"].get(key)
            verdict = ""
            if target is not None:
                ok = r["median"] <= target if key == "verl_hpc_vs_floor" else r["median"] >= target
                verdict = f"  target {'<=' if key == 'verl_hpc_vs_floor' else '>='} {target} " \
                          f"{'met' if ok else 'MISSED'}"
            lines.append(f"{'':<27}{key:<30}{r['median']:>6.2f} ({r['min']:.2f}-{r['max']:.2f}){verdict}")
        if c["trl_skipped"]:
            lines.append(f"{'':<27}TRL skipped: {c['trl_skipped']}")
        for side, row in c.get("phases_s", {}).items() if "model" in s else ():
            lines.append(f"  {side} phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    lines += overlap_lines(result.get("overlap", []))
    return "\n".join(lines)


def overlap_lines(overlap: list[dict[str, Any]]) -> list[str]:
    lines = []
    for o in overlap:
        r = o["ratios"]["throughput_overlapped_vs_floor"]
        lines.append(f"{o['preset']:<7} split, max_staleness 1: {o['overlapped_s']['median']:.3f} s/step vs floor "
                     f"{o['floor_s']['median']:.3f}: throughput {r['median']:.2f}x the floor "
                     f"({r['min']:.2f}-{r['max']:.2f})  target > 1 {'met' if r['median'] > 1 else 'MISSED'}")
        for name in ("trl", "trl_2threads"):
            if f"throughput_overlapped_vs_{name}" in o["ratios"]:
                r = o["ratios"][f"throughput_overlapped_vs_{name}"]
                lines.append(f"{'':<8}vs {name} ({o[f'{name}_s']['median']:.3f} s/step): throughput "
                             f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})  target >= {TRL_TARGET} "
                             f"{'met' if r['median'] >= TRL_TARGET else 'MISSED'}")
        if o.get("trl_skipped"):
            lines.append(f"{'':<8}TRL skipped: {o['trl_skipped']}")
    return lines
