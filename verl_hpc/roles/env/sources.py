"""Adapters from each ecosystem's environments to `base.Environment`, chosen by `source`.

- `textarena`: a TextArena game by id (`GuessTheNumber-v0`), single-player: the game's messages to
  the player since its last turn are the next user turn; its reward comes when the game ends.
- `python`: a class by `module:Class` or `file.py:Class`, constructed with `kwargs`: any class
  with `reset(seed=...)` and `step(action)` — OpenEnv `Environment` subclasses included, whose
  pydantic actions are built from the turn's text and whose observations' `done`/`reward` are read.
- `openenv_server`: an OpenEnv server (`create_app`, local or remote) by its URL: one WebSocket
  session per episode (OpenEnv's HTTP `/step` is stateless, so multi-turn episodes need it); the
  turn's text is sent as the action's `action_field` (`message` unless `kwargs` says otherwise).
"""

from __future__ import annotations

import json
import threading
import typing
from collections.abc import Callable
from typing import Any

from verl_hpc.roles.env.base import TEXT_FIELDS, EnvFailure, Environment, EnvReply

# TextArena games seed Python's global `random` in reset and draw from it in step: episodes in
# parallel threads would draw from each other's sequences; each call holds this lock (they are short).
TEXTARENA_LOCK = threading.Lock()


def textarena_game(game_id: str, kwargs: dict[str, Any], action_wrappers: list[str] | tuple[str, ...] = ()
                   ) -> tuple[Any, Any]:
    """(the game, what a move goes through): `textarena.make`'s wrappers stripped, since its LLM
    observation wrappers re-send the whole history and a turn needs only what is new; then the named
    action wrappers (`textarena.wrappers`, outermost first) put back around the bare game."""
    import textarena
    from textarena import wrappers

    game = textarena.make(game_id, **kwargs)
    while hasattr(game, "env"):
        game = game.env
    mover = game
    for name in reversed(list(action_wrappers)):
        wrapper = getattr(wrappers, name, None)
        if not (isinstance(wrapper, type) and issubclass(wrapper, textarena.ActionWrapper)):
            from verl_hpc.config.errors import FieldError

            known = sorted(n for n in dir(wrappers) if isinstance(getattr(wrappers, n), type)
                           and issubclass(getattr(wrappers, n), textarena.ActionWrapper))
            raise FieldError(f"{ENV_FIELD}.action_wrappers", f"{name!r} is not a TextArena action wrapper",
                             f"one of {', '.join(known)}")
        mover = wrapper(mover)
    return game, mover


class TextArenaEnvironment:
    """One TextArena game, played by the model as player 0."""

    def __init__(self, game_id: str, action_wrappers: list[str] | tuple[str, ...] = (), **kwargs: Any):
        self.game, self.mover = textarena_game(game_id, kwargs, action_wrappers)

    def _news(self) -> str:
        _, messages = self.game.get_observation()
        return "\n".join(text for sender, text, *_ in messages if sender != 0).strip()

    def reset(self, seed: int | None = None, **kwargs: Any) -> EnvReply:
        with TEXTARENA_LOCK:
            self.game.reset(num_players=int(kwargs.get("num_players", 1)), seed=seed)
            return EnvReply.checked(self._news())

    def step(self, action: str) -> EnvReply:
        with TEXTARENA_LOCK:
            done, _ = self.mover.step(action)
            news = self._news()
            if not done:
                return EnvReply.checked(news)
            rewards, _ = self.game.close()
            return EnvReply.checked(news, (rewards or {}).get(0, 0.0), True)

    def close(self) -> None:
        return None


def observation_text(observation: Any) -> str:
    """An OpenEnv-style observation as text: itself if text, its text-like field, else its fields as JSON."""
    if isinstance(observation, str):
        return observation
    for name in TEXT_FIELDS:
        value = getattr(observation, name, None)
        if isinstance(value, str):
            return value
    if hasattr(observation, "model_dump"):
        fields = observation.model_dump(exclude={"done", "reward", "metadata"})
        return json.dumps(fields, default=str)
    raise EnvFailure(f"the observation {type(observation).__name__} has no text")


def action_builder(env: Any) -> Callable[[str], Any]:
    """How the turn's text becomes the class's action: text itself, or its pydantic action class built
    from its one text field (OpenEnv's `Environment[Action, ...]`)."""
    try:
        hint = typing.get_type_hints(type(env).step).get("action")
    except Exception:  # noqa: BLE001 - unresolvable hints: pass the text
        hint = None
    if hint is None or hint is str or not hasattr(hint, "model_fields"):
        return lambda text: text
    names = [n for n, f in hint.model_fields.items() if f.annotation is str]
    if len(names) != 1:
        raise ValueError(f"{type(env).__name__}.step takes {hint.__name__}, which has "
                         f"{len(names)} text fields; give it exactly one so the model's turn can fill it")
    return lambda text: hint(**{names[0]: text})


class ClassEnvironment:
    """A user's environment class (OpenEnv's `Environment` or any reset/step class), one per episode."""

    def __init__(self, factory: Callable[..., Any], **kwargs: Any):
        self.env = factory(**kwargs)
        self.to_action = action_builder(self.env)

    @staticmethod
    def reply(observation: Any) -> EnvReply:
        if isinstance(observation, EnvReply):
            return observation
        return EnvReply.checked(observation_text(observation), getattr(observation, "reward", 0.0),
                                getattr(observation, "done", False))

    def reset(self, seed: int | None = None, **kwargs: Any) -> EnvReply:
        return self.reply(self.env.reset(seed=seed, **kwargs))

    def step(self, action: str) -> EnvReply:
        return self.reply(self.env.step(self.to_action(action)))

    def close(self) -> None:
        closer = getattr(self.env, "close", None)
        if callable(closer):
            closer()


ENV_FIELD = "rollout.multi_turn.environment"


def env_spec(env: Any) -> dict[str, Any]:
    """What builds the environment of an episode, as plain data a worker process is sent."""
    return {"source": env.source, "id": env.id, "kwargs": dict(env.kwargs),
            "action_wrappers": list(env.action_wrappers), "threads": env.workers, "players": env.players,
            "timeout": env.timeout_seconds}


def make_environment(source: str, ref: str, kwargs: dict[str, Any] | None = None,
                     action_wrappers: list[str] | tuple[str, ...] = ()) -> Environment:
    """A new environment for one episode (a class that cannot be imported: FieldError naming the field)."""
    kwargs = dict(kwargs or {})
    if source == "textarena":
        return TextArenaEnvironment(ref, action_wrappers, **kwargs)
    if source == "python":
        from verl_hpc.config.user_code import import_callable

        return ClassEnvironment(import_callable(ref, f"{ENV_FIELD}.id"), **kwargs)
    if source == "openenv_server":
        from verl_hpc.roles.env.openenv_client import OpenEnvServerEnvironment

        return OpenEnvServerEnvironment(ref, **kwargs)
    raise ValueError(f"unknown environment source {source!r}: textarena, python or openenv_server")
