"""Tools an agent can call: plain Python functions, and classes with verl's BaseTool interface.

Why both: TRL and transformers users hand over functions (the schema comes from type hints and
the docstring); verl users have a tool config file (`tools: - class_name, config, tool_schema`)
and classes with verl's async lifecycle — `create` an instance per episode, `execute` per call,
`calc_reward`, `release`. A function becomes a `FunctionTool` with that same lifecycle, so the
runner knows one interface. A class written against verl's own `verl.tools.base_tool.BaseTool`
needs verl importable; one written against `verl_hpc.roles.agent.BaseTool` (same methods, same
signatures) does not.

Everything is checked when the tools load, before the run starts: a tool that cannot be
imported, lacks type hints or a docstring, or has an invalid schema is a `ConfigError` naming
its entry (`rollout.multi_turn.tools[2]`, `rollout.multi_turn.tool_config_path: tools[0]`).
"""

from __future__ import annotations

import importlib
import inspect
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.user_code import import_callable
from verl_hpc.roles.agent.tool_schema import SchemaProblem, check_schema, function_schema
from verl_hpc.utils.fs import expand_path


class ToolSchema:
    """A schema dict readable as attributes (`schema.function.name`), as verl's pydantic schema is."""

    def __init__(self, data: dict[str, Any]):
        self._data = data
        for key, value in data.items():
            setattr(self, key, ToolSchema(value) if isinstance(value, dict) else value)

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return self._data


@dataclass
class ToolResponse:
    """What a tool may return instead of text (verl's newer `execute` returns one)."""

    text: str | None = None


class BaseTool:
    """verl's tool interface. Subclass it and override `execute` (and the others as needed)."""

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema | dict[str, Any]):
        self.config = dict(config or {})
        self.tool_schema = tool_schema if isinstance(tool_schema, ToolSchema) else ToolSchema(tool_schema)
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> ToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or str(uuid.uuid4())

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


class FunctionTool:
    """A plain function as a tool: sync or async, its schema from hints and docstring.

    `create_kwargs` of the row (`extra_info.tools_kwargs.<name>.create_kwargs`) are kept per
    episode and passed with `execute_kwargs` to a function that takes `**kwargs` (or names
    them): state the model cannot see, such as the task's hidden answer.
    """

    def __init__(self, fn: Any, schema: dict[str, Any]):
        self.fn, self.schema = fn, schema
        self.tool_schema = ToolSchema(schema)
        self.name = schema["function"]["name"]
        params = inspect.signature(fn).parameters
        self._open = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self._named = set(params)
        self._state: dict[str, dict[str, Any]] = {}
        self.is_async = inspect.iscoroutinefunction(fn)

    def get_openai_tool_schema(self) -> ToolSchema:
        return self.tool_schema

    def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._state[instance_id] = kwargs
        return instance_id

    def call_kwargs(self, instance_id: str, parameters: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        hidden = {**self._state.get(instance_id, {}), **extra}
        hidden = {k: v for k, v in hidden.items() if self._open or (k in self._named and k not in parameters)}
        return {**parameters, **hidden}

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    def release(self, instance_id: str, **kwargs: Any) -> None:
        self._state.pop(instance_id, None)


@dataclass
class ToolSet:
    """The run's tools by name, and their schemas in the order the chat template lists them."""

    tools: dict[str, Any] = field(default_factory=dict)
    schemas: list[dict[str, Any]] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # name -> the config entry it came from

    def add(self, tool: Any, schema: dict[str, Any], where: str) -> None:
        name = schema["function"]["name"]
        if name in self.tools:
            raise ConfigError(where.split(":")[0], f"a second tool named {name!r} (the first is "
                              f"{self.sources[name]})", "give every tool its own function name")
        self.tools[name], self.sources[name] = tool, where
        self.schemas.append(schema)


def function_tool(spec: str, field_name: str) -> tuple[FunctionTool, dict[str, Any]]:
    """`module:function` or `file.py:function` -> its tool and schema (ConfigError naming the entry)."""
    fn = import_callable(spec, field_name)
    try:
        schema = function_schema(fn, spec)
    except SchemaProblem as err:
        raise ConfigError(field_name, str(err), "type-hint every parameter and document it under Args:") from None
    return FunctionTool(fn, schema), schema


def _import_class(class_name: str, where: str) -> type:
    module_name, _, attr = class_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(where, f"class_name {class_name!r} cannot be imported: {err}",
                          "give a dotted path to an importable class (pkg.module.ClassName)") from None


def verl_tools(path: str | Path, field_name: str = "rollout.multi_turn.tool_config_path") -> list[tuple[Any, dict]]:
    """verl's tool config file -> [(tool instance, schema)] (ConfigError naming `tools[i]`)."""
    try:
        doc = yaml.safe_load(expand_path(str(path)).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(field_name, f"{path} cannot be read as YAML: {err}", "fix the file") from None
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(field_name, f"{path} has no `tools:` list", "write `tools: [{class_name, config, "
                          "tool_schema}]` as verl does")
    out = []
    for i, entry in enumerate(entries):
        where = f"{field_name}: tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry or "tool_schema" not in entry:
            raise ConfigError(where, "needs class_name and tool_schema", "see verl's tool config format")
        try:
            check_schema(entry["tool_schema"], where)
        except SchemaProblem as err:
            raise ConfigError(where, str(err).removeprefix(f"{where}: "), "fix tool_schema") from None
        cls = _import_class(str(entry["class_name"]), where)
        try:
            tool = cls(config=entry.get("config") or {}, tool_schema=ToolSchema(entry["tool_schema"]))
        except Exception as err:  # noqa: BLE001 - the user's constructor, reported with its entry
            raise ConfigError(where, f"{entry['class_name']}(config, tool_schema) raised {type(err).__name__}: "
                              f"{err}", "fix the tool's constructor or its config") from None
        out.append((tool, entry["tool_schema"]))
    return out


def load_tools(multi_turn: Any) -> ToolSet:
    """Every tool of `rollout.multi_turn` (functions, then the verl config file's), checked."""
    tools = ToolSet()
    for i, spec in enumerate(multi_turn.tools):
        where = f"rollout.multi_turn.tools[{i}]"
        tool, schema = function_tool(spec, where)
        tools.add(tool, schema, f"{where}: {spec}")
    if multi_turn.tool_config_path is not None:
        for i, (tool, schema) in enumerate(verl_tools(multi_turn.tool_config_path)):
            tools.add(tool, schema, f"rollout.multi_turn.tool_config_path: tools[{i}]")
    return tools
