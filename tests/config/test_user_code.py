"""User code named in a config (`module:function`, `path/file.py:function`) imports as `import` would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_hpc.config.errors import FieldError
from verl_hpc.config.user_code import import_callable


def test_a_file_with_a_dataclass_loads(tmp_path: Path) -> None:
    """dataclasses look their module up in sys.modules while the file runs: it must be there already."""
    path = tmp_path / "my_env.py"
    path.write_text("from dataclasses import dataclass\n\n@dataclass\nclass Obs:\n    text: str\n")
    cls = import_callable(f"{path}:Obs", "rollout.multi_turn.environment.id")
    assert cls("hi").text == "hi"


def test_a_file_that_fails_names_the_field_and_leaves_no_half_module(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('no')\n")
    before = set(sys.modules)
    with pytest.raises(FieldError, match=r"loading .*broken.py failed: RuntimeError: no") as raised:
        import_callable(f"{path}:f", "reward.function")
    assert raised.value.path == "reward.function"
    assert set(sys.modules) == before


def test_a_missing_name_lists_what_is_there() -> None:
    with pytest.raises(FieldError, match="has no function 'nope'.*functions there: .*score"):
        import_callable("verl_hpc.data.tasks.arithmetic:nope", "reward.function")


def test_threads_loading_one_file_at_once_all_get_the_whole_module(tmp_path: Path) -> None:
    """Environments reset in parallel threads load their class's file at the same moment."""
    import concurrent.futures as cf

    path = tmp_path / "slow_env.py"
    path.write_text("import time\ntime.sleep(0.2)\n\nclass Env:\n    pass\n")
    with cf.ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda _: import_callable(f"{path}:Env", "rollout.multi_turn.environment.id"),
                               range(8)))
    assert len({id(cls) for cls in loaded}) == 1
