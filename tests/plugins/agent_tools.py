"""Tools for the agent tests: well-formed ones, misbehaving ones, and ones the loader must refuse."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from verl_hpc.roles.agent import BaseTool


def add(a: int, b: int = 0, mode: Literal["plain", "loud"] = "plain") -> str:
    """Add two integers.

    Longer text that is not part of the description.

    Args:
        a: the first number
        b: the second number, which may
            continue on the next line
        mode: how to say it
    """
    return str(a + b) if mode == "plain" else f"{a + b}!"


async def slow_echo(text: str, delay: float = 0.0) -> str:
    """Echo text after a delay.

    Args:
        text: what to echo
        delay: seconds to wait
    """
    await asyncio.sleep(delay)
    return text


def peek(**state: Any) -> str:
    """Look inside the box, misbehaving as the row asks (raise, hang, flood)."""
    mode = state.get("mode", "ok")
    if mode == "raise":
        raise RuntimeError("the box is stuck")
    if mode == "hang":
        time.sleep(60)
    if mode == "flood":
        return "x" * 1_000_000
    return str(state.get("digit", 0))


def no_hints(a, b):  # noqa: ANN001 - refused: no type hints
    """Add.

    Args:
        a: one
        b: two
    """
    return a + b


def no_doc(a: int) -> int:
    return a


def undocumented(a: int, secret: str) -> str:
    """Describe only a.

    Args:
        a: one
    """
    return secret


class Counter(BaseTool):
    """A verl-style tool: counts calls per instance, rewards the count at the end."""

    def __init__(self, config: dict[str, Any], tool_schema: Any):
        super().__init__(config, tool_schema)
        self.counts: dict[str, int] = {}
        self.released: list[str] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        instance_id = instance_id or f"counter-{len(self.counts)}"
        self.counts[instance_id] = int(kwargs.get("start", 0))
        return instance_id, None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        self.counts[instance_id] += int(parameters.get("step", 1)) * int(self.config.get("scale", 1))
        return str(self.counts[instance_id]), 0.5, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return float(self.counts[instance_id])

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.released.append(instance_id)
