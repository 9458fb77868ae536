"""YAML + Hydra-style overrides -> a validated `RunConfig`, or one line saying what is wrong.

Why here and not in the CLI: `submit` validates on the login node before anything is
queued, `train` validates before spawning a process, and the Python API does both; all
of them must report the same one-line error naming the field and the fix.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from verl_hpc.config.errors import ConfigError, FieldError

BASE_KEY = "base"


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file as a mapping, with the files its `base:` names merged under it.

    Why bases: most example configs share the model, task and algorithm and differ only in
    placement; a delta that says `base: quickstart.yaml` and what it changes shows the
    difference at a glance. The base's path is relative to the file that names it; bases may
    chain; the including file wins key by key (`merge_under`); overrides still apply last.
    """
    return _with_bases(Path(path), ())


def _with_bases(path: Path, including: tuple[Path, ...]) -> dict[str, Any]:
    data = _read_mapping(path)
    base = data.pop(BASE_KEY, None)
    if base is None:
        return data
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(BASE_KEY, f"must be the path of another config file, got {base!r}",
                          "e.g. base: quickstart.yaml (relative to this file)", source=str(path))
    chain = (*including, path.resolve())
    target = (path.parent / Path(base).expanduser()).resolve()
    if target in chain:
        cycle = " -> ".join(p.name for p in (*chain[chain.index(target):], target))
        raise ConfigError(BASE_KEY, f"{base} leads back to a file that includes it ({cycle})",
                          "remove one `base:` of the cycle", source=str(path))
    if not target.is_file():
        raise ConfigError(BASE_KEY, f"{target} does not exist",
                          "a base is a path relative to the file that names it", source=str(path))
    return merge_under(_with_bases(target, chain), data)


def merge_under(base: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """`data` over `base`: mappings merge key by key, any other value (a list too) replaces; a new dict."""
    merged = dict(base)
    for key, value in data.items():
        below = merged.get(key)
        merged[key] = merge_under(below, value) if isinstance(value, dict) and isinstance(below, dict) else value
    return merged


def _read_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError("", f"config file {path} does not exist", "check the path")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise ConfigError("", f"{problem}{where}", "fix the YAML syntax", source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", "the top level must be a mapping of sections", source=str(path))
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`a.b.c=value` sets (value parsed as YAML), `~a.b` deletes; returns a new dict."""
    import copy

    result = copy.deepcopy(data)
    for item in overrides:
        delete = item.startswith("~")
        key, sep, raw = item.lstrip("~+").partition("=")
        if not key or (not sep and not delete) or any(not part for part in key.split(".")):
            raise ConfigError(key or item, f"override {item!r} is not of the form key.path=value",
                              "e.g. trainer.total_steps=50")
        try:
            value = yaml.safe_load(raw) if sep else None
        except yaml.YAMLError:
            value = raw
        *parents, leaf = key.split(".")
        node, absent = result, False
        for depth, part in enumerate(parents):
            child = node.get(part)
            if child is None and delete:
                absent = True  # nothing to delete; creating the parents would add sections
                break
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                path = ".".join(parents[: depth + 1])
                raise ConfigError(path, f"is a {type(child).__name__}, so {key} cannot be set inside it")
            node = child
        if delete:
            if not absent:
                node.pop(leaf, None)
        else:
            node[leaf] = value
    return result


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config class that owns the field at `loc` (for "did you mean")."""
    import typing

    current: Any = model
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            continue
        current = field.annotation
        for arg in typing.get_args(current) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _format_error(model: type[BaseModel], err: dict[str, Any], prefix: str) -> ConfigError:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    path = path.rstrip(".")
    original = (err.get("ctx") or {}).get("error")
    if isinstance(original, FieldError):
        inner = original.path
        full = ".".join(p for p in (path, inner) if p)
        return ConfigError(full, original.message, original.hint)
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        known = sorted(owner.model_fields) if owner else []
        if owner is not None:
            known += [f.alias for f in owner.model_fields.values() if f.alias]
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(known)}"
        return ConfigError(path, "unknown key", hint)
    if kind == "missing":
        return ConfigError(path, "is required but missing", "add it to the config")
    message = err["msg"].removeprefix("Value error, ")
    given = err.get("input")
    if not isinstance(given, dict | list):
        message = f"{message} (got {given!r})"
    return ConfigError(path, message)


def validate_section(model: type[BaseModel], data: Any, source: str | None = None, prefix: str = ""):
    """Validate `data` as `model`; the first problem becomes a one-line ConfigError."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = _format_error(model, errors[0], prefix)
        if len(errors) > 1:
            first.message += f" (and {len(errors) - 1} more problem(s))"
        first.source = source
        raise ConfigError(first.path, first.message, first.hint, source) from None
    except FieldError as exc:  # raised outside pydantic's wrapping
        raise ConfigError(prefix + exc.path, exc.message, exc.hint, source) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                data: dict[str, Any] | None = None):  # -> RunConfig
    """Read YAML (or take `data`), apply overrides, validate everything."""
    from verl_hpc.config.schema import RunConfig

    raw = read_yaml(path) if path is not None else dict(data or {})
    raw = on_cpu_model(apply_overrides(raw, overrides or []))
    return validate_section(RunConfig, raw, source=str(path) if path else None)


def on_cpu_model(raw: dict[str, Any]) -> dict[str, Any]:
    """With `resources.device_type: cpu`, the model trains in float32 (all CPU training supports).

    Why here: a GPU config's `model.dtype: bfloat16` / `mixed_precision` would fail its CPU
    check; the one-word switch (see ResourceConfig.device_type) drops them instead.
    """
    resources, model = raw.get("resources"), raw.get("model")
    if not (isinstance(resources, dict) and resources.get("device_type") == "cpu" and isinstance(model, dict)):
        return raw
    model = {k: v for k, v in model.items() if k not in ("dtype", "mixed_precision")}
    return {**raw, "model": model}


def load_resource_config(path: str | Path):  # -> ResourceConfig
    """Read a standalone `resource_config.yaml` (the `resources` section alone) verbatim."""
    from verl_hpc.config.resources import ResourceConfig

    return validate_section(ResourceConfig, read_yaml(path), source=str(path))


def dump_config(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
