"""`python -m bench all --quick` completes and every benchmark reports well-formed ratios.

Times are never asserted (CI machines are shared and noisy); what must hold is that
each benchmark ran its project side and its baseline in the same run, wrote its JSON
next to a printed table, and produced finite, ordered ratio summaries.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import BENCHMARKS

REPO = Path(__file__).resolve().parents[2]


def build_smollm2() -> Path:
    """tools/make_smollm2.py's model (built once, then reused): the memory benchmark measures it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_smollm2", REPO / "tools" / "make_smollm2.py")
    maker = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(maker)  # type: ignore[union-attr]
    return Path(maker.build())


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """One `bench all --quick` for every test here: the memory benchmark's SmolLM2 run included."""
    build_smollm2()
    out = tmp_path_factory.mktemp("bench_results")
    scratch = tmp_path_factory.mktemp("bench_scratch")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench", "all", "--quick", "--out", str(out), "--dir", str(scratch)],
                          cwd=REPO, env=env, text=True, capture_output=True, timeout=1200)
    return proc, out


@pytest.mark.slow
def test_bench_all_quick_completes(quick_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    proc, out = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.json")) == sorted(f"{name}-quick.json" for name in BENCHMARKS)
    for name in BENCHMARKS:
        assert f"results: {out / f'{name}-quick.json'}" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_ratios_are_finite_and_ordered(quick_run: tuple[subprocess.CompletedProcess, Path], name: str) -> None:
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / f"{name}-quick.json").read_text())
    assert result["benchmark"] == name and result["quick"] is True
    assert {"host", "platform", "cpus", "when"} <= set(result["machine"])
    if result.get("skipped"):  # allowed only with a reason, printed in its table
        assert f"skipped: {result['skipped']}" in proc.stdout
        return
    assert result["ratios"], f"{name} reported no ratio"
    for key, summary in result["ratios"].items():
        values = (summary["min"], summary["median"], summary["max"])
        assert all(math.isfinite(v) and v > 0 for v in values), (key, summary)
        assert summary["min"] <= summary["median"] <= summary["max"], (key, summary)


@pytest.mark.slow
def test_bench_tables_name_targets(quick_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    proc, _ = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    for header in ("checkpoint benchmark:", "transport benchmark:", "weight sync benchmark:", "RL step benchmark:",
                   "preemption benchmark:", "memory benchmark:", "environment step benchmark:"):
        assert header in proc.stdout
    assert proc.stdout.count(" met") + proc.stdout.count(" MISSED") >= len(BENCHMARKS)


@pytest.mark.slow
def test_weight_sync_bench_checks_the_weights(quick_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    """A fast but wrong sync must not pass: the receiver's weights equal the sender's."""
    _, out = quick_run
    result = json.loads((out / "weight_sync-quick.json").read_text())
    assert {case["sender"] for case in result["cases"]} == {"runtime", "packed", "fsdp", "direct"}
    assert all(case["weights_equal"] for case in result["cases"])


def test_model_flag_picks_the_real_model_variant(capsys: pytest.CaptureFixture[str]) -> None:
    """`--model smollm2` maps `step` to its real-model module; with any other benchmark it is refused."""
    from bench.__main__ import MODEL_VARIANTS, OPT_IN, main

    assert MODEL_VARIANTS[("step", "smollm2")] in OPT_IN
    with pytest.raises(SystemExit) as exit_info:
        main(["transport", "--model", "smollm2"])
    assert exit_info.value.code == 2
    assert "--model smollm2 goes with: step" in capsys.readouterr().err


@pytest.mark.parametrize(("module", "options"), [("bench.step", {"model": "smollm2"}), ("bench.memory", {})])
def test_a_smollm2_benchmark_without_the_model_is_skipped_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path, module: str,
                                                                         options: dict[str, str]) -> None:
    import importlib

    bench_module = importlib.import_module(module)
    monkeypatch.setattr(bench_module, "SMOLLM2", tmp_path / "absent")
    result = bench_module.run(quick=True, **options)
    assert "tools/make_smollm2.py" in result["skipped"]
    assert bench_module.table(result).endswith(result["skipped"])


def test_model_state_bound_counts_five_fp32_copies(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from bench.memory import model_state_bytes

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).parameters())
    assert model_state_bytes(tiny_model_dir) == 5 * 4 * params


@pytest.mark.slow
def test_step_memory_measures_whole_smollm2_steps(quick_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    """`bench memory --quick` (in `bench all --quick`): a real `verl-hpc train` run of SmolLM2 with every
    switch on, its peaks read back (the full benchmark runs every variant)."""
    import bench.memory as step_memory

    assert build_smollm2() == step_memory.SMOLLM2
    _, out = quick_run
    result = json.loads((out / "memory-quick.json").read_text())
    weights = step_memory.model_state_bytes(step_memory.SMOLLM2) / 5
    assert sorted(result["variants"]) == ["all"]
    for variant in result["variants"].values():
        assert "failed" not in variant, variant
        assert variant["rank_peak_rss_gb"] * 2**30 > weights  # the run held at least the policy's weights
        assert variant["peak_rss_bytes"] >= variant["rank_peak_rss_gb"] * 2**30 * 0.9
        assert len(variant["step_s"]) == 2
    assert "target: peak <= bound" in step_memory.table(result)


def test_the_defaults_are_timed_against_the_fastest_hand_set_variant() -> None:
    from bench.memory import defaults_vs_hand_set

    variants = {"plain": {"step_s": [9.0, 1.0]}, "defaults": {"step_s": [9.0, 6.0]},
                "all": {"step_s": [9.0, 5.0]}, "remove_padding": {"step_s": [9.0, 4.0]}, "x": {"failed": "exit 1"}}
    assert defaults_vs_hand_set(variants) == {"step_time_vs_best_hand_set/defaults":
                                              {"median": 1.5, "min": 1.5, "max": 1.5}}  # plain is no switch
    assert defaults_vs_hand_set({"defaults": {"step_s": [1.0]}}) == {}


def test_the_environment_benchmark_plays_the_real_game_at_the_stated_cost() -> None:
    import time

    from bench.env_step import BusyGuess

    env = BusyGuess(work_ms=30.0, kind="cpu")
    first = env.reset(seed=5)
    assert "number" in first.prompt and env.game.game.state.game_state["game_number"] > 0  # TextArena's game
    started_cpu = time.thread_time()
    reply = env.step(None)
    assert time.thread_time() - started_cpu >= 0.03  # a step costs its CPU on the calling thread
    assert env.state.step_count == 1 and ("higher" in reply.prompt or "lower" in reply.prompt or reply.done)


def test_the_plan_estimate_benchmark_judges_every_case() -> None:
    from bench.plan_estimate import cases, table

    assert list(cases(True, None)) == ["tiny/64"]
    assert list(cases(False, Path("/data.parquet"))) == ["tiny/64", "tiny/512", "small/64", "small/512",
                                                         "smollm2/64", "smollm2/512"]
    close = {"estimate_gb": 1.1, "measured_gb": 1.0, "ratio": 1.1, "response_tokens": 64}
    assert "target: every estimate within 20% of its measured peak: met (worst 10% off)" in table(
        {"target": 0.2, "cases": {"tiny/64": close}})
    far = {**close, "ratio": 0.7}
    assert ": MISSED (worst 30% off)" in table({"target": 0.2, "cases": {"tiny/64": close, "small/64": far}})
