"""Stop anywhere, resume exactly: SIGKILL after a checkpoint, resume on other world sizes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.e2e.test_train_e2e import scalars
from verl_hpc.metrics import read_jsonl_metrics

pytestmark = pytest.mark.slow
VOLATILE = ("timing_s/", "perf/", "memory/")  # wall-clock and memory readings, not training state


def _steps(run_dir: Path, tag: str = "critic/score/mean") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _train(run_dir: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = run_cli("train", "configs/quickstart_split.yaml", "--run-dir", str(run_dir), f"model.path={model}",
                   "checkpoint.interval_steps=4", "logging.progress=off", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("staleness", [0, 1])
def test_sigkill_after_a_checkpoint_then_resume_is_exact(tmp_path: Path, tiny_model_dir: Path,
                                                          staleness: int) -> None:
    """With max_staleness 1 the rollouts generated ahead ride in the checkpoint (Arrow IPC)."""
    steps = ["trainer.total_steps=14", f"algorithm.max_staleness={staleness}"]
    _train(tmp_path / "whole", tiny_model_dir, *steps)
    interrupted = tmp_path / "interrupted"
    cli = subprocess.Popen([sys.executable, "-m", "verl_hpc", "train", "configs/quickstart_split.yaml",
                            "--run-dir", str(interrupted), f"model.path={tiny_model_dir}", *steps,
                            "checkpoint.interval_steps=4", "logging.progress=off", "trainer.total_steps=400"],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    marker = interrupted / "checkpoints" / "step_00000008" / "manifest.json"
    deadline = time.monotonic() + 180
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(cli.pid, signal.SIGKILL)  # the launcher dies at once; its workers follow (parent-death signal)
    cli.wait()
    assert marker.exists()
    # It ran under total_steps=400 so as to be still training when killed: ending it at 14 is a
    # change of the run's config, which a resume takes only when told (run_dir.py).
    _train(interrupted, tiny_model_dir, *steps, "--allow-config-change")  # resumes from the newest checkpoint
    whole, resumed = scalars(tmp_path / "whole"), scalars(interrupted)
    assert _steps(interrupted) == list(range(1, 15))  # no step missing or shown twice
    compared = [tag for tag in whole if not tag.startswith(VOLATILE)]
    assert len(compared) > 15
    for tag in compared:
        assert resumed[tag] == whole[tag], tag  # bitwise: same numbers, step by step


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, Path]:
    """(5 steps uninterrupted, 4 steps) on the split config's two actor ranks: both resharding
    tests start from the same two runs, trained once."""
    root = tmp_path_factory.mktemp("two_rank_runs")
    _train(root / "whole", tiny_model_dir, "trainer.total_steps=5")
    _train(root / "four", tiny_model_dir, "trainer.total_steps=4")
    return root / "whole", root / "four"


@pytest.mark.parametrize("actor_ids", ["[0]", "[0,1,2,3]"])
def test_resume_on_another_number_of_actor_processes(tmp_path: Path, tiny_model_dir: Path, actor_ids: str,
                                                     two_rank_runs: tuple[Path, Path]) -> None:
    whole, four = two_rank_runs
    resharded = tmp_path / "resharded"
    shutil.copytree(four, resharded)  # each test resumes a copy of its own
    proc = _train(resharded, tiny_model_dir, "trainer.total_steps=5", f"resources.actor.device_ids={actor_ids}",
                  "resources.rollout.device_ids=[4]", "resources.reward.device_ids=[5]",
                  "--allow-config-change")  # more steps is a change of the run's config; resources are not
    assert proc.returncode == 0
    expected = read_jsonl_metrics(whole / "tensorboard" / "metrics.jsonl")[4]
    got = read_jsonl_metrics(resharded / "tensorboard" / "metrics.jsonl")[4]
    assert got["step"] == expected["step"] == 5
    assert got["critic/score/mean"] == expected["critic/score/mean"]  # the same rollouts were drawn
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key  # the restored weights were the same


def test_sigterm_stops_at_a_step_boundary_and_resumes_exactly(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Ctrl-C / SIGTERM: every rank stops cleanly after a synchronous checkpoint of the step."""
    steps = "trainer.total_steps=40"
    _train(tmp_path / "whole", tiny_model_dir, steps)
    stopped = tmp_path / "stopped"
    cli = subprocess.Popen([sys.executable, "-m", "verl_hpc", "train", "configs/quickstart_split.yaml",
                            "--run-dir", str(stopped), f"model.path={tiny_model_dir}", steps,
                            "checkpoint.interval_steps=4", "logging.progress=off"], cwd=REPO, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    metrics = stopped / "tensorboard" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 6):
        time.sleep(0.2)
    cli.send_signal(signal.SIGTERM)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 143, err[-2000:]
    last = read_jsonl_metrics(metrics)[-1]["step"]
    assert f"stopped by SIGTERM after step {last}" in out
    assert (stopped / "checkpoints" / f"step_{last:08d}" / "manifest.json").is_file()  # no step lost
    assert "FAILED" not in err
    _train(stopped, tiny_model_dir, steps)
    whole, resumed = scalars(tmp_path / "whole"), scalars(stopped)
    assert _steps(stopped) == list(range(1, 41))
    for tag in (t for t in whole if not t.startswith(VOLATILE)):
        assert resumed[tag] == whole[tag], tag


def test_resume_with_critic_and_ref_groups_is_exact(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The critic group's shards and LR schedule come back from the shared checkpoint; the ref group restarts."""
    args = ["configs/ppo_roles_apart.yaml", f"model.path={tiny_model_dir}", "logging.progress=off",
            "trainer.batch_size=32", "checkpoint.interval_steps=3", "resources.placement=colocated",
            "resources.actor={device_ids: [0, 1], strategy: fsdp}", "resources.critic={device_ids: [2], strategy: fsdp}",
            "resources.ref={device_ids: [3], strategy: fsdp}", "~resources.reward", "algorithm.kl.coef=0.05"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run_cli("train", *args, "trainer.total_steps=6", "--run-dir", str(whole)).returncode == 0
    assert run_cli("train", *args, "trainer.total_steps=3", "--run-dir", str(resumed)).returncode == 0
    proc = run_cli("train", *args, "trainer.total_steps=6", "--run-dir", str(resumed), "--allow-config-change")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    expected, got = (read_jsonl_metrics(d / "tensorboard" / "metrics.jsonl") for d in (whole, resumed))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(expected[3:], got[3:], strict=True):
        for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "critic/values/mean", "critic/score/mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), (a["step"], key)


def test_rollouts_generated_ahead_are_saved_per_rank_and_rerouted_on_another_world(tmp_path: Path,
                                                                                    tiny_model_dir: Path) -> None:
    """max_staleness 1: each trainer rank checkpoints its own rows of the next step; a resume on
    one rank takes every old rank's rows, and trains step 5 on exactly the rollouts saved."""
    import pyarrow as pa

    two = tmp_path / "two_ranks"
    _train(two, tiny_model_dir, "trainer.total_steps=6", "algorithm.max_staleness=1",
           "resources.actor.device_ids=[0,1]", "resources.actor.strategy=fsdp", "resources.rollout.device_ids=[2]",
           "resources.reward.device_ids=[3]")
    step4 = two / "checkpoints" / "step_00000004"
    parts = [pa.ipc.open_stream(pa.py_buffer((step4 / f"rank{r}" / "rollout_buffer.arrow").read_bytes())).read_all()
             for r in (0, 1)]
    assert [len(p) for p in parts] == [64, 64]  # each rank saved its own half of step 5's 128 rows
    assert {s for p in parts for s in p.column("step").to_pylist()} == {5}
    assert not (step4 / "rollout_buffer.arrow").exists()  # nothing funnelled through rank 0
    one = tmp_path / "one_rank"
    _train(one, tiny_model_dir, "trainer.total_steps=6", "algorithm.max_staleness=1", f"checkpoint.resume={step4}",
           "resources.actor.device_ids=[0]", "resources.rollout.device_ids=[1]", "resources.reward.device_ids=[2]")
    expected = read_jsonl_metrics(two / "tensorboard" / "metrics.jsonl")
    got = read_jsonl_metrics(one / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in got] == [5, 6]
    assert got[0]["critic/score/mean"] == expected[4]["critic/score/mean"]  # step 5: the saved rollouts
    assert got[0]["perf/rollout_intake_rows"] == 0  # restored from the checkpoint, not received
