"""A run directory keeps its identity, through the CLI as a user runs it.

A changed config is refused in one line naming the changed fields and touches nothing;
`--allow-config-change` continues under it, keeping the replaced config and the earlier
`hf_model/`; without `--run-dir` the run lives in `runs/<config stem>`, so the same
command resumes it after Ctrl-C, and the stop message prints that command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.conftest import REPO, run_cli
from verl_hpc.metrics import read_jsonl_metrics

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
SMALL = ["trainer.batch_size=16", "logging.progress=lines", "algorithm.sampling.max_new_tokens=2"]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("verl-hpc: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_changed_config_is_refused_then_accepted_and_recorded(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    base = [QUICKSTART, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}", *SMALL]
    first = run_cli("train", *base, "trainer.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(run_dir)

    for change in (["trainer.actor_optim.lr=0.01"], ["algorithm.sampling.n=4"], ["trainer.total_steps=3"]):
        proc = run_cli("train", *base, "trainer.total_steps=2", *change)
        assert proc.returncode == 2, proc.stderr[-3000:]
        field = change[0].split("=")[0]
        line = error_line(proc)
        assert f"another config: {field} changed" in line and "--allow-config-change" in line, line
        assert snapshot(run_dir) == before  # nothing the run wrote changed

    again = run_cli("train", *base, "trainer.total_steps=2")  # the same config: finished, nothing to do
    assert again.returncode == 2 and "finished at step 2" in error_line(again)
    assert snapshot(run_dir) == before

    more = run_cli("train", *base, "trainer.total_steps=3", "--allow-config-change")
    assert more.returncode == 0, more.stderr[-3000:]
    (entry,) = yaml.safe_load((run_dir / "config_history.yaml").read_text())
    assert entry["step"] == 2 and entry["changed"] == {"trainer.total_steps": {"old": 2, "new": 3}}
    assert (run_dir / entry["previous_config"]).read_bytes() == before["config.yaml"]
    kept = {k.removeprefix("hf_model/"): v for k, v in before.items() if k.startswith("hf_model/")}
    assert kept and snapshot(run_dir / entry["moved"]["hf_model"]) == kept
    assert [r["step"] for r in read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")] == [1, 2, 3]
    assert (run_dir / "hf_model" / "config.json").is_file()
    for name, data in before.items():  # everything else the first run wrote is still there as it was
        if name.startswith("checkpoints/step_00000002/"):
            assert (run_dir / name).read_bytes() == data


def test_operational_fields_change_without_the_flag(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    base = [QUICKSTART, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}", *SMALL, "trainer.total_steps=2"]
    assert run_cli("train", *base, "trainer.save_hf_model=false", "checkpoint.interval_steps=1").returncode == 0
    # a finished run with save_hf_model off has no hf_model: continuing to step 3 needs the flag,
    # a logging-only change does not (recorded all the same)
    proc = run_cli("train", *base, "trainer.save_hf_model=false", "checkpoint.interval_steps=1", "logging.log_every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (entry,) = yaml.safe_load((run_dir / "config_history.yaml").read_text())
    assert list(entry["changed"]) == ["logging.log_every"]


def _wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    metrics = run_dir / "tensorboard" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(read_jsonl_metrics(metrics)) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps: {proc.poll()}")


def test_same_command_resumes_by_name_after_ctrl_c(tmp_path: Path, tiny_model_dir: Path) -> None:
    """No --run-dir: runs/<config stem> in the working directory; Ctrl-C prints the exact resume command.

    This venv's bin/ is on PATH here, as after activating it, so the short `verl-hpc` works as
    typed and is what is printed (without it on PATH: tests/utils/test_invocation.py).
    """
    args = ["train", QUICKSTART, f"model.path={tiny_model_dir}", *SMALL, "trainer.total_steps=60",
            "checkpoint.interval_steps=1"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "verl_hpc", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run_dir = tmp_path / "runs" / "quickstart"
    _wait_for_steps(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    resume = next(line for line in out.splitlines() if "To resume:" in line).split("To resume: ")[1]
    assert resume.startswith("verl-hpc train ") and resume.endswith("--run-dir runs/quickstart"), resume
    stopped_at = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")[-1]["step"]

    final = run_cli(*args, cwd=tmp_path, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    assert f"at step {stopped_at}" in final.stderr and "resumed from" in final.stderr
    steps = [r["step"] for r in read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")]
    assert steps == list(range(1, 61))


def test_fields_added_by_an_upgrade_are_not_a_changed_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A run written by a version without a field resumes under one that has it (at its default)."""
    run_dir = tmp_path / "run"
    base = [QUICKSTART, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}", *SMALL]
    assert run_cli("train", *base, "trainer.total_steps=2", "trainer.save_hf_model=false").returncode == 0
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    for field in ("gradient_checkpointing", "logprob_chunk_tokens"):  # added after this run's version
        del stored["model"][field]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    proc = run_cli("train", *base, "trainer.total_steps=2", "trainer.save_hf_model=false", "trainer.total_steps=3")
    assert proc.returncode == 2 and "trainer.total_steps changed" in error_line(proc)  # a real change still is one
    assert "gradient_checkpointing" not in error_line(proc)
    same = run_cli("train", *base, "trainer.total_steps=2", "trainer.save_hf_model=false", "checkpoint.resume=auto")
    assert same.returncode == 0, same.stderr[-3000:]
    assert "another config" not in same.stderr
    (entry,) = yaml.safe_load((run_dir / "config_history.yaml").read_text())  # recorded all the same
    assert entry["changed"]["model.gradient_checkpointing"] == {"old": None, "new": False}
