"""OpenAI function-tool schemas: built from a Python function's type hints and docstring, and checked.

Why our own (transformers' `get_json_schema` does the same job): the refusal must name the
config entry and say what to fix, before any process starts, and must hold for schemas written
by hand in a verl tool config too — one checker for both. Docstrings are Google style: the
first paragraph describes the tool, `Args:` describes each parameter (every one must be).
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections import abc
from collections.abc import Callable
from typing import Any

JSON_TYPES = {"string", "integer", "number", "boolean", "array", "object", "null"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_SECTIONS = ("returns:", "return:", "raises:", "yields:", "examples:", "example:", "note:", "notes:")


class SchemaProblem(ValueError):
    """Why a function or a schema cannot be a tool (one line, the fix included)."""


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    """The JSON-schema fragment of one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    simple = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array",
              type(None): "null", Any: None}
    if hint in simple:
        kind = simple[hint]
        return {} if kind is None else {"type": kind}
    if origin is typing.Literal:
        values = list(args)
        kinds = {_json_type(type(v), where)["type"] for v in values}
        return {"type": kinds.pop() if len(kinds) == 1 else sorted(kinds), "enum": values}
    if origin in (typing.Union, types.UnionType):
        parts = [_json_type(a, where) for a in args]
        if all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
            return {"type": [p["type"] for p in parts]}
        return {"anyOf": parts}
    if origin in (list, tuple, set, frozenset, abc.Sequence):
        return {"type": "array", **({"items": _json_type(args[0], where)} if args and args[0] is not Ellipsis
                                    else {})}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _json_type(args[1], where)} if len(args) == 2
                                     else {})}
    raise SchemaProblem(f"{where}: type {hint!r} has no JSON-schema equivalent (use str, int, float, bool, "
                        "list[...], dict[str, ...], Literal[...] or an Optional of those)")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section, current = "description", None
    for line in lines:
        low = line.strip().lower()
        if low in ("args:", "arguments:", "parameters:"):
            section = "args"
            continue
        if low in _SECTIONS:
            section = "other"
            continue
        if section == "description":
            description.append(line)
        elif section == "args":
            match = _ARG_LINE.match(line)
            if match and (not line.startswith(" " * 8) or current is None):
                current = match.group(1).lstrip("*")
                args[current] = match.group(3).strip()
            elif current is not None and line.strip():
                args[current] = f"{args[current]} {line.strip()}".strip()
    paragraph = "\n".join(description).strip().split("\n\n")[0]
    return " ".join(paragraph.split()), args


def function_schema(fn: Callable[..., Any], where: str) -> dict[str, Any]:
    """The `{"type": "function", "function": {name, description, parameters}}` schema of `fn`."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    doc = inspect.getdoc(fn)
    if not doc:
        raise SchemaProblem(f"{where}: {name} has no docstring; the model reads the tool's description from it "
                            "(add one, with an Args: line per parameter)")
    description, arg_docs = parse_docstring(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:  # noqa: BLE001 - an unresolvable annotation, reported as such
        raise SchemaProblem(f"{where}: the type hints of {name} cannot be resolved: {err}") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue  # **kwargs: where the run passes the row's execute_kwargs
        if param.name not in hints:
            raise SchemaProblem(f"{where}: parameter {param.name!r} of {name} has no type hint "
                                "(annotate it: the model's arguments are checked against it)")
        if param.name not in arg_docs:
            raise SchemaProblem(f"{where}: parameter {param.name!r} of {name} is not described in the docstring "
                                f"(add `{param.name}: ...` under Args:)")
        properties[param.name] = {**_json_type(hints[param.name], f"{where} ({param.name})"),
                                  "description": arg_docs[param.name]}
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    schema = {"type": "function", "function": {"name": name, "description": description,
                                               "parameters": {"type": "object", "properties": properties,
                                                              "required": required}}}
    check_schema(schema, where)
    return schema


def _check_property(name: str, prop: Any, where: str) -> None:
    if not isinstance(prop, dict):
        raise SchemaProblem(f"{where}: parameter {name!r} must be a mapping, got {type(prop).__name__}")
    kinds = prop.get("type")
    if kinds is None and not ({"enum", "anyOf", "oneOf"} & set(prop)):
        raise SchemaProblem(f"{where}: parameter {name!r} has no type (give it one of {sorted(JSON_TYPES)})")
    for kind in [kinds] if isinstance(kinds, str) else list(kinds or []):
        if kind not in JSON_TYPES:
            raise SchemaProblem(f"{where}: parameter {name!r} has type {kind!r}, not a JSON-schema type "
                                f"(one of {sorted(JSON_TYPES)})")


def check_schema(schema: Any, where: str) -> None:
    """Raise SchemaProblem naming what is wrong with an OpenAI function-tool schema."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(
            schema.get("function"), dict):
        raise SchemaProblem(f"{where}: a tool schema is {{type: function, function: {{name, description, "
                            "parameters}}}}")
    function = schema["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SchemaProblem(f"{where}: function.name {name!r} must be an identifier of at most 64 characters")
    if not isinstance(function.get("description", ""), str):
        raise SchemaProblem(f"{where}: function.description must be text")
    params = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise SchemaProblem(f"{where}: function.parameters must be {{type: object, properties: ...}}")
    properties = params.get("properties") or {}
    if not isinstance(properties, dict):
        raise SchemaProblem(f"{where}: function.parameters.properties must be a mapping")
    for prop_name, prop in properties.items():
        _check_property(prop_name, prop, where)
    required = params.get("required") or []
    missing = [r for r in required if r not in properties]
    if not isinstance(required, list) or missing:
        raise SchemaProblem(f"{where}: function.parameters.required names {missing or required!r}, "
                            "which are not among its properties")


def check_arguments(schema: dict[str, Any], arguments: Any) -> str | None:
    """Why the model's `arguments` do not fit the schema (None when they do): told to the model."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = schema["function"].get("parameters") or {}
    properties = params.get("properties") or {}
    missing = [name for name in params.get("required") or [] if name not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown and params.get("additionalProperties", False) is False:
        return f"unknown argument(s) {', '.join(unknown)}; expected {', '.join(properties) or 'none'}"
    return None
