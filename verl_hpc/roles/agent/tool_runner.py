"""Runs tool calls for many episodes at once: a bounded pool, a timeout per call, errors as messages.

Why errors become messages: a tool that raises, hangs or floods its output costs that call (the
model reads `Error: ...` and may try again) and a metric, never the run. Why a pool bounded by
`tool_workers`: calls of every episode in flight run side by side, so one slow tool does not
hold the others, but a step cannot start thousands of threads. Async tools (verl's BaseTool)
run on one event loop of their own; a sync function runs in a daemon thread so a call past its
timeout can be abandoned — Python cannot kill a thread, so a function that may hang forever
belongs in the sandboxed code tool, whose process is killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from verl_hpc.roles.agent.parsers import ToolCall
from verl_hpc.roles.agent.tool_schema import check_arguments
from verl_hpc.roles.agent.tools import ToolSet


@dataclass
class ToolOutcome:
    """One call's reply to the model and what it cost."""

    name: str
    arguments: Any
    text: str
    error: str | None = None   # None: the tool answered
    seconds: float = 0.0
    reward: float = 0.0
    truncated_chars: int = 0

    def log_entry(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "response": self.text, "error": self.error,
                "seconds": round(self.seconds, 6), "reward": self.reward}


class ToolTimeout(Exception):
    pass


def truncate(text: str, limit: int, side: str) -> tuple[str, int]:
    """`text` cut to `limit` characters on `side` (verl's tool_response_truncate_side); (text, chars cut)."""
    if len(text) <= limit:
        return text, 0
    cut = len(text) - limit
    note = f"...(truncated {cut} characters)..."
    if len(note) * 2 > limit:  # no room to say so: the kept part is worth more than the note
        note = ""
    keep = limit - len(note)
    if side == "left":
        return note + text[len(text) - keep:], cut
    if side == "right":
        return text[:keep] + note, cut
    head = keep // 2
    return text[:head] + note + text[len(text) - (keep - head):], cut


def _as_text(result: Any) -> tuple[str, float]:
    """A tool's return value -> (text for the model, reward): str, verl's ToolResponse, or a tuple."""
    reward = 0.0
    if isinstance(result, tuple) and result:
        if len(result) > 1 and isinstance(result[1], int | float):
            reward = float(result[1])
        result = result[0]
    text = getattr(result, "text", result)
    if text is None:
        return "", reward
    return (text if isinstance(text, str) else json.dumps(text) if isinstance(text, dict | list) else str(text)), \
        reward


class ToolRunner:
    """Calls the run's tools; `submit(episode_key, calls, tools_kwargs)` -> a future of outcomes."""

    def __init__(self, tools: ToolSet, workers: int, timeout: float, max_chars: int, truncate_side: str,
                 max_parallel_calls: int = 1):
        self.tools, self.timeout = tools, timeout
        self.max_chars, self.truncate_side, self.max_parallel = max_chars, truncate_side, max_parallel_calls
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verl-hpc-tool")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="verl-hpc-tool-loop", daemon=True)
        self._loop_thread.start()
        self._instances: dict[tuple[str, str], str] = {}  # (episode, tool) -> instance id
        self._lock = threading.Lock()

    # --- calling one method of a tool, sync or async, within a timeout --------------------------
    def _invoke(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(method):
            future = asyncio.run_coroutine_threadsafe(method(*args, **kwargs), self._loop)
            try:
                return future.result(self.timeout)
            except cf.TimeoutError:
                future.cancel()
                raise ToolTimeout from None
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = method(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - carried to the calling thread
                box["error"] = err

        thread = threading.Thread(target=target, daemon=True, name="verl-hpc-tool-call")
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise ToolTimeout
        if "error" in box:
            raise box["error"]
        value = box.get("value")
        if inspect.isawaitable(value):  # a sync method that returned a coroutine
            return asyncio.run_coroutine_threadsafe(value, self._loop).result(self.timeout)  # type: ignore[arg-type]
        return value

    def _instance(self, episode: str, name: str, tools_kwargs: dict[str, Any]) -> str:
        with self._lock:
            known = self._instances.get((episode, name))
        if known is not None:
            return known
        create_kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs") or {}
        created = self._invoke(self.tools.tools[name].create, None, **create_kwargs)
        instance = created[0] if isinstance(created, tuple) else created or str(uuid.uuid4())
        with self._lock:
            self._instances[(episode, name)] = instance
        return instance

    def _call(self, episode: str, call: ToolCall, tools_kwargs: dict[str, Any]) -> ToolOutcome:
        started = time.perf_counter()
        outcome = ToolOutcome(call.name, call.arguments, "")
        try:
            outcome.error = call.error or self._refusal(call)
            if outcome.error is None:
                tool = self.tools.tools[call.name]
                instance = self._instance(episode, call.name, tools_kwargs)
                extra = (tools_kwargs.get(call.name) or {}).get("execute_kwargs") or {}
                if hasattr(tool, "call_kwargs"):  # a plain function: its own arguments, not verl's signature
                    result = self._invoke(tool.fn, **tool.call_kwargs(instance, call.arguments, extra))
                else:
                    result = self._invoke(tool.execute, instance, call.arguments, **extra)
                outcome.text, outcome.reward = _as_text(result)
        except ToolTimeout:
            outcome.error = f"tool {call.name!r} timed out after {self.timeout:g} s"
        except Exception as err:  # noqa: BLE001 - the tool's failure is the model's information
            outcome.error = f"tool {call.name!r} raised {type(err).__name__}: {err}"
        if outcome.error is not None:
            outcome.text = f"Error: {outcome.error}"
        outcome.text, outcome.truncated_chars = truncate(outcome.text, self.max_chars, self.truncate_side)
        outcome.seconds = time.perf_counter() - started
        return outcome

    def _refusal(self, call: ToolCall) -> str | None:
        if call.name not in self.tools.tools:
            return f"there is no tool {call.name!r}; the tools are {', '.join(self.tools.tools)}"
        problem = check_arguments(self.tools.tools[call.name].tool_schema.model_dump(), call.arguments)
        return None if problem is None else f"{call.name}: {problem}"

    def _run_all(self, episode: str, calls: list[ToolCall], tools_kwargs: dict[str, Any]) -> list[ToolOutcome]:
        out = []
        for i, call in enumerate(calls):
            if i >= self.max_parallel:
                out.append(ToolOutcome(call.name, call.arguments, f"Error: at most {self.max_parallel} tool "
                                       "call(s) per turn run; this one did not", "too many calls in one turn"))
            else:
                out.append(self._call(episode, call, tools_kwargs))
        return out

    def submit(self, episode: str, calls: list[ToolCall], tools_kwargs: dict[str, Any]) -> cf.Future:
        """The outcomes of one turn's calls (in order), computed on the pool."""
        return self.pool.submit(self._run_all, episode, calls, tools_kwargs)

    def finish(self, episode: str, tools_kwargs: dict[str, Any]) -> float:
        """`calc_reward` then `release` of every instance the episode created; the rewards' sum."""
        with self._lock:
            names = [name for (ep, name) in self._instances if ep == episode]
        total = 0.0
        for name in names:
            with self._lock:
                instance = self._instances.pop((episode, name))
            tool, kwargs = self.tools.tools[name], tools_kwargs.get(name) or {}
            try:
                total += float(self._invoke(tool.calc_reward, instance, **(kwargs.get("calc_reward_kwargs") or {}))
                               or 0.0)
                self._invoke(tool.release, instance, **(kwargs.get("release_kwargs") or {}))
            except Exception:  # noqa: BLE001,S110 - a failing release costs nothing but its instance
                pass
        return total

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)

