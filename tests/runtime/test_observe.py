"""The sink container, the attempt history and who speaks: the parts every sink relies on."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest

from verl_hpc.config import ConfigError, LoggingConfig, load_config
from verl_hpc.metrics import Emitter, MetricSinks, open_sinks, read_jsonl_metrics
from verl_hpc.metrics.history import (
    HISTORY_FILE,
    WALL_CLOCK,
    RunSummary,
    lost_seconds,
    read_history,
    record_end,
    record_start,
)
from verl_hpc.metrics.sink import finite


class Recording:
    def __init__(self, name: str, fail_on: str | None = None):
        self.name, self.fail_on = name, fail_on
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log_scalars(self, step: int, metrics: dict[str, float]) -> None:
        if self.fail_on == "log_scalars":
            raise OSError("No space left on device")
        self.rows.append((step, dict(metrics)))

    def log_text(self, step: int, tag: str, text: str) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None:
        self.closed = True


def test_a_failing_sink_is_dropped_after_one_warning_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    good, bad = Recording("good"), Recording("bad", fail_on="log_scalars")
    sinks = MetricSinks([bad, good])
    with caplog.at_level(logging.WARNING, logger="verl_hpc.metrics"):
        for step in (1, 2, 3):
            sinks.log_scalars(step, {"a": float(step), "nan": float("nan"), "none": None})  # type: ignore[dict-item]
    assert good.rows == [(1, {"a": 1.0}), (2, {"a": 2.0}), (3, {"a": 3.0})]  # non-finite values left out
    assert sinks.names() == ["good"] and bad.closed and "No space left" in sinks.failed["bad"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bad" in warnings[0]


def test_finite_keeps_numbers_only() -> None:
    assert finite({"a": 1, "b": float("inf"), "c": None, "d": 2.5}) == {"a": 1.0, "d": 2.5}


def test_a_sink_that_cannot_start_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    import verl_hpc.metrics.factory as factory

    real = factory._open

    def broken_wandb(name: str, *args: object):  # type: ignore[no-untyped-def]
        if name == "wandb":
            raise PermissionError("wandb dir is read-only")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(factory, "_open", broken_wandb)
    cfg = LoggingConfig.model_construct(**{**LoggingConfig().__dict__, "sinks": ["tensorboard", "wandb"]})
    with caplog.at_level(logging.WARNING, logger="verl_hpc.metrics"):
        sinks = open_sinks(cfg, Emitter(tmp_path, "r", "trainer", 0), tmp_path / "tb")
    assert sinks.names() == ["jsonl", "tensorboard"] and "read-only" in sinks.failed["wandb"]
    sinks.log_scalars(1, {"a": 1.0})
    sinks.close()
    assert read_jsonl_metrics(tmp_path / "tb" / "metrics.jsonl") == [{"step": 1, "a": 1.0}]
    assert sum("wandb" in r.getMessage() for r in caplog.records) == 1


def test_sinks_config_is_checked_before_anything_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert LoggingConfig().active_sinks() == ["tensorboard", "jsonl"]
    assert LoggingConfig(tensorboard=False).active_sinks() == ["jsonl"]
    assert LoggingConfig(sinks=["prometheus"]).active_sinks() == ["prometheus", "jsonl"]
    with pytest.raises(ConfigError, match=r"logging\.sinks: names jsonl twice"):
        load_config("configs/quickstart.yaml", ["logging.sinks=[jsonl,jsonl]"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging\.sinks: wandb needs the wandb package.*pip install wandb"):
        load_config("configs/quickstart.yaml", ["logging.sinks=[tensorboard,wandb]"])


def test_lost_time_is_the_gap_plus_the_steps_run_again() -> None:
    rows = [{"step": s, "timing_s/step": 2.0, WALL_CLOCK: 1000.0 + 2 * s} for s in range(1, 8)]
    # checkpoint at step 5: steps 6 and 7 run again (4 s); the last step ended at 1014, now is 1050
    assert lost_seconds(rows, 5, 1050.0) == pytest.approx(4.0 + 36.0)
    assert lost_seconds([], 0, 1050.0) == 0.0


def test_history_records_attempts_and_survives_a_torn_line(tmp_path: Path) -> None:
    first = record_start(tmp_path, 0, "17", 0, 0.0)
    record_end(tmp_path, first, 40, "SIGUSR1")
    second = record_start(tmp_path, 40, "17", 1, 12.5)
    with open(tmp_path / HISTORY_FILE, "a") as f:
        f.write('{"event": "end", "attem')  # killed mid-write
    history = read_history(tmp_path)
    assert [(a.number, a.resumed_at, a.restart_count, a.reason) for a in history] == [
        (1, 0, 0, "SIGUSR1"), (2, 40, 1, None)]
    assert history[0].last_step == 40 and history[1].ended is None and second.number == 2
    assert RunSummary.of(history) == RunSummary(attempts=2, requeues=1, lost_s=12.5)


@pytest.mark.slow
def test_every_role_group_logs_its_own_part_of_the_step(tmp_path: Path, tiny_model_dir: Path) -> None:
    """PPO with actor, critic, rollout and reward apart: each group's first rank writes its stage
    seconds and memory beside the trainer's; the attempt is recorded once, by the trainer."""
    from tests.conftest import run_cli

    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/ppo_roles_apart.yaml", "--run-dir", str(run_dir), f"model.path={tiny_model_dir}",
                   "trainer.total_steps=3", "trainer.save_hf_model=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    board = run_dir / "tensorboard"
    trainer = read_jsonl_metrics(board / "metrics.jsonl")
    assert [r["step"] for r in trainer] == [1, 2, 3] and all(r["memory/rss_gb"] > 0 for r in trainer)
    parts = {p.parent.name: read_jsonl_metrics(p) for p in board.glob("*_rank*/metrics.jsonl")}
    assert sorted(parts) == ["critic_rank1", "reward_rank3", "rollout_rank2"]
    expected = {"critic_rank1": ("timing_s/values", "timing_s/update"), "reward_rank3": ("timing_s/reward",),
                "rollout_rank2": ("timing_s/gen", "timing_s/send", "perf/rollout_transport_gbps")}
    for name, rows in parts.items():
        assert [r["step"] for r in rows] == [1, 2, 3], name
        for row in rows:
            assert all(row[key] > 0 for key in expected[name]) and row["memory/rss_gb"] > 0, (name, row)
            assert WALL_CLOCK in row
    assert all(r["perf/rollout_transport_bytes"] > 0 for r in parts["rollout_rank2"])
    events = [json.loads(line) for line in (run_dir / HISTORY_FILE).read_text().splitlines()]
    assert [(e["event"], e["attempt"]) for e in events] == [("start", 1), ("end", 1)]
    assert events[1]["last_step"] == 3 and events[1]["reason"] == "finished"
