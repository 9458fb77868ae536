"""Prompt datasets from Parquet or JSONL, read with pyarrow, in a resumable order.

Why a sampler object with state: the checkpoint must record the data order and the
position in it, so a resumed run draws exactly the prompts the uninterrupted run
would have drawn (torchtitan-style `state_dict`/`load_state_dict`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from verl_hpc.data.records import (
    MISSING,
    RowError,
    answer_text,
    check_prompt,
    info_text,
    key_type,
    key_values,
)


def _dataset_dir_files(path: Path) -> list[Path]:
    """The Arrow files of a Hugging Face `datasets` directory (`save_to_disk`), in order.

    Why no `datasets` dependency: those files are plain Arrow IPC streams listed in
    `state.json`; a `DatasetDict` directory holds one such folder per split (`train` is read).
    """
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (has {splits}); point at a split folder")
        path = path / "train"
    state = path / "state.json"
    if not state.is_file():
        raise ValueError(f"{path}: a directory, but not a Hugging Face dataset (no state.json)")
    return [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]


def is_dataset_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _read_arrow(path: Path) -> pa.Table:
    try:
        return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(str(path))).read_all()


def _read_jsonl(path: Path) -> pa.Table:
    """JSON lines; a file pyarrow refuses is parsed again to name the row that breaks it."""
    import pyarrow.json as pj

    try:
        return pj.read_json(path)
    except pa.ArrowInvalid:
        pass
    rows: list[dict[str, Any]] = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise RowError("data.train_files", f"{path} row {len(rows)} (line {line_no}): not JSON: {err}",
                               "write one JSON object per line") from None
    try:
        return pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        _raise_mixed(path, rows)
        raise


def _raise_mixed(path: Path, rows: list[dict[str, Any]]) -> None:
    """The first row whose value for a column has another JSON type than the rows before it."""
    first: dict[str, tuple[int, str]] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RowError("data.train_files", f"{path} row {i}: holds {type(row).__name__}, not an object")
        for key, value in row.items():
            kind = "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else \
                type(value).__name__
            if value is None:
                continue
            seen = first.setdefault(key, (i, kind))
            if seen[1] != kind:
                field = "data.prompt_key" if key in ("prompt", "messages") else "data.train_files"
                raise RowError(field, f"{path} row {i}, column {key!r}: holds {kind} {value!r:.40}, where row "
                               f"{seen[0]} holds {seen[1]}", "give the column one shape in every row "
                               "(a prompt: text, or a list of {role, content} messages)")


def read_table(path: str | Path) -> pa.Table:
    path = Path(path)
    if path.is_dir():
        tables = [_read_arrow(f) for f in _dataset_dir_files(path)]
        if not tables:
            raise ValueError(f"{path}: the dataset lists no data files")
        return pa.concat_tables(tables)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    if path.suffix == ".arrow":
        return _read_arrow(path)
    raise ValueError(f"{path}: unsupported file type {path.suffix!r} (use .parquet or .jsonl)")


def read_schema(path: str | Path):  # -> pa.Schema
    """The file's Arrow schema, reading as little as the format allows (Parquet: the footer only)."""
    path = Path(path)
    if path.suffix == ".parquet" and not path.is_dir():
        import pyarrow.parquet as pq

        return pq.read_schema(path)
    return read_table(path).schema


def count_rows(path: str | Path) -> int:
    """Rows of a prompt file, reading as little as the format allows (Parquet: the footer only)."""
    path = Path(path)
    if path.suffix == ".parquet" and not path.is_dir():
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return read_table(path).num_rows


def read_columns(path: str | Path) -> list[str]:
    return list(read_schema(path).names)


DEFAULT_ANSWER_KEYS = ("ground_truth", "reward_model.ground_truth")  # ours, then verl's nested one


def prompt_key_for(schema: pa.Schema, prompt_key: str) -> str:
    """`prompt_key`, or `messages` (chat JSONL) when the default `prompt` column is absent."""
    if prompt_key == "prompt" and key_type(schema, prompt_key) is None and key_type(schema, "messages") is not None:
        return "messages"
    return prompt_key


def answer_key_for(schema: pa.Schema, answer_key: str | None) -> str | None:
    """The answer column: the one named, else the first of DEFAULT_ANSWER_KEYS the file has."""
    if answer_key is not None:
        return answer_key
    return next((k for k in DEFAULT_ANSWER_KEYS if key_type(schema, k) is not None), None)


class PromptDataset:
    """Prompts (text or chat messages) with their answers, data sources and extra info, row-checked.

    `require_answer`: a rule reward needs every row's ground truth, so a null one is an
    error naming the row, not an empty string that scores 0 without a word.
    """

    def __init__(self, files: list[str | Path], prompt_key: str = "prompt", answer_key: str | None = None,
                 data_source_key: str = "data_source", extra_info_key: str = "extra_info",
                 require_answer: bool = False):
        self.prompts: list[str | list[dict[str, Any]]] = []
        self.answers: list[str | None] = []  # as text, for logs and `fn(prompt, response, ground_truth)`
        self.ground_truths: list[Any] = []  # as the file holds them (str, list, dict, ...), for verl's compute_score
        self.data_sources: list[str | None] = []
        self.extra_infos: list[str | None] = []
        self.where: list[str] = []  # "file row i, column 'prompt'" for each row's error messages
        for f in files:
            self._add(Path(f), read_table(f), prompt_key, answer_key, data_source_key, extra_info_key,
                      require_answer)
        if not self.prompts:
            raise ValueError(f"no prompts in {[str(f) for f in files]}")

    def _add(self, path: Path, table: pa.Table, prompt_key: str, answer_key: str | None, source_key: str,
             info_key: str, require_answer: bool) -> None:
        key = prompt_key_for(table.schema, prompt_key)
        prompts = key_values(table, key)
        if prompts is MISSING:
            raise ValueError(f"{path}: no column {prompt_key!r} (columns: {table.column_names})")
        akey = answer_key_for(table.schema, answer_key)
        raw = key_values(table, akey) if akey is not None else MISSING
        raw = [None] * table.num_rows if raw is MISSING else raw
        for row, (value, truth) in enumerate(zip(prompts, raw, strict=True)):  # type: ignore[arg-type]
            where = f"{path} row {row}, column {key!r}"
            if key == "messages" and isinstance(value, list):  # SFT-style chat: the last reply is the answer
                while value and isinstance(value[-1], dict) and value[-1].get("role") == "assistant":
                    if truth is None and akey is None:
                        truth = value[-1].get("content")
                    value = value[:-1]
            answer = answer_text(truth)
            self.prompts.append(check_prompt(value, where, "data.prompt_key"))
            if require_answer and answer is None:
                raise RowError("data.answer_key", f"{path} row {row}, column {akey or DEFAULT_ANSWER_KEYS[1]!r}: "
                               "the ground truth is missing", "give every row a ground truth, or drop the row")
            self.answers.append(answer)
            self.ground_truths.append(truth)
            self.where.append(where)
        for out, k, convert in ((self.data_sources, source_key, answer_text), (self.extra_infos, info_key, info_text)):
            values = key_values(table, k)
            out.extend([None] * table.num_rows if values is MISSING else [convert(v) for v in values])

    def keep(self, rows: list[int]) -> None:
        """Only these rows, in this order (what `data.filter_overlong_prompts` leaves)."""
        for name in ("prompts", "answers", "ground_truths", "data_sources", "extra_infos", "where"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in rows])

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
