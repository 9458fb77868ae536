"""A game that cannot start here is refused in one line before a run directory or a job exists
(verl_hpc/roles/env/preflight.py)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, run_cli
from verl_hpc.config.errors import ConfigError
from verl_hpc.roles.env import preflight
from verl_hpc.roles.env.preflight import check_environment, refusal, textarena_ids

needs_textarena = pytest.mark.skipif(importlib.util.find_spec("textarena") is None, reason="textarena not installed")
FIELD = "rollout.multi_turn.environment"


def _multi_turn(game_id: str, **env: object) -> SimpleNamespace:
    fields = {"source": "textarena", "id": game_id, "kwargs": {}, "action_wrappers": [], "players": 1, **env}
    return SimpleNamespace(environment=SimpleNamespace(**fields))


@needs_textarena
def test_a_game_that_does_not_load_on_this_python_is_refused_by_the_cli_before_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/guess_the_number.yaml", "--run-dir", str(run_dir),
                   f"{FIELD}.id=Chess-v0", timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"verl-hpc: error: {FIELD}.id: Chess-v0 does not load on Python")
    assert "hint: pick a game that loads here" in lines[0] and not run_dir.exists()


@needs_textarena
def test_an_unknown_id_gets_the_closest_games_and_wrong_kwargs_name_their_field() -> None:
    with pytest.raises(ConfigError, match=r"is not a TextArena game \(hint: did you mean GuessTheNumber-v0"):
        check_environment(_multi_turn("GuessTheNumbr-v0"))
    with pytest.raises(ConfigError, match=rf"^{FIELD}\.kwargs: TicTacToe-v0 does not take these kwargs"):
        check_environment(_multi_turn("TicTacToe-v0", kwargs={"min_number": 1}))
    assert "GuessTheNumber-v0" in textarena_ids()


@needs_textarena
def test_games_that_start_pass_in_either_seat_count() -> None:
    check_environment(_multi_turn("GuessTheNumber-v0", kwargs={"min_number": 1, "max_number": 3}))
    check_environment(_multi_turn("TicTacToe-v0", players=2))
    check_environment(SimpleNamespace(environment=None))
    check_environment(_multi_turn("http://nowhere:1", source="openenv_server"))  # a server may start with the job


def test_each_cause_gets_its_own_line_and_fix() -> None:
    known = ["Wordle-v0", "Chess-v0"]
    nltk = LookupError("\n****\n  Resource 'words' not found.\n  Please use the NLTK Downloader (nltk.download)")
    assert "needs NLTK data that is not on this machine (words)" in str(refusal("Wordle-v0", nltk, known))
    assert "python -m nltk.downloader words" in refusal("Wordle-v0", nltk, known).hint
    key = refusal("Chess-v0", ValueError("OPENROUTER_API_KEY: API key not found"), known)
    assert "needs an API key" in str(key)
    missing = refusal("Chess-v0", ImportError("No module named 'textarena'"), [])
    assert missing.path == f"{FIELD}.source" and missing.hint == "pip install -e .[envs]"
    other = refusal("Chess-v0", RuntimeError("boom"), known)
    assert other.path == f"{FIELD}.id" and "RuntimeError: boom" in str(other)


def test_a_game_that_hangs_at_start_is_refused_at_the_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "CHECK_TIMEOUT_S", 0.5)
    monkeypatch.setattr(preflight, "_start_once", lambda env: time.sleep(30))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"did not start within 0\.5 s"):
        check_environment(_multi_turn("GuessTheNumber-v0"))
    assert time.monotonic() - started < 10


def test_a_python_class_that_does_not_import_names_the_id() -> None:
    with pytest.raises(ConfigError, match=rf"^{FIELD}\.id"):
        check_environment(_multi_turn(f"{REPO / 'tests' / 'plugins' / 'agent_envs.py'}:NoSuchEnv", source="python"))
