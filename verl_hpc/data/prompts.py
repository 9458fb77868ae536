"""Prompt datasets from Parquet or JSONL, read with pyarrow, in a resumable order.

Why a sampler object with state: the checkpoint must record the data order and the
position in it, so a resumed run draws exactly the prompts the uninterrupted run
would have drawn (torchtitan-style `state_dict`/`load_state_dict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa


def read_table(path: str | Path) -> pa.Table:
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    if path.suffix in (".jsonl", ".json"):
        import pyarrow.json as pj

        return pj.read_json(path)
    raise ValueError(f"{path}: unsupported file type {path.suffix!r} (use .parquet or .jsonl)")


def read_schema(path: str | Path):  # -> pa.Schema
    """The file's Arrow schema, reading as little as the format allows (Parquet: the footer only)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(path)
    return read_table(path).schema


def read_columns(path: str | Path) -> list[str]:
    return list(read_schema(path).names)


class PromptDataset:
    """Prompts (and optional answers) from one or more files, as Python strings."""

    def __init__(self, files: list[str | Path], prompt_key: str = "prompt", answer_key: str = "ground_truth"):
        tables = [read_table(f) for f in files]
        for f, t in zip(files, tables, strict=True):
            if prompt_key not in t.column_names:
                raise ValueError(f"{f}: no column {prompt_key!r} (columns: {t.column_names})")
        self.prompts: list[str] = [p for t in tables for p in t.column(prompt_key).to_pylist()]
        self.answers: list[str | None] = []
        for t in tables:
            if answer_key in t.column_names:
                self.answers.extend(None if a is None else str(a) for a in t.column(answer_key).to_pylist())
            else:
                self.answers.extend([None] * t.num_rows)
        if not self.prompts:
            raise ValueError(f"no prompts in {[str(f) for f in files]}")

    def __len__(self) -> int:
        return len(self.prompts)


class PromptSampler:
    """Epoch-wise shuffled indices; `state_dict` holds everything needed to continue."""

    def __init__(self, size: int, batch_prompts: int, seed: int, shuffle: bool = True):
        self.size, self.batch_prompts, self.seed, self.shuffle = size, batch_prompts, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.size)

    def next_indices(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch_prompts:
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(self.batch_prompts - len(out), self.size - self.position)
            out.extend(int(i) for i in self._order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(f"the checkpoint's dataset had {state['size']} prompts, this one has {self.size}")
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self._order = self._make_order()
