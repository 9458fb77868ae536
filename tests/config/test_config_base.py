"""`base:` in a config file: a delta laid over another file, and every shipped config still loads.

Why a test: the example configs are now short deltas over configs/quickstart.yaml; a wrong merge
(a list merged instead of replaced, a base read relative to the wrong directory) would silently
change what a run trains, and a cycle must fail in one line instead of recursing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from verl_hpc.config import ConfigError, dump_config, load_config, load_resource_config, read_yaml
from verl_hpc.config.loader import merge_under

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def _gsm8k(tmp_path: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_data", REPO / "examples" / "gsm8k" / "make_data.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return Path(module.write(tmp_path / "gsm8k", count=8))


def test_merge_under_merges_mappings_and_replaces_everything_else() -> None:
    base = {"a": {"x": 1, "y": [1, 2], "deep": {"k": 1, "j": 2}}, "b": 3}
    data = {"a": {"y": [9], "deep": {"k": 5}}, "c": None}
    assert merge_under(base, data) == {"a": {"x": 1, "y": [9], "deep": {"k": 5, "j": 2}}, "b": 3, "c": None}
    assert base == {"a": {"x": 1, "y": [1, 2], "deep": {"k": 1, "j": 2}}, "b": 3}  # inputs untouched


def test_a_chain_of_bases_is_read_relative_to_each_file_and_overrides_apply_last(tmp_path: Path) -> None:
    quickstart = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    _write(tmp_path / "shared" / "root.yaml", quickstart)
    _write(tmp_path / "shared" / "middle.yaml", {"base": "root.yaml", "trainer": {"total_steps": 7},
                                                 "resources": {"actor": {"device_ids": [0, 1], "strategy": "fsdp"},
                                                               "rollout": {"device_ids": [0, 1]}}})
    leaf = _write(tmp_path / "runs" / "leaf.yaml", {"base": "../shared/middle.yaml", "trainer": {"seed": 3}})
    raw = read_yaml(leaf)
    assert "base" not in raw and raw["model"] == quickstart["model"]
    assert raw["trainer"] == {**quickstart["trainer"], "total_steps": 7, "seed": 3}
    assert raw["resources"]["actor"] == {"device_type": "cpu", "device_ids": [0, 1], "strategy": "fsdp"}
    cfg = load_config(leaf, ["trainer.total_steps=9"])
    assert cfg.trainer.total_steps == 9 and cfg.trainer.seed == 3
    assert "base:" not in dump_config(cfg)


@pytest.mark.parametrize(("files", "start", "message"), [
    ({"a.yaml": {"base": "a.yaml"}}, "a.yaml", r"a\.yaml -> a\.yaml"),
    ({"a.yaml": {"base": "b.yaml"}, "b.yaml": {"base": "a.yaml"}}, "a.yaml", r"a\.yaml -> b\.yaml -> a\.yaml"),
])
def test_a_cycle_of_bases_is_one_line_naming_the_field(tmp_path: Path, files: dict, start: str, message: str) -> None:
    for name, data in files.items():
        _write(tmp_path / name, data)
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(tmp_path / start)
    assert raised.value.path == "base" and "leads back to a file that includes it" in str(raised.value)
    assert "\n" not in str(raised.value) and raised.value.hint


@pytest.mark.parametrize(("base", "message"), [("missing.yaml", "does not exist"),
                                                (["a.yaml"], "must be the path of another config file"),
                                                ("", "must be the path of another config file")])
def test_a_bad_base_names_the_field_and_the_file_that_wrote_it(tmp_path: Path, base: object, message: str) -> None:
    delta = _write(tmp_path / "delta.yaml", {"base": base, "trainer": {"total_steps": 3}})
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(delta)
    assert raised.value.path == "base" and raised.value.source == str(delta)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path: Path, tmp_path: Path) -> None:
    if path.name == "resource_config.yaml":  # the `resources` section alone, read by its own loader
        assert load_resource_config(path).actor is not None
        return
    overrides = []
    if path.name.startswith("smollm2_gsm8k"):  # the real model and its data are made by tools this test does not run
        data = _gsm8k(tmp_path)
        overrides = ["model.init_preset=tiny", f"data.train_files=[{data}]", f"data.val_files=[{data}]"]
    cfg = load_config(path, overrides)
    assert cfg.trainer.total_steps > 0
