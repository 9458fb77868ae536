"""Trajectory rows in the Arrow rollout batch; single-turn batches unchanged byte for byte."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from verl_hpc.data.rollout_batch import SCHEMA, TRAJECTORY_SCHEMA, RolloutBatch, SchemaError, validate

# The rollout schema as it was before trajectory rows existed: single-turn batches must still be this.
SINGLE_TURN_FIELDS = [
    ("prompt_index", pa.int64(), False), ("group_id", pa.int64(), False), ("sample_index", pa.int64(), False),
    ("policy_version", pa.int64(), False), ("step", pa.int64(), False),
    ("prompt_ids", pa.list_(pa.int32()), False), ("response_ids", pa.list_(pa.int32()), False),
    ("ground_truth", pa.string(), True), ("ground_truth_json", pa.string(), True),
    ("data_source", pa.string(), True), ("extra_info", pa.string(), True),
    ("score", pa.float32(), True), ("baseline_score", pa.float32(), True), ("judge_verdict", pa.string(), True),
    *[(name, pa.list_(pa.float32()), True) for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs",
                                                         "values", "token_rewards", "advantages", "returns")]]


def single_turn() -> RolloutBatch:
    return RolloutBatch.from_generation([[1, 2], [3]], [[4, 5, 6], [7]], [[-0.1, -0.2, -0.3], [-0.4]],
                                        group_ids=[0, 0], prompt_index=[5, 5], ground_truth=["x", None],
                                        policy_version=1, step=2)


def trajectory_rows() -> RolloutBatch:
    records = [json.dumps({"final_answer": "7", "finished": True}), json.dumps({"final_answer": "", "finished": False})]
    return RolloutBatch.from_generation(
        [[1, 2], [3]], [[4, 5, 6, 7], [8]], [[-0.1, 0.0, 0.0, -0.3], [-0.4]], group_ids=[1, 1],
        prompt_index=[6, 6], ground_truth=["7", "7"], policy_version=3, step=2,
        trajectory={"loss_mask": [[1, 0, 0, 1], [1]], "turn_bounds": [[0, 1, 3, 4], [0, 1]],
                    "turn_versions": [[3, 3], [3]], "trajectory": records})


def test_single_turn_batches_keep_the_old_schema_and_bytes() -> None:
    old = pa.schema([pa.field(n, t, nullable=nullable) for n, t, nullable in SINGLE_TURN_FIELDS])
    assert SCHEMA.equals(old)
    batch = single_turn()
    assert batch.schema.equals(old) and not batch.is_trajectory
    same = pa.RecordBatch.from_arrays([batch.column(f.name) for f in old], schema=old)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old) as writer:
        writer.write_batch(same)
    assert batch.to_ipc() == sink.getvalue().to_pybytes()


def test_an_older_file_without_newer_columns_still_loads() -> None:
    batch = single_turn().record_batch
    keep = [f.name for f in SCHEMA if f.name not in ("sample_index", "baseline_score", "extra_info")]
    older = pa.RecordBatch.from_arrays([batch.column(n) for n in keep], names=keep)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, older.schema) as writer:
        writer.write_batch(older)
    loaded = RolloutBatch.from_ipc(sink.getvalue().to_pybytes())
    assert loaded.schema.equals(SCHEMA) and loaded.column("sample_index").to_pylist() == [0, 1]


def test_trajectory_rows_round_trip_and_keep_their_columns() -> None:
    batch = trajectory_rows()
    assert batch.is_trajectory and batch.schema.equals(TRAJECTORY_SCHEMA)
    again = RolloutBatch.from_ipc(batch.to_ipc())
    assert again.column("loss_mask").to_pylist() == [[1, 0, 0, 1], [1]]
    assert again.column("turn_versions").to_pylist() == [[3, 3], [3]]
    scored = again.with_columns(score=torch.tensor([1.0, 0.0]), advantages=torch.ones(2, 4))
    assert scored.is_trajectory and scored.column("turn_bounds").to_pylist() == [[0, 1, 3, 4], [0, 1]]
    assert scored.take([1]).column("trajectory").to_pylist()[0] == batch.column("trajectory").to_pylist()[1]
    assert scored.only(["score"]).column("loss_mask").null_count == 0  # which tokens count travels along
    assert scored.sorted_by_row().model_token_counts().tolist() == [2, 1]


def test_single_turn_and_trajectory_rows_concatenate() -> None:
    both = RolloutBatch.concat([single_turn(), trajectory_rows()])
    assert both.is_trajectory and len(both) == 4
    inputs = both.model_inputs(pad_id=0)
    assert inputs["response_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 1], [1, 0, 0, 0]]
    assert both.column("turn_bounds").to_pylist()[:2] == [[0, 3], [0, 1]]  # a single-turn row: one turn
    assert both.column("turn_versions").to_pylist()[:2] == [[1], [1]]


def test_a_loss_mask_of_the_wrong_length_is_refused() -> None:
    rb = trajectory_rows().record_batch
    bad = rb.set_column(TRAJECTORY_SCHEMA.get_field_index("loss_mask"), "loss_mask",
                        pa.array([[1, 0], [1]], pa.list_(pa.int8())))
    with pytest.raises(SchemaError, match="'loss_mask' lengths differ from response_ids"):
        validate(bad)
