"""Episodes on an OpenEnv server: its WebSocket protocol spoken from the episode's own thread,
and a session kept open for the next episode instead of a new connection per episode.

Why not openenv's `SyncEnvClient`: it runs an asyncio loop in a thread of its own per client and
hands every call to it and back; with 64 episodes in flight beside generation those two GIL
handoffs per call cost ~3 ms each. This speaks the same protocol (`/ws`: `{"type":
"reset"|"step"|"close", "data": ...}` in, `{"type": "observation"|"error", "data": ...}` out,
openenv-core 0.3) with websockets' blocking client, in the thread that waits for the answer anyway.

Why sessions are reused: a WebSocket session is one environment instance on the server, and
OpenEnv's `reset` starts a new episode on it, which is how OpenEnv's own clients play episode
after episode. Opening one costs a handshake and a server-side instance and executor, closing
one another round trip: 1.8 of the 4.3 ms of a sequential 3-step episode (measured on loopback).
A session whose call failed is closed, never reused.
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

from verl_hpc.roles.env.base import TEXT_FIELDS, EnvFailure, EnvReply

MAX_IDLE = 256  # sessions kept open per server between episodes
_IDLE: dict[str, list[Any]] = {}
_IDLE_LOCK = threading.Lock()


def session_url(url: str) -> str:
    """An OpenEnv server's base URL (http(s):// or ws(s)://) -> its WebSocket session endpoint."""
    base = url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(http):
            base = ws + base[len(http):]
    return f"{base}/ws"


def _idle_session(ws_url: str) -> Any | None:
    with _IDLE_LOCK:
        pool = _IDLE.get(ws_url)
        return pool.pop() if pool else None


def _keep_session(ws_url: str, ws: Any) -> bool:
    with _IDLE_LOCK:
        pool = _IDLE.setdefault(ws_url, [])
        if len(pool) >= MAX_IDLE:
            return False
        pool.append(ws)
        return True


class OpenEnvServerEnvironment:
    """One episode on an OpenEnv server, over a session of its own while the episode runs."""

    def __init__(self, url: str, action_field: str = "message", connect_timeout_s: float = 10.0,
                 message_timeout_s: float = 600.0):
        self.ws_url, self.connect_timeout_s = session_url(url), connect_timeout_s
        self.action_field, self.message_timeout_s = action_field, message_timeout_s
        self.reused = True
        self.ws = _idle_session(self.ws_url)
        if self.ws is None:
            self.ws, self.reused = self._connect(), False
        self.healthy = True

    def _connect(self) -> Any:
        from websockets.sync.client import connect

        try:  # no proxy: the server is the run's own, often on this machine or the cluster's network
            return connect(self.ws_url, open_timeout=self.connect_timeout_s, max_size=100 * 2**20, proxy=None)
        except (OSError, TimeoutError, ValueError) as err:
            raise EnvFailure(f"cannot reach the OpenEnv server at {self.ws_url}: {err}") from None

    def call(self, kind: str, data: dict[str, Any]) -> EnvReply:
        """Send one message, wait for its answer, read it as an observation."""
        from websockets.exceptions import ConnectionClosed

        try:
            self.ws.send(json.dumps({"type": kind, "data": data}))
            answer = json.loads(self.ws.recv(timeout=self.message_timeout_s))
        except ConnectionClosed:
            if not (self.reused and kind == "reset"):
                self.healthy = False
                raise
            self.ws, self.reused = self._connect(), False  # the server closed an idle session: a new one
            return self.call(kind, data)
        except BaseException:
            self.healthy = False
            raise
        payload = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(payload, dict):
            self.healthy = False
            raise EnvFailure(f"the server answered {str(answer)[:200]!r}, not an observation")
        if answer.get("type") == "error":
            raise EnvFailure(f"the server's error: {payload.get('message')} ({payload.get('code')})")
        return self.reply(payload)

    @staticmethod
    def reply(payload: dict[str, Any]) -> EnvReply:
        """A server's observation message: its observation's fields, reward and done."""
        fields = payload.get("observation")
        if not isinstance(fields, dict):
            raise EnvFailure(f"the server sent {type(fields).__name__}, not an observation's fields")
        found = [fields[n] for n in TEXT_FIELDS if isinstance(fields.get(n), str)]
        text = found[0] if found else json.dumps(
            {k: v for k, v in fields.items() if k not in ("done", "reward", "metadata")}, default=str)
        return EnvReply.checked(text, payload.get("reward"), payload.get("done", False))

    def reset(self, seed: int | None = None, **kwargs: Any) -> EnvReply:
        return self.call("reset", {"seed": seed, **kwargs})

    def step(self, action: str) -> EnvReply:
        return self.call("step", {self.action_field: action})

    def close(self) -> None:
        """The session goes back to the idle ones for the next episode; a failed one is ended."""
        if self.healthy and _keep_session(self.ws_url, self.ws):
            return
        with contextlib.suppress(Exception):  # the session may be gone already: closing is best effort
            self.ws.send(json.dumps({"type": "close"}))
            self.ws.recv(timeout=5)  # until the server closes its side: a session ended cleanly on both
        self.ws.close()
