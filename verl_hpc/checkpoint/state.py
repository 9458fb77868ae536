"""Split a training state into tensors (for DCP) and JSON values (for objects.json).

Why: DCP pickles every non-tensor leaf and loads it back with `torch.load(weights_only=
False)`, i.e. a checkpoint could run code on load. Optimizer state dicts hold such leaves
(lr, betas, eps, param names); they are plain numbers and strings, so they travel as JSON
and are put back at their place on load. Anything that is not JSON is refused at save.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl_hpc.checkpoint.layout import CheckpointError


def split_items(items: Any, path: tuple[str, ...], objects: list) -> dict[str, Any]:
    out = {}
    for key, value in items:
        if not isinstance(key, str):
            raise CheckpointError(f"state key {key!r} under {'.'.join(path) or '<root>'} is not a string; "
                                  "build state dicts with torch.distributed.checkpoint.state_dict")
        sub = split_state(value, (*path, key), objects)
        if sub is not None:
            out[key] = sub
    return out


def split_state(node: Any, path: tuple[str, ...], objects: list) -> Any:
    """The tensor-only copy of `node` (None if it holds no tensor); other leaves go to `objects`.

    Why whole tensor-free subtrees become one JSON value: optimizer `param_groups` are
    lists of dicts of numbers; stored whole, their list/tuple structure comes back intact.
    Lists holding tensors become dicts keyed "0", "1"..., the same keys DCP would use.
    """
    if isinstance(node, torch.Tensor):
        return node
    if isinstance(node, Mapping) and has_tensor(node):
        return split_items(node.items(), path, objects)
    if isinstance(node, list | tuple) and has_tensor(node):
        return split_items(((str(i), v) for i, v in enumerate(node)), path, objects)
    objects.append((path, node))
    return None


def has_tensor(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, Mapping):
        return any(has_tensor(v) for v in node.values())
    return isinstance(node, list | tuple) and any(has_tensor(v) for v in node)


def to_json(value: Any, where: str) -> Any:
    """JSON form of a non-tensor leaf; tuples are tagged so that they come back as tuples."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v, where) for v in value]}
    if isinstance(value, list):
        return [to_json(v, where) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: to_json(v, f"{where}.{k}") for k, v in value.items()}
    raise CheckpointError(f"state value {where!r} is a {type(value).__name__}: only tensors and JSON values "
                          "(numbers, strings, lists, dicts) can be checkpointed; put other state in "
                          "rank_files/shared_files as JSON")


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v) for v in value["__tuple__"])
        return {k: from_json(v) for k, v in value.items()}
    return value


def restore_objects(state: dict[str, Any], stored: list) -> None:
    """Put the JSON leaves back into the caller's nested state, in place."""
    for path, value in stored:
        node: Any = state
        for key in path[:-1]:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[int(path[-1]) if isinstance(node, list) else path[-1]] = from_json(value)


def unwrap_stateful(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Top-level Stateful objects (model, optimizer) replaced by their state dicts, as DCP does."""
    stateful = {k: v for k, v in tensors.items()
                if hasattr(v, "state_dict") and hasattr(v, "load_state_dict") and not isinstance(v, Mapping)}
    return {k: (v.state_dict() if k in stateful else v) for k, v in tensors.items()}, stateful
