"""DAPO's dynamic sampling when its rounds run out: a smaller step, a warning and a metric
(`on_exhausted: train`, the default), or verl's error (`on_exhausted: error`).

The smaller step must still lay out like a full one (data/layout.py): whole mini-batches,
or one mini-batch of all its rows, split evenly over the trainer ranks with whole groups
on each. The rounds' outcomes (a smaller step, verl's error, no informative group at all)
are driven by hand through `filtered_rollouts` with scripted rounds; one split run with two
FSDP actor ranks checks that both ranks train the same number of mini-batches on equal,
whole-group shares, and that the next step is laid out full again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import run_cli
from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.config import RunConfig, load_config
from verl_hpc.data import RolloutBatch
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.runtime.placement.one_process import LocalCollectives, trainer_seat
from verl_hpc.runtime.step.counters import Timer
from verl_hpc.runtime.step.dynamic_sampling import filtered_rollouts, informative_rows, trainable_groups

# Scores that differ within a group only for prompts 1+b= and 2+b= (2 in 5 of the quickstart's):
# a round of 8 groups holds ~3 informative ones, fewer than the 8 a step needs.
FEW_INFORMATIVE_REWARD = '''
def score(prompt, response, ground_truth, **_):
    if prompt.strip()[:1] in ("1", "2"):
        return float(len(response) % 2)
    return 1.0
'''


def test_trainable_groups_by_hand() -> None:
    # one rank, no mini-batch cut: every group found is trained
    assert trainable_groups(5, 4, 32, 1, [], True) == 5
    # mini-batch 16 rows (4 groups of 4): 9 groups -> 2 whole mini-batches (8 groups)
    assert trainable_groups(9, 4, 16, 1, [], True) == 8
    # fewer than one mini-batch, 2 ranks, whole groups: an even number of groups (3 -> 2), 1 -> none
    assert trainable_groups(3, 4, 16, 2, [], True) == 2
    assert trainable_groups(1, 4, 16, 2, [], True) == 0
    # no whole groups needed (a critic of 3 ranks beside 2 trainers): rows divisible by 2 and 3
    assert trainable_groups(5, 2, 64, 2, [3], False) == 3


def test_on_exhausted_error_is_verls_and_default_trains(tiny_model_dir: Path) -> None:
    data = quick_dict(tiny_model_dir)
    data["algorithm"]["name"] = "dapo"
    assert load_config(data=data).algorithm.filter_groups.on_exhausted == "train"
    data["algorithm"]["filter_groups"] = {"on_exhausted": "error"}
    assert load_config(data=data).algorithm.filter_groups.on_exhausted == "error"


def _run(tmp_path: Path, tiny_model_dir: Path, placement: str, on_exhausted: str) -> tuple[object, Path]:
    reward = tmp_path / "reward_under_test.py"
    reward.write_text(FEW_INFORMATIVE_REWARD)
    data = quick_dict(tiny_model_dir, steps=2)
    data["reward"] = {"function": f"{reward}:score"}
    data["algorithm"].update(name="dapo", mini_batch_size=16,
                             filter_groups={"max_num_gen_batches": 2, "on_exhausted": on_exhausted})
    data["algorithm"]["sampling"]["n"] = 4
    data["data"]["record_rollouts"] = True
    if placement == "split":
        data["resources"].update(placement="split", actor={"device_ids": [0, 1], "strategy": "fsdp"},
                                 rollout={"device_ids": [2]})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    return run_cli("train", str(path), "--run-dir", str(run)), run


class ScriptedRounds:
    """Stages whose generation rounds are given: 8 groups of 4 rows each, the informative ones listed."""

    def __init__(self, informative: list[list[int]]):
        self.informative, self.rounds, self.more = informative, [], []

    def rollouts(self, step: int, indices: list[int], policy_version: int, timer: Timer,
                 round_: int = 0) -> RolloutBatch:
        groups = [g for g in range(8) for _ in range(4)]
        scores = [float(r % 2) if g in self.informative[round_] else 1.0 for r, g in enumerate(groups)]
        batch = RolloutBatch.from_generation([[1]] * 32, [[2]] * 32, None, group_ids=groups,
                                             prompt_index=[10 * round_ + g for g in groups], ground_truth=["x"] * 32,
                                             policy_version=0, sample_index=[r % 4 for r in range(32)])
        self.rounds.append(batch.with_columns(score=np.array(scores, np.float32)))
        return self.rounds[-1]

    def next_round(self, more: bool) -> None:
        self.more.append(more)


class Prompts:
    def next_indices(self) -> list[int]:
        return list(range(8))


def _dapo(tiny_model_dir: Path, on_exhausted: str = "train") -> RunConfig:
    data = quick_dict(tiny_model_dir)
    data["algorithm"].update(name="dapo", mini_batch_size=16,
                             filter_groups={"max_num_gen_batches": 2, "on_exhausted": on_exhausted})
    data["algorithm"]["sampling"]["n"] = 4
    return load_config(data=data)


def _filter(cfg: RunConfig, stages: ScriptedRounds, seat: object) -> tuple[RolloutBatch | None, dict[str, float]]:
    return filtered_rollouts(cfg, stages, LocalCollectives(), seat, 1, list(range(8)), 0, Timer(),  # type: ignore[arg-type]
                             Prompts())  # type: ignore[arg-type]


def test_exhausted_rounds_train_the_groups_that_lay_out_and_the_seat_follows(tiny_model_dir: Path) -> None:
    """5 of the 8 groups a step needs after 2 rounds: the first 4 by (round, group) form one whole
    16-row mini-batch; the seat's rows and plan are that step's until the loop lays it out again."""
    cfg = _dapo(tiny_model_dir)
    seat = trainer_seat(cfg)
    stages = ScriptedRounds([[1, 4, 6], [2, 5]])
    batch, metrics = _filter(cfg, stages, seat)
    assert batch is not None and stages.more == [True, False]
    assert metrics == {"filter_groups/num_gen_batches": 2.0, "filter_groups/dropped_groups": 11.0,
                       "filter_groups/kept_groups": 4.0, "filter_groups/exhausted": 1.0}
    assert batch.column("prompt_index").to_pylist() == [p for p in (1, 4, 6, 12) for _ in range(4)]
    assert batch.column("group_id").to_pylist() == [g for g in range(4) for _ in range(4)]
    assert seat.rows == list(range(16)) and seat.plan.mini_batch_size == 16
    seat.lay_out(cfg, cfg.trainer.batch_size)
    assert seat.rows == list(range(32))


def test_on_exhausted_error_stops_the_step_as_verl_does(tiny_model_dir: Path) -> None:
    cfg = _dapo(tiny_model_dir, "error")
    with pytest.raises(RuntimeError, match="5 of 8 prompt groups .* after 2 generation rounds .*on_exhausted: train"):
        _filter(cfg, ScriptedRounds([[1, 4, 6], [2, 5]]), trainer_seat(cfg))


def test_no_informative_group_at_all_trains_the_last_round_as_generated(tiny_model_dir: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Every group scores all 1s: nothing to keep, so the step trains on its last round as generated
    (GRPO's zero advantages), says so, and the run goes on instead of stopping."""
    cfg = _dapo(tiny_model_dir)
    seat = trainer_seat(cfg)
    stages = ScriptedRounds([[], []])
    with caplog.at_level("WARNING"):
        batch, metrics = _filter(cfg, stages, seat)
    assert batch is stages.rounds[-1] and len(batch) == 32 and seat.rows == list(range(32))
    assert (metrics["filter_groups/exhausted"], metrics["filter_groups/kept_groups"]) == (1.0, 0.0)
    assert "training on the last round's 8 groups as generated" in caplog.text


@pytest.mark.slow
def test_exhausted_rounds_train_a_smaller_evenly_laid_out_step_on_two_ranks(tmp_path: Path,
                                                                             tiny_model_dir: Path) -> None:
    proc, run = _run(tmp_path, tiny_model_dir, "split", "train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(run / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["filter_groups/exhausted"] == 1.0 and r["filter_groups/kept_groups"] < 8 for r in rows)
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "training on" in logs and "on_exhausted: train" in logs
    ranks = 2
    for row in rows:
        step, kept = int(row["step"]), int(row["filter_groups/kept_groups"])
        files = sorted((run / "rollouts").glob(f"step_{step:08d}*"))
        parts = [RolloutBatch.from_ipc(f.read_bytes()) for f in files]
        assert len(parts) == ranks and sum(len(p) for p in parts) == kept * 4
        # 16-row mini-batches, or one of all rows: equal shares of whole groups on every rank
        assert kept % ranks == 0 and len({len(p) for p in parts}) == 1
        for part in parts:
            groups = part.column("group_id").to_pylist()
            assert all(groups.count(g) == 4 for g in set(groups))
            assert len(informative_rows(part)) == len(part)
