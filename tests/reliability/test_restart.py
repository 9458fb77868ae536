"""A run killed before its first checkpoint restarts with the same command (the storm's start-up
kills need this), and with a corrected config when it recorded no step (a start-up failure must
not block the fix); a changed config after a recorded step, or a finished run, is still refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from verl_hpc.config import ConfigError, dump_config, load_config
from verl_hpc.runtime.state.run_dir import prepare_run_dir

QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _killed_at_startup(run_dir: Path, config_text: str) -> Path:
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "checkpoints" / ".partial-step_00000002-0123abcd").mkdir(parents=True)  # died while saving
    (run_dir / "config.yaml").write_text(config_text)
    return run_dir


def test_same_config_restarts_from_step_zero(tmp_path: Path) -> None:
    cfg = load_config(QUICKSTART)
    run_dir = _killed_at_startup(tmp_path / "run", dump_config(cfg))
    assert prepare_run_dir(run_dir, cfg) == run_dir


def test_a_corrected_config_reuses_a_dir_with_no_step(tmp_path: Path) -> None:
    cfg = load_config(QUICKSTART)
    stored = dump_config(load_config(QUICKSTART, ["trainer.seed=1"]))
    run_dir = _killed_at_startup(tmp_path / "run", stored)
    assert prepare_run_dir(run_dir, cfg) == run_dir
    assert (run_dir / "config_history" / "config_step_00000000.yaml").read_text() == stored


@pytest.mark.parametrize("change", ["other config", "finished", "resume never"])
def test_anything_else_is_still_refused(tmp_path: Path, change: str) -> None:
    cfg = load_config(QUICKSTART)
    stored = dump_config(load_config(QUICKSTART, ["trainer.seed=1"])) if change == "other config" else dump_config(cfg)
    run_dir = _killed_at_startup(tmp_path / "run", stored)
    if change == "other config":  # one step recorded: the new config would contradict it
        (run_dir / "tensorboard" / "metrics.jsonl").write_text('{"step": 1}\n')
    if change == "finished":  # the run state says so: the last step's checkpoint is committed
        last = run_dir / "checkpoints" / f"step_{cfg.trainer.total_steps:08d}"
        last.mkdir()
        (last / "manifest.json").write_text("{}")
    if change == "resume never":
        cfg = load_config(QUICKSTART, ["checkpoint.resume=never"])
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare_run_dir(run_dir, cfg)
    assert (run_dir / "config.yaml").read_text() == stored  # untouched
