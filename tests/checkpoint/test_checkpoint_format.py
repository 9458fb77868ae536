"""Checkpoints across versions: one written by the previous main resumes; a newer format is refused whole.

tests/golden/format1_run is a real run directory written by main before the one-loop
rewrite (commit 9df6ccd: quickstart, 2 steps, batch 16, n 4, the tiny preset at seed 0):
its run_state.json has no `format_version` (format 1).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from verl_hpc.metrics import read_jsonl_metrics

GOLDEN = REPO / "tests" / "golden" / "format1_run"
STEP = "step_00000002"
ARGS = ("trainer.batch_size=16", "algorithm.sampling.n=4", "logging.progress=off", "trainer.save_hf_model=false")


def golden_copy(tmp_path: Path) -> tuple[Path, Path]:
    from verl_hpc.models.tiny import init_model

    run_dir = tmp_path / "run"
    shutil.copytree(GOLDEN, run_dir)
    run_dir.chmod(0o700)
    return run_dir, init_model(tmp_path / "tiny", preset="tiny", seed=0)  # byte-identical to the one it trained


def resume(run_dir: Path, model: Path, steps: int):  # -> CompletedProcess
    return run_cli("train", "configs/quickstart.yaml", "--run-dir", str(run_dir), f"model.path={model}",
                   f"trainer.total_steps={steps}", *ARGS, "--allow-config-change")


@pytest.mark.slow
def test_a_checkpoint_of_the_previous_main_resumes(tmp_path: Path) -> None:
    run_dir, model = golden_copy(tmp_path)
    state = json.loads((GOLDEN / "checkpoints" / STEP / "run_state.json").read_text())
    assert "format_version" not in state  # really format 1
    proc = resume(run_dir, model, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / STEP} at step 2" in proc.stdout + proc.stderr
    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    new_state = json.loads((run_dir / "checkpoints" / "step_00000004" / "run_state.json").read_text())
    assert new_state["format_version"] == 2 and new_state["step"] == 4 and new_state["policy_version"] == 4


def test_a_newer_format_is_refused_in_one_line_before_anything_loads(tmp_path: Path) -> None:
    run_dir, model = golden_copy(tmp_path)
    ckpt = run_dir / "checkpoints" / STEP
    state = json.loads((ckpt / "run_state.json").read_text())
    data = json.dumps({**state, "format_version": 99}).encode()
    (ckpt / "run_state.json").write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())  # a consistent checkpoint, only newer
    manifest["files"]["run_state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = resume(run_dir, model, 4)
    assert proc.returncode != 0
    assert "checkpoint format version 99" in proc.stderr and "reads versions up to 2" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert all(p.read_bytes() == data for p, data in before.items() if p.suffix != ".yaml" and "logs" not in p.parts)


def test_metadata_pickled_by_python_3_11_2_is_read(tmp_path: Path) -> None:
    """CPython 3.11.0-3.11.4 (Debian 12's python3, the image's) pickle an enum member as
    getattr(EnumClass, "NAME"): such a .metadata loads; getattr on anything else is refused."""
    import enum
    import io
    import pathlib
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from verl_hpc.checkpoint.layout import CheckpointError, read_dcp_metadata

    class OldPickler(pickle.Pickler):
        def reducer_override(self, obj):  # what Python 3.11.2 writes for an enum member
            return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented

    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path)
    fresh = read_dcp_metadata(tmp_path)
    buffer = io.BytesIO()
    OldPickler(buffer).dump(fresh)
    assert b"getattr" in buffer.getvalue()
    (tmp_path / ".metadata").write_bytes(buffer.getvalue())
    assert read_dcp_metadata(tmp_path).state_dict_metadata == fresh.state_dict_metadata

    class Sneaky:
        def __reduce__(self):
            return (getattr, (pathlib.PosixPath, "cwd"))

    sneaky = io.BytesIO()
    pickle.Pickler(sneaky).dump(Sneaky())
    (tmp_path / ".metadata").write_bytes(sneaky.getvalue())
    with pytest.raises(CheckpointError, match="not allowed"):
        read_dcp_metadata(tmp_path)
