"""vLLM rollouts through the CLI: the quickstart learns, the engine starts once per run,
and in split placement the broadcast weights land in the engine in place."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_cli
from verl_hpc.metrics import read_jsonl_metrics

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]
VLLM_ROLLOUT = ("resources.rollout={device_type: cpu, device_ids: [2], strategy: vllm, "
                "vllm_args: {dtype: float32, enforce_eager: true, kv_cache_space_gb: 1}}")


def _engine_processes(under: Path) -> list[psutil.Process]:
    """This test's engines: their command line names its model, which lives under the test's tmp dir
    (other pytest sessions run engines of their own at the same time)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "verl_hpc.roles.rollout.vllm_server" in cmdline and str(under) in cmdline:
            found.append(proc)
    return found


def _starts(run_dir: Path) -> int:
    return sum(log.read_text().count("vllm engine started") for log in (run_dir / "logs").glob("*_rank*.log")
               if not log.name.startswith("vllm_engine"))


def test_quickstart_vllm_learns_with_one_engine_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/quickstart_vllm.yaml", "--run-dir", str(run_dir),
                   f"model.path={tmp_path / 'model'}", "trainer.total_steps=50", "trainer.save_hf_model=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert len(rows) == 50
    scores = [r["critic/score/mean"] for r in rows]
    assert sum(scores[-10:]) / 10 > sum(scores[:5]) / 5 + 0.05, scores  # the reward rises
    assert _starts(run_dir) == 1  # one engine for the whole run, not one per step
    assert all(r["perf/weight_sync_bytes"] > 0 and r["timing_s/update_weights"] > 0 for r in rows)
    assert rows[-1]["actor/policy_version"] == 50
    assert not _engine_processes(tmp_path)


@pytest.mark.parametrize("preset", ["tiny-hd32", "tiny-llama"])
def test_split_rollout_rank_serves_vllm_and_takes_broadcast_weights(tmp_path: Path, preset: str) -> None:
    """Qwen2 (tied head) and Llama (untied): the engine follows every update (its probabilities are the trainer's)."""
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/quickstart_split.yaml", "--run-dir", str(run_dir),
                   f"model.path={tmp_path / 'model'}", f"model.init_preset={preset}",
                   "trainer.total_steps=4", "trainer.save_hf_model=false", VLLM_ROLLOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _starts(run_dir) == 1
    rollout = read_jsonl_metrics(next((run_dir / "tensorboard").glob("rollout_rank*")) / "metrics.jsonl")
    assert [r["rollout/policy_version"] for r in rollout] == [0, 1, 2, 3]  # a new version every step
    assert all(r["perf/weight_sync_bytes"] > 0 for r in rollout[1:])
    trained = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert len(trained) == 4
    assert all(r["training/rollout_probs_diff_max"] < 1e-3 for r in trained), \
        [r["training/rollout_probs_diff_max"] for r in trained]
    # two FSDP2 trainer ranks (quickstart_split): each sent its own rows into vLLM's loader, no gather
    assert "every trainer rank sends its own rows" in (run_dir / "logs" / "trainer_rank0.log").read_text()
    assert not _engine_processes(tmp_path)


def test_colocated_fsdp_ranks_each_drive_an_engine_and_export(tmp_path: Path) -> None:
    """Hybrid engine with vLLM: 2 FSDP ranks, each with its own engine fed from the gathered shards."""
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/quickstart_colocated.yaml", "--run-dir", str(run_dir),
                   f"model.path={tmp_path / 'model'}", "model.init_preset=tiny-hd32", "trainer.total_steps=3",
                   "resources.rollout={device_type: cpu, device_ids: [0, 1], strategy: vllm, "
                   "vllm_args: {dtype: float32, enforce_eager: true}}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _starts(run_dir) == 2  # one per trainer rank, for the whole run
    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert [r["actor/policy_version"] for r in rows] == [1, 2, 3]
    assert all(r["perf/weight_sync_bytes"] > 0 for r in rows)
    assert (run_dir / "hf_model" / "config.json").exists()  # exported from the actor, not the engine
    assert not _engine_processes(tmp_path)


def test_serve_answers_from_the_configs_vllm_engine_and_stops_it(tmp_path: Path) -> None:
    """`verl-hpc serve CONFIG` on `strategy: vllm`: the generate endpoint samples from the vLLM child, and
    SIGTERM ends the server with its engine."""
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from tests.conftest import REPO

    proc = subprocess.Popen([sys.executable, "-m", "verl_hpc", "serve", "configs/quickstart_vllm.yaml",
                             f"model.path={tmp_path / 'model'}", "--port", "0"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while not line.startswith("verl-hpc serve: ") and proc.poll() is None:
            line = proc.stdout.readline()  # type: ignore[union-attr]  # the vLLM child logs here too
        assert line.startswith("verl-hpc serve: http://127.0.0.1:"), line
        assert len(_engine_processes(tmp_path)) == 1
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "temperature": 0.8}}
        request = urllib.request.Request(line.split()[2], json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            choice = json.loads(reply.read())["choices"][0]
        assert 1 <= len(choice["token_ids"]) <= 4
        assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    finally:
        proc.terminate()
    assert proc.wait(timeout=120) == 0
    deadline = time.monotonic() + 30
    while _engine_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _engine_processes(tmp_path)
