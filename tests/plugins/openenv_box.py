"""An environment written against OpenEnv's own base classes (the `openenv-core` package), for
tests/roles/test_env_openenv.py: the box holds a digit; each turn the model names one, the reply
says whether it was right; reward 1 for the right digit, and the episode ends."""

from __future__ import annotations

import random
import sys
import time
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class BoxAction(Action):
    message: str


class BoxObservation(Observation):
    prompt: str


SLOW_SEED = 99  # a reset with this seed takes SLOW_RESET_S: a client's timeout, whatever the load


class BoxEnvironment(Environment[BoxAction, BoxObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True
    SLOW_RESET_S = 2.0

    def __init__(self, max_digit: int = 4):
        super().__init__()
        self.max_digit, self.digit, self._state = max_digit, 0, State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> BoxObservation:
        if seed == SLOW_SEED:
            time.sleep(self.SLOW_RESET_S)
        self.digit = random.Random(seed).randint(0, self.max_digit)
        self._state = State(episode_id=episode_id, step_count=0)
        return BoxObservation(prompt="what is in the box")

    def step(self, action: BoxAction, timeout_s: float | None = None, **kwargs: Any) -> BoxObservation:
        self._state.step_count += 1
        right = action.message.strip() == str(self.digit)
        return BoxObservation(prompt="it is" if right else "it is not", done=right, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


def serve(port: int) -> None:
    """The same environment behind OpenEnv's own server (FastAPI, a WebSocket session per episode)."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    app = create_app(BoxEnvironment, BoxAction, BoxObservation, max_concurrent_envs=64)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
