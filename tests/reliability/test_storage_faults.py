"""Storage faults: a disk that fills during a checkpoint, a run directory that cannot be written,
checkpoint files truncated or bit-flipped. Each gives a clear error or is skipped by name, the
previous checkpoint stays intact and is the one the next start uses, and the resumed run's
numbers equal those of a run that never saw the fault.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.reliability.runs import metrics, tmpfs, train, training_state

pytestmark = pytest.mark.slow
STEPS = ("trainer.total_steps=10", "checkpoint.interval_steps=2")


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The reference: 10 steps with a checkpoint every 2, on a healthy disk."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    proc = train(run_dir, tiny_model_dir, *STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _bytes_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path: Path, tiny_model_dir: Path,
                                                                whole: Path) -> None:
    """Room for one checkpoint, not two: the second write fails with one line naming the space
    and the intact checkpoint; with room again the same command resumes from that one, exactly."""
    one_checkpoint = _bytes_of(whole / "checkpoints" / "step_00000010")
    size_kib = int(1.4 * one_checkpoint / 1024) + 256  # + config, prompts, logs, events
    with tmpfs(tmp_path / "disk", f"{size_kib}k") as disk:
        run_dir = disk / "run"
        proc = train(run_dir, tiny_model_dir, *STEPS)
        assert proc.returncode == 1, proc.stderr[-3000:]
        # torch's and tensorboard's writer threads print their own tracebacks; ours is one line
        errors = [line for line in proc.stderr.splitlines() if line.startswith("verl-hpc: error:")]
        assert len(errors) == 1, proc.stderr[-3000:]
        last = errors[0]
        assert last.startswith("verl-hpc: error: checkpoint step 4 could not be written"), last
        assert "No space left on device" in last and "MiB free" in last
        assert f"the last committed checkpoint is intact: {run_dir / 'checkpoints' / 'step_00000002'}" in last
        assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
        assert (run_dir / "checkpoints" / "step_00000002" / "manifest.json").is_file()

        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)  # space freed
        proc = train(run_dir, tiny_model_dir, *STEPS)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = (run_dir / "logs" / "trainer_rank0.log").read_text()
        assert "resumed from " + str(run_dir / "checkpoints" / "step_00000002") in log
        assert training_state(metrics(run_dir)) == training_state(metrics(whole))


def test_unwritable_run_directory_is_one_line_and_starts_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Root ignores file modes, so a read-only mount stands in for a directory we may not write."""
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        proc = train(ro / "run", tiny_model_dir, *STEPS)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert lines[0].startswith("verl-hpc: error: run_dir: cannot ") and "Read-only file system" in lines[0]
        assert not any(ro.iterdir())


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    else:  # one bit: every size still matches the manifest, only the sha256 tells
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))


def test_damaged_newest_checkpoint_is_skipped_and_the_one_before_used(tmp_path: Path, tiny_model_dir: Path,
                                                                       whole: Path) -> None:
    run_dir = tmp_path / "run"
    assert train(run_dir, tiny_model_dir, "trainer.total_steps=6", "checkpoint.interval_steps=2").returncode == 0
    _damage(run_dir / "checkpoints" / "step_00000006" / "__0_0.distcp", "bitflip")
    proc = train(run_dir, tiny_model_dir, "trainer.total_steps=8", "checkpoint.interval_steps=2",
                 "--allow-config-change")  # more steps than the run was started with
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000006: file __0_0.distcp does not match its sha256 (corrupted)" in proc.stderr
    log = (run_dir / "logs" / "trainer_rank0.log").read_text()
    assert "resumed from " + str(run_dir / "checkpoints" / "step_00000004") in log

    _damage(run_dir / "checkpoints" / "step_00000008" / "__0_0.distcp", "truncate")
    proc = train(run_dir, tiny_model_dir, *STEPS, "--allow-config-change")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000008: file __0_0.distcp has" in proc.stderr
    log = (run_dir / "logs" / "trainer_rank0.log").read_text()
    assert "resumed from " + str(run_dir / "checkpoints" / "step_00000006") in log
    assert training_state(metrics(run_dir)) == training_state(metrics(whole))
