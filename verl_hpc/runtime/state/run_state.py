"""Run state that is not a tensor: counters, data order, LR schedules, RNG streams — as JSON.

Why JSON and not pickles inside the checkpoint: loading a checkpoint must never execute
arbitrary code (a checkpoint directory on a shared filesystem is an attack surface), so
only tensors go through DCP and everything else is plain data that `json.loads` reads.
RNG states are keyed by (group, rank in group), not global rank, so a resume with a
different number of actor processes still hands the rollout process its own stream.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states as JSON-able data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def rng_file_name(group: str, rank_in_group: int) -> str:
    return f"rng_{group}_{rank_in_group}.json"


def dumps(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True).encode()


def loads(data: bytes) -> dict[str, Any]:
    return json.loads(data.decode())


def config_hash(config_yaml: str) -> str:
    import hashlib

    return hashlib.sha256(config_yaml.encode()).hexdigest()[:16]
