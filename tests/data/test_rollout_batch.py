"""Tests for the Arrow rollout batch: layout, padding, validation and round trips."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from verl_hpc.data.rollout_batch import SCHEMA, RolloutBatch, SchemaError, padded, validate

PAD = 63


def two_rows(**overrides) -> RolloutBatch:
    """Row 0: 3-token prompt, 2-token response; row 1: 1-token prompt, 3-token response."""
    kwargs = dict(
        prompt_ids=[[5, 6, 7], [8]],
        response_ids=[[9, 10], [11, 12, 13]],
        rollout_logprobs=[[-0.5, -1.5], [-0.25, -2.0, -3.0]],
        group_ids=[0, 0],
        prompt_index=[4, 4],
        ground_truth=["7", None],
        policy_version=3,
    )
    kwargs.update(overrides)
    return RolloutBatch.from_generation(**kwargs)


def int_lists(rows: list[list[int]]) -> pa.ListArray:
    return pa.array(rows, pa.list_(pa.int32()))


def columns_of(batch: RolloutBatch) -> dict[str, pa.Array]:
    return {name: batch.column(name) for name in SCHEMA.names}


def record_batch(columns: dict[str, pa.Array]) -> pa.RecordBatch:
    """A record batch from arrays, with each array's own type and nullable fields."""
    return pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))


# --- construction and model inputs -------------------------------------------------------


def test_from_generation_schema_and_columns():
    batch = two_rows()
    assert batch.record_batch.schema.equals(SCHEMA)
    assert len(batch) == 2
    assert batch.column("prompt_ids").to_pylist() == [[5, 6, 7], [8]]
    assert batch.column("response_ids").to_pylist() == [[9, 10], [11, 12, 13]]
    assert batch.column("policy_version").to_pylist() == [3, 3]
    assert batch.column("ground_truth").to_pylist() == ["7", None]
    np.testing.assert_array_equal(batch.response_lengths(), [2, 3])
    assert batch.has("rollout_logprobs")
    assert not batch.has("score")
    assert not batch.has("advantages")


def test_from_generation_without_logprobs_leaves_the_column_null():
    batch = two_rows(rollout_logprobs=None)
    assert batch.record_batch.schema.equals(SCHEMA)
    assert batch.column("rollout_logprobs").null_count == 2


def test_model_inputs_exact_layout():
    inputs = two_rows().model_inputs(PAD)
    P = PAD
    # [left-padded prompt | right-padded response]
    expected_ids = [[5, 6, 7, 9, 10, P],
                    [P, P, 8, 11, 12, 13]]
    expected_attention = [[1, 1, 1, 1, 1, 0],
                          [0, 0, 1, 1, 1, 1]]
    # cumsum(attention) - 1, clamped at 0: pads before the prompt sit at 0, pads after
    # the response repeat the last position.
    expected_positions = [[0, 1, 2, 3, 4, 4],
                          [0, 0, 0, 1, 2, 3]]
    expected_response_mask = [[1.0, 1.0, 0.0],
                              [1.0, 1.0, 1.0]]
    assert inputs["input_ids"].dtype == torch.long
    assert inputs["input_ids"].tolist() == expected_ids
    assert inputs["attention_mask"].tolist() == expected_attention
    assert inputs["position_ids"].tolist() == expected_positions
    assert inputs["response_mask"].dtype == torch.float32
    assert inputs["response_mask"].tolist() == expected_response_mask


# --- padded --------------------------------------------------------------------------------


def test_padded_right_and_left():
    col = int_lists([[1, 2], [3], [4, 5, 6], []])
    right = padded(col)
    left = padded(col, left=True)
    assert right.dtype == torch.int32
    assert right.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6], [0, 0, 0]]
    assert left.tolist() == [[0, 1, 2], [0, 0, 3], [4, 5, 6], [0, 0, 0]]


def test_padded_width_pad_value_and_dtype():
    col = int_lists([[1, 2], [3]])
    out = padded(col, width=4, pad=-1, left=True, dtype=torch.long)
    assert out.dtype == torch.long
    assert out.tolist() == [[-1, -1, 1, 2], [-1, -1, -1, 3]]
    floats = pa.array([[0.5], [1.5, 2.5]], pa.list_(pa.float32()))
    assert padded(floats, width=3).tolist() == [[0.5, 0.0, 0.0], [1.5, 2.5, 0.0]]


@pytest.mark.parametrize("make", [int_lists, lambda rows: RolloutBatch.from_generation(
    rows, rows, None, [0] * len(rows), [0] * len(rows), [None] * len(rows), 0).column("response_ids")],
    ids=["pa.array", "from_generation"])
def test_padded_on_sliced_list_array(make):
    col = make([[1, 2], [3], [4, 5, 6], [], [7]])
    tail = col.slice(1)
    assert tail.offset == 1
    assert padded(tail).tolist() == [[3, 0, 0], [4, 5, 6], [0, 0, 0], [7, 0, 0]]
    assert padded(tail, left=True).tolist() == [[0, 0, 3], [4, 5, 6], [0, 0, 0], [0, 0, 7]]
    middle = col.slice(2, 2)
    assert padded(middle).tolist() == [[4, 5, 6], [0, 0, 0]]
    assert padded(middle, left=True, width=4, pad=9).tolist() == [[9, 4, 5, 6], [9, 9, 9, 9]]


def test_model_inputs_of_a_sliced_batch():
    batch = RolloutBatch.from_generation([[1], [2, 3], [4, 5, 6]], [[7, 8, 9], [10], [11, 12]], None,
                                         [0, 1, 2], [0, 1, 2], [None] * 3, 0)
    tail = RolloutBatch(batch.record_batch.slice(1))
    inputs = tail.model_inputs(0)
    assert inputs["input_ids"].tolist() == [[0, 2, 3, 10, 0], [4, 5, 6, 11, 12]]
    assert inputs["attention_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert inputs["response_mask"].tolist() == [[1.0, 0.0], [1.0, 1.0]]


def padded_reference(rows: list[list[int]], width: int, pad: int, left: bool) -> torch.Tensor:
    out = torch.full((len(rows), width), pad, dtype=torch.int32)
    for i, row in enumerate(rows):
        if row:
            if left:
                out[i, width - len(row):] = torch.tensor(row, dtype=torch.int32)
            else:
                out[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


def test_padded_large_batch_matches_python_loop():
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(0, 40, size=4096)]
    col = int_lists(rows)
    width = max(len(r) for r in rows)
    assert torch.equal(padded(col), padded_reference(rows, width, 0, left=False))
    assert torch.equal(padded(col, pad=-7, left=True), padded_reference(rows, width, -7, left=True))
    tail = col.slice(1000)
    tail_width = max(len(r) for r in rows[1000:])
    assert torch.equal(padded(tail, left=True), padded_reference(rows[1000:], tail_width, 0, left=True))


def test_padded_result_does_not_alias_arrow_memory():
    col = int_lists([[1, 2, 3], [4, 5, 6]])  # all rows full width: the scatter is still a copy
    out = padded(col)
    out += 100
    assert col.to_pylist() == [[1, 2, 3], [4, 5, 6]]


# --- per-token columns -----------------------------------------------------------------------


def test_with_columns_token_tensor_round_trip():
    batch = two_rows()
    # Valid positions hold exact float32 values; padding positions hold garbage that must vanish.
    values = torch.tensor([[0.125, -2.5, 1e6],
                           [3.0, 0.75, -1.0]])
    out = batch.with_columns(advantages=values, score=torch.tensor([1.0, 0.0]))
    assert out.column("advantages").to_pylist() == [[0.125, -2.5], [3.0, 0.75, -1.0]]
    assert out.token_tensor("advantages", 3).tolist() == [[0.125, -2.5, 0.0], [3.0, 0.75, -1.0]]
    assert out.token_tensor("advantages", 5).tolist() == [[0.125, -2.5, 0.0, 0.0, 0.0],
                                                          [3.0, 0.75, -1.0, 0.0, 0.0]]
    assert out.scores().tolist() == [1.0, 0.0]
    assert out.has("advantages") and out.has("score")
    # the original is untouched
    assert not batch.has("advantages")
    # untouched columns carry over
    assert out.column("rollout_logprobs").equals(batch.column("rollout_logprobs"))
    assert out.token_tensor("rollout_logprobs", 3).tolist() == [[-0.5, -1.5, 0.0], [-0.25, -2.0, -3.0]]


def test_with_columns_random_round_trip():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 12, size=50)
    responses = [rng.integers(0, 64, size=int(n)).tolist() for n in lengths]
    batch = RolloutBatch.from_generation([[1]] * 50, responses, None, list(range(50)), list(range(50)),
                                         [None] * 50, 0)
    width = int(lengths.max())
    values = torch.randn(50, width)
    mask = torch.arange(width) < torch.as_tensor(lengths)[:, None]
    out = batch.with_columns(returns=values).token_tensor("returns", width)
    assert torch.equal(out[mask], values[mask])
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum())))


# --- IPC -------------------------------------------------------------------------------------


def test_ipc_round_trip():
    batch = two_rows().with_columns(score=np.array([0.5, 1.0], dtype=np.float32),
                                    values=torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]))
    data = batch.to_ipc()
    assert isinstance(data, bytes)
    back = RolloutBatch.from_ipc(data)
    assert back.record_batch.equals(batch.record_batch)
    assert back.record_batch.schema.equals(SCHEMA)


def test_ipc_round_trip_of_a_sliced_batch():
    batch = RolloutBatch(two_rows().record_batch.slice(1))
    back = RolloutBatch.from_ipc(batch.to_ipc())
    assert back.record_batch.equals(batch.record_batch)
    assert back.column("prompt_ids").to_pylist() == [[8]]


# --- validation --------------------------------------------------------------------------------


def check_rejected(rb: pa.RecordBatch, column: str, words: str) -> None:
    for call in (validate, RolloutBatch):
        with pytest.raises(SchemaError, match=rf"'{column}'.*{words}"):
            call(rb)


def test_valid_batch_passes():
    rb = two_rows().record_batch
    validate(rb)
    validate(record_batch(columns_of(two_rows())))  # nullable fields, same types: still fine


def test_missing_column_rejected():
    cols = columns_of(two_rows())
    del cols["group_id"]
    check_rejected(record_batch(cols), "group_id", "missing")


def test_wrong_type_rejected():
    cols = columns_of(two_rows())
    cols["response_ids"] = pa.array([[9, 10], [11, 12, 13]], pa.list_(pa.int64()))
    check_rejected(record_batch(cols), "response_ids", "type")
    cols = columns_of(two_rows())
    cols["score"] = pa.array([1.0, 0.0], pa.float64())
    check_rejected(record_batch(cols), "score", "type")


def test_nulls_in_non_nullable_column_rejected():
    cols = columns_of(two_rows())
    cols["prompt_index"] = pa.array([4, None], pa.int64())
    check_rejected(record_batch(cols), "prompt_index", "nulls")
    cols = columns_of(two_rows())
    cols["response_ids"] = pa.array([[9, 10], None], pa.list_(pa.int32()))
    check_rejected(record_batch(cols), "response_ids", "nulls")


def test_nulls_in_nullable_column_accepted():
    cols = columns_of(two_rows())
    cols["score"] = pa.array([1.0, None], pa.float32())
    validate(record_batch(cols))


def test_per_token_length_mismatch_rejected():
    cols = columns_of(two_rows())
    cols["rollout_logprobs"] = pa.array([[-0.5, -1.5], [-0.25, -2.0]], pa.list_(pa.float32()))
    check_rejected(record_batch(cols), "rollout_logprobs", "lengths")
    cols = columns_of(two_rows())
    cols["advantages"] = pa.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], pa.list_(pa.float32()))
    check_rejected(record_batch(cols), "advantages", "lengths")


def test_per_token_lengths_are_checked_whatever_the_offsets_look_like():
    """The offset-bytes shortcut only says "equal"; sliced or shifted offsets take the row-by-row path."""
    rb = two_rows().record_batch
    validate(rb.slice(1, 1))  # sliced: offsets no longer start at the array's start
    cols = columns_of(two_rows())
    cols["rollout_logprobs"] = pa.array([[-0.5, -1.5], [-0.25, -2.0]], pa.list_(pa.float32()))
    check_rejected(record_batch(cols).slice(1, 1), "rollout_logprobs", "lengths")
    cols = columns_of(two_rows())  # same lengths (2, 3), offsets shifted by 4: [4, 6, 9], not [0, 2, 5]
    cols["rollout_logprobs"] = pa.ListArray.from_arrays(pa.array([4, 6, 9], pa.int32()),
                                                        pa.array([9.0] * 9, pa.float32()))
    validate(pa.RecordBatch.from_arrays(list(cols.values()), schema=SCHEMA))
    cols["rollout_logprobs"] = pa.ListArray.from_arrays(pa.array([4, 7, 9], pa.int32()),
                                                        pa.array([9.0] * 9, pa.float32()))
    check_rejected(pa.RecordBatch.from_arrays(list(cols.values()), schema=SCHEMA), "rollout_logprobs", "lengths")


def test_with_columns_rejects_wrong_lengths():
    with pytest.raises(SchemaError, match="'values'"):
        two_rows().with_columns(values=pa.array([[1.0], [2.0]], pa.list_(pa.float32())))


# --- take / concat -----------------------------------------------------------------------------


def test_take_keeps_rows():
    batch = two_rows()
    taken = batch.take([1, 0, 1])
    assert len(taken) == 3
    assert taken.column("prompt_ids").to_pylist() == [[8], [5, 6, 7], [8]]
    assert taken.column("response_ids").to_pylist() == [[11, 12, 13], [9, 10], [11, 12, 13]]
    assert taken.column("ground_truth").to_pylist() == [None, "7", None]
    assert taken.token_tensor("rollout_logprobs", 3).tolist() == [[-0.25, -2.0, -3.0],
                                                                  [-0.5, -1.5, 0.0],
                                                                  [-0.25, -2.0, -3.0]]
    validate(taken.record_batch)
    assert taken.take(np.array([1])).column("response_ids").to_pylist() == [[9, 10]]


def test_only_keeps_the_named_and_required_columns_and_nulls_the_rest():
    batch = two_rows().with_columns(score=np.array([1.0, 0.5], dtype=np.float32))
    sent = batch.only(["ground_truth"])
    validate(sent.record_batch)
    assert sent.column("ground_truth").to_pylist() == ["7", None]
    assert sent.column("response_ids").to_pylist() == batch.column("response_ids").to_pylist()
    assert sent.column("group_id").to_pylist() == batch.column("group_id").to_pylist()
    assert sent.column("rollout_logprobs").null_count == 2 and sent.column("score").null_count == 2
    assert len(sent.to_ipc()) < len(batch.to_ipc())
    assert RolloutBatch.from_ipc(sent.to_ipc()).column("prompt_ids").to_pylist() == [[5, 6, 7], [8]]


def test_concat_keeps_rows():
    a = two_rows()
    b = RolloutBatch.from_generation([[1, 2]], [[3]], [[-1.0]], [7], [9], ["3"], policy_version=4)
    both = RolloutBatch.concat([a, b, a])
    assert len(both) == 5
    assert both.record_batch.schema.equals(SCHEMA)
    assert both.column("prompt_index").to_pylist() == [4, 4, 9, 4, 4]
    assert both.column("policy_version").to_pylist() == [3, 3, 4, 3, 3]
    assert both.column("response_ids").to_pylist() == [[9, 10], [11, 12, 13], [3], [9, 10], [11, 12, 13]]
    np.testing.assert_array_equal(both.response_lengths(), [2, 3, 1, 2, 3])
    validate(both.record_batch)
    inputs = both.model_inputs(0)
    assert inputs["input_ids"].shape == (5, 3 + 3)
    assert inputs["input_ids"][2].tolist() == [0, 1, 2, 3, 0, 0]
