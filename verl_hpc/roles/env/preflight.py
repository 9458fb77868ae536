"""The run's environment started once before anything else: a game that cannot start here is refused in one line.

Why before the run directory and the job: a TextArena game that does not load on this Python
(some are written in 3.12-only syntax), that needs NLTK corpora it would download (offline nodes
cannot), or that is not in TextArena's registry at all would otherwise surface as a traceback in
the first step — under Slurm, after the job waited in the queue. `check_environment` builds the
configured environment and resets it once, within a time limit (a download that hangs counts as
a failure), and turns what went wrong into a `ConfigError` naming the field and what to do.
An OpenEnv server is not reached here: it may be started with the job.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import sys
import threading
from typing import Any

from verl_hpc.config.errors import ConfigError
from verl_hpc.roles.env.sources import ENV_FIELD, make_environment

CHECK_TIMEOUT_S = 120.0  # seconds; a test may lower it
PLAYABLE_HERE = "GuessTheNumber-v0, TicTacToe-v0, ConnectFour-v0"  # measured offline on Python 3.11


def textarena_ids() -> list[str]:
    """Every game id in TextArena's registry (empty when TextArena is not installed)."""
    try:
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError:
        return []
    return sorted(ENV_REGISTRY)


def refusal(game_id: str, err: BaseException, known: list[str]) -> ConfigError:
    """What went wrong starting TextArena game `game_id`, as one line with a fix."""
    field = f"{ENV_FIELD}.id"
    text = " ".join(str(err).split())
    if isinstance(err, ImportError) and "textarena" in text:
        return ConfigError(f"{ENV_FIELD}.source", "TextArena is not installed in this Python",
                           "pip install -e .[envs]")
    if known and game_id not in known:
        close = difflib.get_close_matches(game_id, known, n=3)
        return ConfigError(field, f"{game_id!r} is not a TextArena game",
                           f"did you mean {', '.join(close)}?" if close else f"e.g. {PLAYABLE_HERE}")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if isinstance(err, SyntaxError):
        where = f"{err.filename}:{err.lineno}" if err.filename else "its source"
        return ConfigError(field, f"{game_id} does not load on Python {version}: {err.msg} ({where}); "
                           "TextArena wrote it for a newer Python", f"pick a game that loads here "
                           f"(e.g. {PLAYABLE_HERE}) or run under Python 3.12")
    if isinstance(err, LookupError) and "nltk" in text.lower():
        resource = text.split("Resource ", 1)[-1].split(" ", 1)[0].strip("'\"") if "Resource " in text else "its data"
        return ConfigError(field, f"{game_id} needs NLTK data that is not on this machine ({resource})",
                           f"download it where the run starts (python -m nltk.downloader {resource}; offline: "
                           "copy an nltk_data folder to ~/nltk_data), or pick another game")
    if isinstance(err, TypeError) and "unexpected keyword argument" in text:
        return ConfigError(f"{ENV_FIELD}.kwargs", f"{game_id} does not take these kwargs ({text[:200]})",
                           "give only the arguments the game's constructor takes, or none")
    if "api key" in text.lower() or "api_key" in text.lower():
        return ConfigError(field, f"{game_id} needs an API key: {text[:200]}",
                           "set the key in the environment the run starts in, or pick another game")
    return ConfigError(field, f"{game_id} could not start here ({type(err).__name__}: {text[:200]})",
                       f"pick a game that starts (e.g. {PLAYABLE_HERE})")


def _start_once(env: Any) -> None:
    made = make_environment(env.source, env.id, env.kwargs, env.action_wrappers)
    try:
        made.reset(seed=0, **({"num_players": 2} if env.players == 2 else {}))
    finally:
        made.close()


def check_environment(multi_turn: Any) -> None:
    """Build and reset the configured environment once; ConfigError naming the field if it cannot."""
    env = multi_turn.environment
    if env is None or env.source == "openenv_server":
        return
    if env.source == "verifiers":  # its options and interpreter; the environment itself loads at start-up
        from verl_hpc.roles.env.verifiers_process import VerifiersOptions

        VerifiersOptions.of(env.kwargs).interpreter()
        return
    if env.source == "python":  # a class that does not import is refused by make_environment itself
        make_environment(env.source, env.id, env.kwargs, env.action_wrappers).close()
        return
    box: dict[str, BaseException] = {}

    def start() -> None:
        try:
            _start_once(env)
        except BaseException as err:  # noqa: BLE001 - carried to the calling thread
            box["error"] = err

    thread = threading.Thread(target=start, daemon=True, name="verl-hpc-env-check")
    # Quiet, and restored here even if the game hangs: one that tries to download its data prints
    # its failures before we explain them.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        thread.start()
        thread.join(CHECK_TIMEOUT_S)
    if thread.is_alive():
        raise ConfigError(f"{ENV_FIELD}.id", f"{env.id} did not start within {CHECK_TIMEOUT_S:g} s (a download "
                          "that cannot reach the network?)", "pick a game that starts offline, e.g. "
                          f"{PLAYABLE_HERE}")
    err = box.get("error")
    if isinstance(err, ConfigError):
        raise err
    if err is not None:
        raise refusal(env.id, err, textarena_ids()) from None
