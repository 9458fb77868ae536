"""An LLM judge as the reward of a real run: SmolLM2-135M-Instruct judges a tiny policy's responses.

The first run has the judge in the trainer's process (colocated) and records the responses it
trained on; the second replays those responses with the judge in a process group of its own
(`resources.reward`). The judge decodes greedily, so both must give every row the same verdict
and score, and both runs train. The verdicts are in the samples table TensorBoard shows, and a
verdict without a number scores 0 (`reward.on_error: zero`), never the run.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from verl_hpc.config import load_config
from verl_hpc.launch.train import train
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.roles.judge import parse_verdict

pytestmark = pytest.mark.slow
STEPS = 2


def judge_run(policy: Path, judge: Path) -> dict[str, Any]:
    return {
        "model": {"path": str(policy)},
        "data": {"task": {"name": "arithmetic", "num_prompts": 16, "max_operand": 4, "seed": 0}},
        "reward": {"judge": {"model_path": str(judge), "max_new_tokens": 4, "batch_size": 8}, "on_error": "zero"},
        # The entropy bonus moves the weights even when a group's verdicts all agree.
        "algorithm": {"sampling": {"n": 4, "max_new_tokens": 4}, "entropy_coef": 0.01},
        "trainer": {"total_steps": STEPS, "batch_size": 8, "seed": 0, "torch_threads": 1},
        "resources": {"actor": {"device_ids": [0]}, "placement": "colocated", "timeout_seconds": 300},
        "logging": {"progress": "off", "num_samples": 8, "sample_every": 1},
    }


def samples(run_dir: Path) -> dict[int, str]:
    """Each step's samples table (markdown) from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/text_summary")}


def table_rows(table: str) -> list[tuple[float, str]]:
    """(score, verdict) of each row of a samples table with a judge's column."""
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    return [(float(cells[2]), cells[3].strip().strip("`")) for cells in rows]


def trained(data: dict[str, Any], run_dir: Path) -> list[dict[str, float]]:
    result = train(load_config(data=data), run_dir)
    assert result.stopped_by is None and result.steps == STEPS, result
    return read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")


def test_a_judge_on_its_own_group_scores_as_the_colocated_one(tmp_path: Path, tiny_model_dir: Path,
                                                                smollm2_model: Path) -> None:
    data = judge_run(tiny_model_dir, smollm2_model)
    colocated = copy.deepcopy(data)
    colocated["data"]["record_rollouts"] = True
    near = trained(colocated, tmp_path / "colocated")
    apart = copy.deepcopy(data)
    apart["data"]["replay_rollouts"] = str(tmp_path / "colocated" / "rollouts")
    apart["resources"]["reward"] = {"device_ids": [1], "strategy": "hf"}
    far = trained(apart, tmp_path / "own_group")

    for a, b in zip(near, far, strict=True):  # the same responses, the same verdicts, the same scores
        assert a["critic/score/mean"] == pytest.approx(b["critic/score/mean"], abs=1e-6), a["step"]
        assert a["actor/grad_norm"] > 0 and b["actor/grad_norm"] > 0  # both train
    # The judge's own metrics: in the trainer's rows when colocated, in the reward group's when apart.
    served = read_jsonl_metrics(tmp_path / "own_group" / "tensorboard" / "reward_rank1" / "metrics.jsonl")
    for a, b in zip(near, served, strict=True):
        assert a["reward/judge/calls"] == b["reward/judge/calls"] > 0
        assert a["reward/judge/unparsable"] == b["reward/judge/unparsable"] == a["reward/errors"]
    near_tables, far_tables = samples(tmp_path / "colocated"), samples(tmp_path / "own_group")
    assert sorted(near_tables) == sorted(far_tables) == list(range(1, STEPS + 1))
    for step, table in near_tables.items():
        assert "judge's verdict" in table.splitlines()[0]
        rows = table_rows(table)
        assert rows == table_rows(far_tables[step])
        for score, verdict in rows:  # the score is the verdict's number; none in it: 0 (on_error: zero)
            number = parse_verdict(verdict, "number")
            assert score == pytest.approx(0.0 if number is None else number, abs=1e-3), (verdict, score)
    assert any(re.search(r"\d", verdict) for table in near_tables.values() for _, verdict in table_rows(table))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_a_vllm_judge_scores_what_it_says(tmp_path: Path, tiny_model_dir: Path, smollm2_model: Path) -> None:
    """`reward.judge.strategy: vllm`: the judge is a vLLM engine (CPU here), greedy like the HF one;
    the run trains, each row's score is its verdict's number, and the verdicts reach the samples."""
    data = judge_run(tiny_model_dir, smollm2_model)
    data["reward"]["judge"]["strategy"] = "vllm"
    rows = trained(data, tmp_path / "vllm_judge")
    assert all(r["reward/judge/calls"] > 0 and r["actor/grad_norm"] > 0 for r in rows)
    tables = samples(tmp_path / "vllm_judge")
    assert sorted(tables) == list(range(1, STEPS + 1))
    for table in tables.values():
        for score, verdict in table_rows(table):
            number = parse_verdict(verdict, "number")
            assert score == pytest.approx(0.0 if number is None else number, abs=1e-3), (verdict, score)
