"""A missing model's hint names the script that builds it, or no build at all for a real model's name.

Why: suggesting `init-model --preset tiny` for a missing SmolLM2 put a random tiny model under
SmolLM2's name. Validation runs before anything is built, so these are plain config loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from verl_hpc.config import ConfigError, load_config


def error_for(path: Path, config: str = "smollm2_gsm8k") -> str:
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / f"{config}.yaml", [f"model.path={path}", "~data.train_files",
                                                          "+data.task={name: arithmetic, num_prompts: 8}"])
    return err.value.one_line()


def test_the_smollm2_example_names_its_build_script(tmp_path: Path) -> None:
    line = error_for(tmp_path / "models" / "smollm2-135m-instruct")
    assert "model.path:" in line and "no config.json" in line
    assert f"tools/make_smollm2.py {tmp_path / 'models' / 'smollm2-135m-instruct'}" in line
    assert "init-model" not in line and "init_preset" not in line


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B-Instruct", "my-sft-7b", "SmolLM2-360M"])
def test_another_real_models_name_gets_no_random_model(tmp_path: Path, name: str) -> None:
    line = error_for(tmp_path / name)
    assert "point model.path at a Hugging Face model directory" in line
    assert "init-model" not in line and "init_preset" not in line


def test_a_preset_models_directory_is_rebuilt_from_its_preset(tmp_path: Path) -> None:
    line = error_for(tmp_path / "tiny-seed3")
    assert f"init-model {tmp_path / 'tiny-seed3'} --preset tiny --seed 3" in line
