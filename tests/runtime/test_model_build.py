"""`model.init_preset` builds a random model only at a new path, says so, and never over or beside a real one.

Real builds (the tiny preset, seconds): a typo of a model's path next to that model is refused
naming both; a path that holds a model is used as it is; a new path is built in with one line.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from verl_hpc.config import ConfigError, load_config
from verl_hpc.runtime.build import ensure_model


def cfg_for(path: Path, preset: str | None = "tiny", seed: int = 0):
    model = {"path": str(path), "init_seed": seed, **({"init_preset": preset} if preset else {})}
    return load_config(REPO / "configs" / "quickstart.yaml", [f"model={json.dumps(model)}"])


def real_model(tiny_model_dir: Path, where: Path) -> Path:
    """A model of the user's own: the tiny model's files without verl-hpc's build marker."""
    shutil.copytree(tiny_model_dir, where)
    for marker in where.glob("verl_hpc_*.json"):
        marker.unlink()
    return where


def test_a_new_path_is_built_in_and_said_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="verl_hpc")
    built = ensure_model(cfg_for(tmp_path / "models" / "tiny-seed0"))
    assert (built / "config.json").is_file()
    lines = [r.getMessage() for r in caplog.records if "random-weight" in r.getMessage()]
    assert lines == [f"model.path {built} does not exist: building a random-weight tiny model there "
                     "(model.init_preset: tiny, init_seed: 0)"]
    caplog.clear()
    assert ensure_model(cfg_for(built)) == built  # built before: reused, nothing said
    assert not [r for r in caplog.records if "random-weight" in r.getMessage()]
    with pytest.raises(ConfigError, match="model.init_preset"):  # built with another seed: not replaced
        ensure_model(cfg_for(built, seed=1))


def test_a_path_holding_a_model_is_used_as_it_is(tmp_path: Path, tiny_model_dir: Path) -> None:
    mine = real_model(tiny_model_dir, tmp_path / "my-sft")
    before = sorted(p.name for p in mine.iterdir())
    assert ensure_model(cfg_for(mine)) == mine
    assert sorted(p.name for p in mine.iterdir()) == before


def test_a_typo_next_to_a_model_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    mine = real_model(tiny_model_dir, tmp_path / "my-sft-model")
    typo = tmp_path / "my-sft-modle"
    with pytest.raises(ConfigError, match=r"model.path: .*my-sft-modle does not exist, but .*my-sft-model") as err:
        ensure_model(cfg_for(typo))
    assert "fix model.path" in str(err.value) and not typo.exists()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no model"):  # never built over someone's files
        ensure_model(cfg_for(tmp_path / "junk"))
    assert mine.exists() and (tmp_path / "junk" / "notes.txt").read_text() == "mine"
