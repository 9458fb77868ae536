"""The rollout batch: one Arrow schema every stage reads and writes.

Why Arrow: rollouts cross process and node boundaries (Flight), land in checkpoints
(IPC files) and feed trainers; one columnar layout with variable-length token lists
serves all three without pickling. Per-token columns are `list<float32>`: their flat
value buffers are viewed by numpy and torch without a copy, and turning them into a
padded `[B, T]` tensor is a single scatter (`padded`) — the one copy the trainer needs.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from verl_hpc.data.records import answer_json, answer_text

TOKEN_FLOAT_COLUMNS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "token_rewards", "advantages", "returns")

SCHEMA = pa.schema([
    pa.field("prompt_index", pa.int64(), nullable=False),
    pa.field("group_id", pa.int64(), nullable=False),
    pa.field("sample_index", pa.int64(), nullable=False),  # which of the group's n samples
    pa.field("policy_version", pa.int64(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),  # the training step this rollout is for
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("ground_truth", pa.string()),  # as text: what logs and metrics show
    pa.field("ground_truth_json", pa.string()),  # a ground truth that is not text (list, dict, number), as JSON
    pa.field("data_source", pa.string()),  # the dataset's `data_source` (verl's reward_fn_key)
    pa.field("extra_info", pa.string()),   # the dataset's `extra_info`, as JSON text (any shape)
    pa.field("score", pa.float32()),
    pa.field("baseline_score", pa.float32()),  # the prompt's greedy response's score (ReMax)
    pa.field("judge_verdict", pa.string()),  # an LLM judge's raw verdict (reward.judge), for the samples log
    *[pa.field(name, pa.list_(pa.float32())) for name in TOKEN_FLOAT_COLUMNS],
])

# A multi-turn row (an agent episode) carries four more columns after SCHEMA's: a single-turn batch
# keeps SCHEMA exactly (recorded rollouts stay interchangeable), only trajectory batches pay for them.
TRAJECTORY_FIELDS = (
    pa.field("loss_mask", pa.list_(pa.int8())),       # per response token: 1 sampled by the model, 0 inserted
    pa.field("turn_bounds", pa.list_(pa.int32())),    # [start, end) of each assistant turn's sampled tokens
    pa.field("turn_versions", pa.list_(pa.int64())),  # the policy version that sampled each turn
    pa.field("trajectory", pa.string()),              # JSON: messages, tool-call log, turn rewards, final answer
)
TRAJECTORY_SCHEMA = pa.schema([*SCHEMA, *TRAJECTORY_FIELDS])
TRAJECTORY_COLUMNS = tuple(f.name for f in TRAJECTORY_FIELDS)


_NON_NULLABLE_AT = tuple(i for i, f in enumerate(SCHEMA) if not f.nullable)
_TOKEN_FLOAT_AT = tuple(SCHEMA.get_field_index(name) for name in TOKEN_FLOAT_COLUMNS)
_RESPONSES_AT = SCHEMA.get_field_index("response_ids")
_LOSS_MASK_AT = TRAJECTORY_SCHEMA.get_field_index("loss_mask")


class SchemaError(ValueError):
    """A batch or file does not match SCHEMA; the message names the column."""


def validate(batch: pa.RecordBatch) -> None:
    # Why the fast path: the rollout transport validates every received batch, and each
    # column wrapper pyarrow makes costs ~1 µs, more than moving a small batch
    # (docs/benchmarks.md, "the same-node route"): columns are read by position once the
    # schema matches, and lengths are compared as offset bytes, not as numpy arrays.
    schema = batch.schema
    expected = schema_of(batch.schema)
    if schema.equals(expected):
        column = batch.column
    else:
        names = set(schema.names)
        for field in expected:
            if field.name not in names:
                raise SchemaError(f"rollout batch: column {field.name!r} is missing")
            got = schema.field(field.name).type
            if got != field.type:
                raise SchemaError(f"rollout batch: column {field.name!r} has type {got}, expected {field.type}")

        def column(i: int) -> pa.Array:
            return batch.column(expected[i].name)
    for i in _NON_NULLABLE_AT:
        if column(i).null_count:
            raise SchemaError(f"rollout batch: column {SCHEMA[i].name!r} has nulls")
    responses = None
    for i in _TOKEN_FLOAT_AT:
        col = column(i)
        if col.null_count == 0:
            responses = column(_RESPONSES_AT) if responses is None else responses
            if not _same_lengths(col, responses):
                raise SchemaError(f"rollout batch: column {SCHEMA[i].name!r} lengths differ from response_ids")
    if expected is TRAJECTORY_SCHEMA and column(_LOSS_MASK_AT).null_count == 0 \
            and not _same_lengths(column(_LOSS_MASK_AT), column(_RESPONSES_AT)):
        raise SchemaError("rollout batch: column 'loss_mask' lengths differ from response_ids")


def schema_of(schema: pa.Schema) -> pa.Schema:
    """The layout a batch with these columns has: TRAJECTORY_SCHEMA when it carries any trajectory column."""
    return TRAJECTORY_SCHEMA if any(name in schema.names for name in TRAJECTORY_COLUMNS) else SCHEMA


def _same_lengths(a: pa.ListArray, b: pa.ListArray) -> bool:
    """Row by row, do two list columns hold as many values? Equal offset bytes say yes at once."""
    if len(a) != len(b):
        return False
    if a.offset == b.offset == 0:  # unsliced: the offsets of rows 0..n, as stored
        nbytes = 4 * (len(a) + 1)
        if a.buffers()[1][:nbytes].equals(b.buffers()[1][:nbytes]):
            return True
    return bool(np.array_equal(_lengths(a), _lengths(b)))


def _lengths(col: pa.Array) -> np.ndarray:
    offsets = col.offsets.to_numpy()
    return np.diff(offsets)


def _ragged(rows: Sequence[Sequence[int]] | Sequence[np.ndarray], dtype: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([np.asarray(r) for r in rows]) if len(rows) else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(dtype.to_pandas_dtype())))


def ragged_from_padded(values: torch.Tensor, lengths: np.ndarray) -> pa.ListArray:
    """Valid prefix of each row of a padded [B, T] tensor -> list<float32>."""
    mask = torch.arange(values.shape[1]) < torch.as_tensor(lengths)[:, None]
    flat = values.detach().to(torch.float32).cpu()[mask].numpy()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def padded(col: pa.ListArray, width: int | None = None, pad: float = 0, left: bool = False,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """list<T> column -> padded [B, width] tensor in one scatter (right- or left-aligned)."""
    offsets = col.offsets.to_numpy()
    lengths = np.diff(offsets)
    with warnings.catch_warnings():  # Arrow buffers are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(col.values.to_numpy(zero_copy_only=False))
    flat = flat[offsets[0]:offsets[-1]]
    width = int(lengths.max(initial=0)) if width is None else width
    out = torch.full((len(lengths), width), pad, dtype=dtype or flat.dtype)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.from_numpy(lengths))
    within = torch.arange(len(flat)) - torch.repeat_interleave(torch.from_numpy(offsets[:-1] - offsets[0]),
                                                               torch.from_numpy(lengths))
    cols = within + torch.from_numpy(width - lengths).repeat_interleave(torch.from_numpy(lengths)) if left \
        else within
    out[rows, cols] = flat.to(out.dtype)
    return out


def _occurrences(group_ids: Sequence[int]) -> list[int]:
    """Each row's rank among the earlier rows of its group: 0, 1, ... per group, in order."""
    seen: dict[int, int] = {}
    out = []
    for g in group_ids:
        out.append(seen.get(int(g), 0))
        seen[int(g)] = out[-1] + 1
    return out


def _upgrade(batch: pa.RecordBatch, target: pa.Schema | None = None) -> pa.RecordBatch:
    """Batches saved by an earlier version (checkpointed rollout buffers, recorded rollouts), or a
    single-turn batch joining trajectory rows (`target` TRAJECTORY_SCHEMA).

    `sample_index` is derived from the row order; a nullable column that did not exist yet (`data_source`,
    `extra_info`, `baseline_score`, `ground_truth_json`, `judge_verdict`, the trajectory columns) is all
    nulls, which is what a dataset (or a single-turn rollout) without it gives.
    """
    target = target or schema_of(batch.schema)
    names = set(batch.schema.names)
    if all(f.name in names for f in target) and batch.schema.equals(target):
        return batch
    arrays = {name: batch.column(name) for name in batch.schema.names}
    if "sample_index" not in names:
        arrays["sample_index"] = pa.array(_occurrences(batch.column("group_id").to_pylist()), pa.int64())
    if target is TRAJECTORY_SCHEMA and "loss_mask" not in names:  # a single-turn row: one turn, all the model's
        lengths = _lengths(batch.column("response_ids"))
        arrays["loss_mask"] = _ragged([np.ones(n, np.int8) for n in lengths], pa.int8())
        arrays["turn_bounds"] = _ragged([[0, n] for n in lengths], pa.int32())
        arrays["turn_versions"] = _ragged([[v] for v in batch.column("policy_version").to_pylist()], pa.int64())
    for field in target:
        if field.name not in arrays and field.nullable:
            arrays[field.name] = pa.nulls(batch.num_rows, field.type)
    return pa.RecordBatch.from_arrays([arrays[f.name] for f in target], schema=target)


class RolloutBatch:
    """A thin, immutable-by-convention wrapper around one `pa.RecordBatch` with SCHEMA."""

    def __init__(self, record_batch: pa.RecordBatch, check: bool = True):
        if check:
            validate(record_batch)
        self._whole: pa.RecordBatch | None = record_batch
        self._chunks = [record_batch]

    @classmethod
    def from_chunks(cls, chunks: Sequence[pa.RecordBatch], check: bool = True) -> RolloutBatch:
        """One batch made of several SCHEMA record batches, joined only when first read whole.

        Why: a batch received in pieces (the rollout transport's ~4 MB messages) is next
        concatenated with the other generators' batches (`concat`); joining its pieces
        first would copy every byte twice. `column` joins just the one column it returns.
        """
        if not chunks:
            raise ValueError("RolloutBatch.from_chunks needs at least one record batch")
        if check:
            for chunk in chunks:
                validate(chunk)
        batch = cls.__new__(cls)
        batch._chunks = list(chunks)
        batch._whole = batch._chunks[0] if len(batch._chunks) == 1 else None
        return batch

    @property
    def record_batch(self) -> pa.RecordBatch:
        if self._whole is None:
            self._whole = pa.concat_batches(self._chunks)
            self._chunks = [self._whole]
        return self._whole

    @classmethod
    def from_generation(cls, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                        rollout_logprobs: Sequence[Sequence[float]] | None, group_ids: Sequence[int],
                        prompt_index: Sequence[int], ground_truth: Sequence[Any],
                        policy_version: int, step: int = 0,
                        sample_index: Sequence[int] | None = None,
                        data_source: Sequence[str | None] | None = None,
                        extra_info: Sequence[str | None] | None = None,
                        trajectory: dict[str, Sequence[Any]] | None = None) -> RolloutBatch:
        """One row per response; `data_source`/`extra_info` (JSON text) ride along to the reward.

        A non-text `ground_truth` (list, dict) is kept as JSON too: the reward gets it back whole.
        `trajectory` (multi-turn rows): `loss_mask`, `turn_bounds`, `turn_versions` and `trajectory`
        per row; the batch then has TRAJECTORY_SCHEMA.
        """
        n = len(prompt_ids)
        columns: dict[str, Any] = {
            "prompt_index": pa.array(prompt_index, pa.int64()),
            "group_id": pa.array(group_ids, pa.int64()),
            "sample_index": pa.array(sample_index if sample_index is not None else _occurrences(group_ids),
                                     pa.int64()),
            "policy_version": pa.array(np.full(n, policy_version, dtype=np.int64)),
            "step": pa.array(np.full(n, step, dtype=np.int64)),
            "prompt_ids": _ragged(prompt_ids, pa.int32()),
            "response_ids": _ragged(response_ids, pa.int32()),
            "ground_truth": pa.array([answer_text(t) for t in ground_truth], pa.string()),
            "ground_truth_json": pa.array([answer_json(t) for t in ground_truth], pa.string()),
            "data_source": pa.array(list(data_source), pa.string()) if data_source is not None
            else pa.nulls(n, pa.string()),
            "extra_info": pa.array(list(extra_info), pa.string()) if extra_info is not None
            else pa.nulls(n, pa.string()),
        }
        for name in ("score", "baseline_score", "judge_verdict", *TOKEN_FLOAT_COLUMNS):  # filled in by later stages
            columns[name] = pa.nulls(n, SCHEMA.field(name).type)
        if rollout_logprobs is not None:
            columns["rollout_logprobs"] = _ragged(rollout_logprobs, pa.float32())
        schema = SCHEMA
        if trajectory is not None:
            schema = TRAJECTORY_SCHEMA
            for field in TRAJECTORY_FIELDS:
                values = trajectory[field.name]
                columns[field.name] = pa.array(list(values), field.type) if field.name == "trajectory" \
                    else _ragged(values, field.type.value_type)
        return cls(pa.RecordBatch.from_arrays([columns[f.name] for f in schema], schema=schema))

    def __len__(self) -> int:
        return sum(chunk.num_rows for chunk in self._chunks)

    def column(self, name: str) -> pa.Array:
        if self._whole is not None:
            return self._whole.column(name)
        return pa.concat_arrays([chunk.column(name) for chunk in self._chunks])

    def has(self, name: str) -> bool:
        return name in self.schema.names and self.column(name).null_count < len(self)

    @property
    def schema(self) -> pa.Schema:
        """SCHEMA, or TRAJECTORY_SCHEMA for multi-turn rows."""
        return self._chunks[0].schema

    @property
    def is_trajectory(self) -> bool:
        return self.schema.equals(TRAJECTORY_SCHEMA)

    def loss_mask(self) -> torch.Tensor:
        """[B, R] 1 where the model sampled the response token, 0 where it was inserted (tool output,
        template text) or is padding; single-turn rows: every response token counts."""
        if not self.has("loss_mask"):
            lengths = torch.from_numpy(self.response_lengths().astype(np.int64))
            return (torch.arange(int(lengths.max(initial=0))) < lengths[:, None]).float()
        return padded(self.column("loss_mask"), pad=0, dtype=torch.float32)

    def model_token_counts(self) -> np.ndarray:
        """Tokens each row's model sampled: what response-length limits and metrics count."""
        if not self.has("loss_mask"):
            return self.response_lengths()
        return self.loss_mask().sum(dim=1).numpy().astype(np.int64)

    def with_columns(self, **columns: pa.Array | np.ndarray | torch.Tensor) -> RolloutBatch:
        """A new batch with columns replaced; per-token tensors are [B, R] padded."""
        schema = self.schema
        arrays = {f.name: self.record_batch.column(f.name) for f in schema}
        lengths = self.response_lengths()
        for name, value in columns.items():
            if name in TOKEN_FLOAT_COLUMNS and isinstance(value, torch.Tensor):
                arrays[name] = ragged_from_padded(value, lengths)
            elif isinstance(value, torch.Tensor):
                arrays[name] = pa.array(value.detach().cpu().numpy(), schema.field(name).type)
            elif isinstance(value, np.ndarray):
                arrays[name] = pa.array(value, schema.field(name).type)
            else:
                arrays[name] = value
        return RolloutBatch(pa.RecordBatch.from_arrays([arrays[f.name] for f in schema], schema=schema))

    def only(self, columns: Sequence[str]) -> RolloutBatch:
        """The same rows with every optional column not named emptied (all null): what a role that
        reads a few columns is sent, so the bytes on the wire are the ones it reads."""
        keep = {*columns, "loss_mask"}  # which tokens count travels with the tokens
        schema = self.schema
        arrays = [self.record_batch.column(f.name) if not f.nullable or f.name in keep
                  else pa.nulls(len(self), f.type) for f in schema]
        return RolloutBatch(pa.RecordBatch.from_arrays(arrays, schema=schema), check=False)

    def response_lengths(self) -> np.ndarray:
        return _lengths(self.column("response_ids"))

    def take(self, indices: Sequence[int] | np.ndarray) -> RolloutBatch:
        return RolloutBatch(self.record_batch.take(pa.array(np.asarray(indices, dtype=np.int64))), check=False)

    def token_tensor(self, name: str, width: int) -> torch.Tensor:
        """A per-token float column as a right-padded [B, width] tensor."""
        return padded(self.column(name), width, pad=0.0, dtype=torch.float32)

    def baseline_scores(self) -> torch.Tensor:
        """[B] greedy-baseline scores (ReMax); an error if the rows came without them."""
        column = self.column("baseline_score")
        if column.null_count:
            raise ValueError("rows without baseline_score: the greedy baseline was not generated")
        return torch.from_numpy(column.to_numpy(zero_copy_only=False).astype(np.float32))

    def scores(self) -> torch.Tensor:
        return torch.from_numpy(self.column("score").to_numpy(zero_copy_only=False).astype(np.float32))

    def model_inputs(self, pad_id: int) -> dict[str, torch.Tensor]:
        """[pad.. prompt | response ..pad] token ids, masks and positions for one forward pass.

        `response_mask` is the LOSS mask: the tokens the policy sampled. Every estimator, loss,
        KL, entropy, aggregation and length metric reads it, so text a tool or the chat template
        inserted into a multi-turn response never counts. `attention_mask` says which positions
        hold tokens at all (prompt and the whole response, inserted text included).
        """
        prompts = padded(self.column("prompt_ids"), pad=pad_id, left=True, dtype=torch.long)
        responses = padded(self.column("response_ids"), pad=pad_id, dtype=torch.long)
        prompt_lens = torch.from_numpy(_lengths(self.column("prompt_ids")).astype(np.int64))
        width = prompts.shape[1]
        prompt_mask = (torch.arange(width) >= (width - prompt_lens)[:, None]).long()
        resp_lens = torch.from_numpy(self.response_lengths().astype(np.int64))
        response_mask = (torch.arange(responses.shape[1]) < resp_lens[:, None]).long()
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        loss_mask = response_mask.float()
        if self.has("loss_mask"):
            loss_mask = padded(self.column("loss_mask"), responses.shape[1], pad=0, dtype=torch.float32)
        return {"input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
                "position_ids": position_ids, "response_mask": loss_mask}

    def to_ipc(self) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self.schema) as writer:
            for chunk in self._chunks:
                writer.write_batch(chunk)
        return sink.getvalue().to_pybytes()

    @classmethod
    def from_ipc(cls, data: bytes) -> RolloutBatch:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batches = list(reader)
        whole = pa.concat_batches(batches) if len(batches) != 1 else batches[0]
        return cls(_upgrade(whole))

    def sorted_by_row(self) -> RolloutBatch:
        """Rows in the step's order: by prompt group, then sample (the order every placement trains in)."""
        order = np.lexsort((self.column("sample_index").to_numpy(), self.column("group_id").to_numpy()))
        return self.take(order)

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        chunks = [chunk for b in batches for chunk in b._chunks]
        if any(chunk.schema.equals(TRAJECTORY_SCHEMA) for chunk in chunks):  # single-turn rows join as such
            chunks = [_upgrade(chunk, TRAJECTORY_SCHEMA) for chunk in chunks]
        return cls(pa.concat_batches(chunks), check=False)
