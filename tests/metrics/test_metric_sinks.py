"""wandb and MLflow sinks, read back with their own readers: directly, across a resume, and in a run.

Why their own readers: a sink that "logs" is only useful if the tool shows the numbers,
so MLflow is read with `MlflowClient.get_metric_history` and wandb's offline file with
wandb's own protobuf (tests/wandb_records.py), the file `wandb sync` uploads.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests import wandb_records
from verl_hpc.config.observability import MlflowConfig, WandbConfig
from verl_hpc.metrics.mlflow_sink import MlflowSink, mlflow_key
from verl_hpc.metrics.sink import Emitter, MetricSinks
from verl_hpc.metrics.wandb_sink import WandbSink

# find_spec, not importorskip: importing both costs seconds that only the tests which use them should pay
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("wandb", "mlflow")),
                                reason="pip install -e .[test] (wandb, mlflow-skinny)")

KEYS = ("actor/pg_loss", "critic/score/mean", "perf/throughput")


def _values(step: int, attempt: int) -> dict[str, float]:
    """Distinct per step and attempt, so a resumed step shows which attempt wrote it."""
    return {key: step * 0.25 + i + attempt * 100 for i, key in enumerate(KEYS)}


def _drive(sink_of: object, steps: list[int], attempt: int) -> None:
    sinks = MetricSinks([sink_of()])  # type: ignore[operator]
    for step in steps:
        sinks.log_scalars(step, _values(step, attempt))
    sinks.log_text(steps[-1], "samples", f"attempt {attempt}")
    sinks.close()
    assert not sinks.failed, sinks.failed


@pytest.fixture
def emitter(tmp_path: Path) -> Emitter:
    return Emitter(tmp_path / "run", "unit", "trainer", 0, job_id="42")


def test_mlflow_keys_are_kept_or_made_acceptable() -> None:
    assert mlflow_key("actor/pg_loss") == "actor/pg_loss"
    assert mlflow_key("timing/wait_weights-sync 2.x") == "timing/wait_weights-sync 2.x"
    assert mlflow_key("a//b/") == "a/b" and mlflow_key("/x/./y") == "x/y" and mlflow_key("..") == "_"
    assert mlflow_key("gpu:0/mem%") == "gpu_0/mem_" and len(mlflow_key("k" * 400)) == 250


def test_wandb_run_id_is_stable_per_run_dir_and_emitter(tmp_path: Path) -> None:
    a = Emitter(tmp_path / "run", "x", "trainer", 0)
    same_dir = Emitter(tmp_path / "run" / ".." / "run", "other-name", "trainer", 0)
    assert a.key == same_dir.key
    assert a.key != Emitter(tmp_path / "run", "x", "rollout", 1).key
    assert a.key != Emitter(tmp_path / "run2", "x", "trainer", 0).key


def test_wandb_offline_logs_steps_and_a_resume_appends_to_the_same_run(emitter: Emitter) -> None:
    cfg = WandbConfig()
    _drive(lambda: WandbSink(cfg, emitter), [1, 2, 3], attempt=1)
    # resumed from step 2's checkpoint: step 3 is logged again
    _drive(lambda: WandbSink(cfg, emitter, purge_step=3), [3, 4], attempt=2)
    run_id = emitter.key
    files = wandb_records.offline_runs(emitter.run_dir, run_id)
    assert len(files) == 2, "one offline directory per attempt, both for the same run id"
    for path in files:
        run = wandb_records.run_record(path)
        assert run.run_id == run_id and run.display_name == "unit-trainer_rank0"
    first, second = (wandb_records.history(p) for p in files)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [3, 4]
    assert first[3]["actor/pg_loss"] == _values(3, 1)["actor/pg_loss"], "first file unchanged"
    merged = wandb_records.merged_history(emitter.run_dir, run_id)
    expected = {1: _values(1, 1), 2: _values(2, 1), 3: _values(3, 2), 4: _values(4, 2)}
    assert {s: {k: merged[s][k] for k in KEYS} for s in merged} == expected
    assert any(k.startswith("samples_table/") for k in second[4]), "the sample table joins the step's row"


def test_mlflow_logs_steps_and_a_resume_continues_the_same_run(emitter: Emitter) -> None:
    from mlflow.tracking import MlflowClient

    cfg = MlflowConfig(experiment="unit")
    _drive(lambda: MlflowSink(cfg, emitter), [1, 2, 3], attempt=1)
    other = Emitter(emitter.run_dir, "unit", "rollout", 1)  # a second emitter, same store: its own run
    _drive(lambda: MlflowSink(cfg, other), [1], attempt=9)
    sink = MlflowSink(cfg, emitter)
    run_id = sink.run_id
    _drive(lambda: sink, [3, 4], attempt=2)
    client = MlflowClient((emitter.run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("unit")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.tags["verl_hpc.emitter"] for r in runs) == ["rollout_rank1", "trainer_rank0"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "unit-trainer_rank0"
    assert run.data.tags["job_id"] == "42" and run.data.tags["role"] == "trainer"
    for key in KEYS:
        points = sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))
        assert [p[0] for p in points] == [1, 2, 3, 3, 4], "MLflow keeps both attempts' step 3"
        by_step = {step: value for step, _, value in points}  # the later timestamp last: the resumed value
        assert by_step[4] == _values(4, 2)[key] and by_step[1] == _values(1, 1)[key]
        assert {p[2] for p in points if p[0] == 3} == {_values(3, 1)[key], _values(3, 2)[key]}
    artifacts = [a.path for a in client.list_artifacts(run_id, "samples")]
    assert artifacts == ["samples/step_0000003.txt", "samples/step_0000004.txt"]


def assert_same_scalars(rows: list[dict[str, float]], other: dict[int, dict[str, float]], what: str) -> None:
    """Every step and key of metrics.jsonl, with its value to float32 rounding (TensorBoard's)."""
    assert sorted(other) == [int(r["step"]) for r in rows], what
    for row in rows:
        step = int(row["step"])
        for key, value in row.items():
            if key == "step":
                continue
            assert key in other[step], f"{what}: step {step} has no {key}"
            assert math.isclose(other[step][key], value, rel_tol=1e-6, abs_tol=1e-30), (what, step, key)


def _tensorboard(log_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


def _mlflow(run_dir: Path) -> dict[int, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("verl-hpc").experiment_id])
    out: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            out.setdefault(metric.step, {})[key] = metric.value
    return out


SHORT = ["trainer.batch_size=16", "logging.progress=off", "logging.sample_every=2"]


def _train(tiny_model_dir: Path, run_dir: Path, steps: int, extra: list[str]) -> object:
    from verl_hpc import HybridTrainer

    overrides = [f"model.path={tiny_model_dir}", f"trainer.total_steps={steps}", *SHORT, *extra]
    return HybridTrainer(config="configs/quickstart.yaml", overrides=overrides, run_dir=run_dir).train()


def test_a_run_logs_the_same_scalars_to_every_sink(tmp_path: Path, tiny_model_dir: Path) -> None:
    from verl_hpc.metrics import read_jsonl_metrics

    run_dir = tmp_path / "run"
    result = _train(tiny_model_dir, run_dir, 3, ["logging.sinks=[tensorboard,jsonl,wandb,mlflow]"])
    assert result.steps == 3  # type: ignore[attr-defined]
    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert [int(r["step"]) for r in rows][-3:] == [1, 2, 3] and len(rows[-1]) > 5
    assert_same_scalars(rows, _tensorboard(run_dir / "tensorboard"), "tensorboard")
    assert_same_scalars(rows, _mlflow(run_dir), "mlflow")
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert_same_scalars(rows, wandb_records.history(wandb_file), "wandb")


def test_a_broken_sink_costs_one_warning_and_not_the_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    """wandb's dir under a regular file cannot be created, even as root (chmod would not stop root)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    run_dir = tmp_path / "run"
    result = _train(tiny_model_dir, run_dir, 2, ["logging.sinks=[jsonl,wandb,mlflow]",
                                                 f"logging.wandb.dir={blocker / 'wandb'}"])
    assert result.steps == 2  # type: ignore[attr-defined]
    lines = [json.loads(line) for line in (run_dir / "logs" / "trainer_rank0.log").read_text().splitlines()]
    warnings = [e["msg"] for e in lines if e["level"] in ("warning", "error") and "sink" in e["msg"]]
    assert len(warnings) == 1 and "sink wandb" in warnings[0], warnings
    assert sorted(_mlflow(run_dir)) == [1, 2], "the other sinks go on"
    assert not (run_dir / "wandb").exists() and not list((run_dir / "tensorboard").glob("events.*"))
