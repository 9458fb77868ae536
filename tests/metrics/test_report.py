"""`verl-hpc report`: panels, restart markers, summary, PNG/HTML, on a synthetic and a real requeued run."""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.metrics.report import load_run, report_panels, summary_text
from verl_hpc.metrics.report_render import figure_size, write_report

T0 = 1_800_000_000.0
EMPTY_IN_FIXTURE = {"Checkpoint save"}  # the fixture logs no timing_s/save_checkpoint: drawn as "no data"


def _row(step: int, clock: float) -> dict[str, float]:
    row = {"step": step, "critic/score/mean": step / 20, "actor/kl_loss": 0.01 * step, "actor/entropy": 4 - step / 10,
           "response_length/mean": 3.5, "timing_s/gen": 0.6, "timing_s/update_actor": 0.3, "timing_s/step": 1.0,
           "perf/throughput": 400.0 + step, "memory/rss_gb": 0.4 + step / 1000, "memory/peak_rss_gb": 0.5,
           "perf/weight_sync_gbps": 1.5, "perf/wall_clock": clock}
    if step % 5 == 0:
        row["val-core/arithmetic/reward/mean@1"] = step / 25
    return row


def _write(path: Path, lines: list[dict], torn: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + torn)


@pytest.fixture
def requeued_run(tmp_path: Path) -> Path:
    """Attempt 1 ran steps 1-8 and was preempted; attempt 2 resumed after step 6 (rows 7-8 rewritten)
    and is still running: its last line is torn mid-write."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  total_steps: 20\n")
    _write(run / "attempts.jsonl", [
        {"event": "start", "attempt": 1, "time": T0, "resumed_at": 0, "job_id": "77", "restart_count": 0,
         "lost_s": 0.0},
        {"event": "end", "attempt": 1, "time": T0 + 9.5, "last_step": 8, "reason": "SIGTERM"},
        {"event": "start", "attempt": 2, "time": T0 + 60, "resumed_at": 6, "job_id": "77", "restart_count": 1,
         "lost_s": 52.5}])
    rows = [_row(s, T0 + s + 0.5) for s in range(1, 7)] + [_row(s, T0 + 60 + s - 6) for s in range(7, 13)]
    _write(run / "tensorboard" / "metrics.jsonl", rows, torn='{"step": 13, "critic/sco')
    rollout = [{"step": s, "timing_s/gen": 0.5, "perf/weight_sync_gbps": 2.0, "perf/rollout_transport_gbps": 0.8,
                "memory/rss_gb": 0.3} for s in range(1, 13)]
    _write(run / "tensorboard" / "rollout_rank0" / "metrics.jsonl", rollout)
    return run


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (the signature first)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_panels_have_data_and_restart_markers(requeued_run: Path) -> None:
    panels = report_panels(requeued_run)
    assert {p.title for p in panels if not p.has_data} == EMPTY_IN_FIXTURE
    run = load_run(requeued_run)
    assert run.unit == ("seconds", 1.0) and run.t0 == T0
    for panel in panels:  # one restart, at attempt 2's start, on every panel (also the empty one)
        assert [(m.x, m.label) for m in panel.markers] == [(60.0, "restart 1 (job 77, from step 6)")]
    score = next(p for p in panels if p.title.startswith("Score"))
    train, val = score.series
    assert len(train.y) == 12 and train.x[0] == 1.5 and train.x[-1] == 66.0  # the torn line is skipped
    assert val.style == "points" and val.y == [0.2, 0.4]
    bandwidth = next(p for p in panels if p.title.startswith("Weight sync"))
    by_label = {s.label: s for s in bandwidth.series}
    transport = by_label["rollout transport (rollout_rank0)"]  # no wall clock there: placed at the trainer's step
    assert transport.y == [0.8] * 12 and transport.x == by_label["weight sync (trainer)"].x
    stages = next(p for p in panels if p.title.startswith("Stage"))
    assert sorted(s.label for s in stages.series) == ["gen", "update_actor"]  # timing_s/step is the total


def test_summary_numbers(requeued_run: Path) -> None:
    text = summary_text(load_run(requeued_run))
    assert "steps:        12 / 20" in text
    assert "tokens/s:     406.5 (median)" in text
    assert "score:        0.6000 (last)" in text
    assert "val-core/arithmetic/reward/mean@1 last 0.4000, best 0.4000" in text
    assert "attempts:     2 (1 requeues/restarts); last: running (or killed)" in text
    assert "lost time:    0m52s" in text and "wall time:    1m06s" in text


def test_png_and_html(requeued_run: Path, tmp_path: Path) -> None:
    summary, png, page = write_report(requeued_run, tmp_path / "out")
    assert png == tmp_path / "out" / "report.png" and png.stat().st_size > 30_000
    assert png_size(png) == figure_size(len(report_panels(requeued_run)))
    text = page.read_text()
    assert base64.b64encode(png.read_bytes()).decode() in text and "lost time:    0m52s" in text


def test_step_axis_without_wall_clock(requeued_run: Path) -> None:
    """Rows of an older revision have no perf/wall_clock: x is the step, the restart sits after its resume step."""
    path = requeued_run / "tensorboard" / "metrics.jsonl"
    rows = [{k: v for k, v in r.items() if k != "perf/wall_clock"} for r in read_jsonl_metrics(path)]
    _write(path, rows)
    panels = report_panels(requeued_run)
    assert panels[0].series[0].x == [float(s) for s in range(1, 13)]
    assert [m.x for m in panels[0].markers] == [6.5]


def test_cli_report_and_bad_dir(requeued_run: Path, tmp_path: Path) -> None:
    proc = run_cli("report", str(requeued_run))
    assert proc.returncode == 0, proc.stderr
    assert "attempts:     2 (1 requeues/restarts)" in proc.stdout
    assert f"png:          {requeued_run / 'report' / 'report.png'}" in proc.stdout
    assert (requeued_run / "report" / "report.html").exists()
    bad = run_cli("report", str(tmp_path / "nothing"))
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and str(tmp_path / "nothing") in lines[0] and "hint" in lines[0]


def _train(run_dir: Path, model_dir: Path) -> subprocess.Popen:
    args = ["train", str(REPO / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir), f"model.path={model_dir}",
            "trainer.total_steps=6", "trainer.batch_size=32", "logging.progress=off", "trainer.save_hf_model=false",
            "checkpoint.interval_steps=1"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-m", "verl_hpc", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_report_of_a_real_preempted_and_resumed_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A quickstart run stopped by SIGTERM after step 3 (as Slurm preempts) and started again with the
    same command: every core panel has data and the restart is marked once."""
    run_dir = tmp_path / "run"
    first = _train(run_dir, tiny_model_dir)
    metrics = run_dir / "tensorboard" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(read_jsonl_metrics(metrics)) >= 3) and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()[0]
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 128 + signal.SIGTERM, out
    second = _train(run_dir, tiny_model_dir)
    assert second.wait(timeout=300) == 0, second.communicate()[0]
    panels = report_panels(run_dir)
    assert {p.title for p in panels if not p.has_data} <= {"Weight sync and rollout transport"}
    assert all(len(p.markers) == 1 and p.markers[0].label.startswith("restart 1") for p in panels)
    proc = run_cli("report", str(run_dir), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    assert "steps:        6 / 6" in proc.stdout and "attempts:     2 (1 requeues/restarts); last: finished" in proc.stdout
    assert png_size(tmp_path / "report" / "report.png") == figure_size(len(panels))
