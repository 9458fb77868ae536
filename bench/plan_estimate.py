"""The memory plan's estimate against the measured peak of whole steps, per model and response length.

`python -m bench plan_estimate`. Each case is a fresh `verl-hpc train` process of 2 GRPO steps (so
AdamW's state exists) with every setting at its default (`model.memory_plan: auto`); the run logs,
per step, the plan's estimate for the step's real shape (`memory/plan_estimate_gb`) beside the
measured peak of the step (`memory/step_peak_gb`). The ratio is of the largest of each over the run
(on CPU the measured peak is the resident set's high-water mark, which never falls). Cases: the
tiny (0.2M) and small (19M) presets on the arithmetic task, and SmolLM2-135M-Instruct on the
GSM8K-style data (skipped without its model), each at 64 and 512 new tokens; `--quick`: the tiny
model at 64 only.

Target (issue: a memory plan that fits by default): every estimate within 20% of its measured peak.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import REPO, SMOLLM2, read_metrics, single

TARGET = 0.2  # |estimate / measured - 1|
STEPS = ["trainer.total_steps=2", "checkpoint.interval_steps=100", "logging.progress=off", "trainer.torch_threads=2",
         "trainer.save_hf_model=false"]


def cases(quick: bool, data: Path | None) -> dict[str, list[str]]:
    """name -> `verl-hpc train` arguments (config, overrides)."""
    task = [str(REPO / "configs" / "quickstart.yaml"), "trainer.batch_size=16", "algorithm.sampling.n=4"]
    out = {}
    for preset in ("tiny",) if quick else ("tiny", "small"):
        for tokens in (64,) if quick else (64, 512):
            out[f"{preset}/{tokens}"] = [*task, f"model.init_preset={preset}", f"algorithm.sampling.max_new_tokens={tokens}"]
    if not quick and data is not None:
        for tokens in (64, 512):
            out[f"smollm2/{tokens}"] = [
                str(REPO / "configs" / "smollm2_gsm8k.yaml"), f"model.path={SMOLLM2}", f"data.train_files=[{data}]",
                "~data.val_files", "~trainer.test_freq", "trainer.val_before_train=false", "trainer.batch_size=8",
                "algorithm.sampling.n=4", f"algorithm.sampling.max_new_tokens={tokens}"]
    return out


def measure(name: str, args: list[str], work: Path) -> dict[str, Any]:
    run_dir = work / name.replace("/", "-")
    config, *overrides = args
    if "model.path=" not in " ".join(overrides):  # a preset: built in the scratch folder
        overrides.append(f"model.path={work / 'models' / name.split('/')[0]}")
    cmd = [sys.executable, "-m", "verl_hpc", "train", config, "--run-dir", str(run_dir), *overrides, *STEPS]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, text=True,
                          capture_output=True, timeout=3600, check=False)
    if done.returncode != 0:
        return {"failed": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    rows = [r for r in read_metrics(run_dir) if "memory/plan_estimate_gb" in r]
    # The largest of each over the run: on CPU the measured peak is the resident set's high-water mark,
    # which never falls (freed memory stays with the allocator), so a later, shorter step still shows
    # the peak of an earlier, longer one.
    estimate = max(r["memory/plan_estimate_gb"] for r in rows)
    measured = max(r["memory/step_peak_gb"] for r in rows)
    return {"estimate_gb": estimate, "measured_gb": measured, "ratio": estimate / measured,
            "response_tokens": max(r.get("response_length/max", 0) for r in rows)}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_plan_", dir=scratch))
    try:
        data = None
        if not quick and (SMOLLM2 / "config.json").exists():
            from bench.memory import _gsm8k

            data = _gsm8k(work / "gsm8k")
        results = {name: measure(name, args, work) for name, args in cases(quick, data).items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"quick": quick, "target": TARGET, "cases": results,
                           "ratios": {f"estimate_vs_measured/{n}": single(r["ratio"]) for n, r in results.items()
                                      if "ratio" in r}}
    if not quick and data is None:
        out["smollm2_skipped"] = f"{SMOLLM2} missing: run `.venv/bin/python tools/make_smollm2.py`"
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["plan estimate benchmark: the memory plan's largest estimate against the measured peak (2 steps, "
             "defaults)", f"{'case':<16}{'estimate GB':>12}{'measured GB':>12}{'ratio':>8}{'longest reply':>15}"]
    worst = 0.0
    for name, case in result["cases"].items():
        if "failed" in case:
            lines.append(f"{name:<16} failed: {case['failed'][-300:]}")
            worst = float("inf")
            continue
        worst = max(worst, abs(case["ratio"] - 1))
        lines.append(f"{name:<16}{case['estimate_gb']:>12.2f}{case['measured_gb']:>12.2f}{case['ratio']:>8.2f}"
                     f"{case['response_tokens'] or 0:>15.0f}")
    if result.get("smollm2_skipped"):
        lines.append(f"smollm2: skipped: {result['smollm2_skipped']}")
    verdict = "met" if worst <= result["target"] else "MISSED"
    lines.append(f"target: every estimate within {result['target']:.0%} of its measured peak: {verdict} "
                 f"(worst {worst:.0%} off)")
    return "\n".join(lines)
