"""Tool-call parsers: the model's text of one turn -> its content and the calls it made.

Why a registry: the format is the chat template's, not ours. Qwen's templates render `tools=`
in the hermes style (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), Mistral and
Llama have their own; `rollout.multi_turn.format` names the parser (verl's key), and a plugin
adds one with `@register_parser("name")`. A parser also names its end tags: the engine stops a
turn there (`stop_ids`), so the model never writes past a call it expects answered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl_hpc.config.errors import ConfigError


@dataclass
class ToolCall:
    """One call: its function name and arguments, or why it could not be read (`error`)."""

    name: str
    arguments: Any
    error: str | None = None

    def message_form(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Base: `parse(text)`; `end_tags` are the strings that close a call."""

    name = "base"
    end_tags: tuple[str, ...] = ()

    def parse(self, text: str) -> ParsedTurn:
        raise NotImplementedError


PARSERS: dict[str, type[ToolCallParser]] = {}


def register_parser(name: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    def add(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        cls.name = name
        PARSERS[name] = cls
        return cls

    return add


def get_parser(name: str, field_name: str = "rollout.multi_turn.format") -> ToolCallParser:
    if name not in PARSERS:
        raise ConfigError(field_name, f"no tool-call parser {name!r}",
                          f"use one of {', '.join(sorted(PARSERS))}, or register one with @register_parser "
                          "in a module listed under plugins")
    return PARSERS[name]()


def _call_from_json(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", None, f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", None, 'a tool call is {"name": <function name>, "arguments": {...}}')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(data["name"], arguments, "the arguments are not a JSON object")
    return ToolCall(data["name"], arguments if arguments is not None else {})


@register_parser("hermes")
class HermesParser(ToolCallParser):
    """`<tool_call>{json}</tool_call>` blocks, as Qwen2.5/Qwen3 templates render tools= (and NousResearch's)."""

    start, end = "<tool_call>", "</tool_call>"
    end_tags = ("</tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        first = text.find(self.start)
        if first < 0:
            return ParsedTurn(text.strip())
        calls = [_call_from_json(m.group(1).strip()) for m in self._block.finditer(text)]
        closed = text.rfind(self.end)
        if text.find(self.start, closed + 1 if closed >= 0 else 0) >= 0:  # opened and never closed
            calls.append(ToolCall("", None, f"a tool call was opened with {self.start} but never closed "
                                  f"with {self.end}"))
        return ParsedTurn(text[:first].strip(), calls)
