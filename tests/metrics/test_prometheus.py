"""The Prometheus sink: the name mapping, its three modes, and a real Prometheus scraping a split run.

The end-to-end test is the contract users rely on: Prometheus finds the run through the file_sd
target file, every scraped value equals the step's row in metrics.jsonl, and every query of the
Grafana dashboard in tools/grafana returns data for a CPU run.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.prom_helpers import http_get, prometheus, pushgateway
from verl_hpc.config.observability import PrometheusConfig
from verl_hpc.metrics.history import RunSummary
from verl_hpc.metrics.prometheus import PrometheusSink
from verl_hpc.metrics.prometheus_names import sanitize, step_samples, summary_samples
from verl_hpc.metrics.sink import Emitter

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "tools" / "grafana" / "verl-hpc.json"
LABELS = {"job_id": "77", "run": "r1", "role": "trainer", "rank": "0"}
BASE = tuple(LABELS.items())
STEP = {"timing_s/gen": 1.5, "memory/rss_gb": 0.5, "memory/max_allocated_gb": 2.0, "perf/throughput": 900.0,
        "perf/weight_sync_gbps": 0.25, "perf/weight_sync_bytes": 1000.0, "perf/rollout_transport_gbps": 1.0,
        "critic/score/mean": 0.75, "val-core/arith/acc@1": 0.5, "perf/wall_clock": 1.7e9, "step": 3.0,
        "perf/checkpoint_save_s": 2.5}


def samples_by_key(step: int, metrics: dict) -> dict[tuple, tuple[str, float]]:
    return {(s.name, s.labels): (s.kind, s.value) for s in step_samples(step, metrics, LABELS)}


def test_a_steps_keys_map_to_prometheus_families_in_base_units() -> None:
    got = samples_by_key(3, STEP)
    assert got == {
        ("verl_hpc_step", BASE): ("gauge", 3.0),
        ("verl_hpc_steps_total", BASE): ("counter", 3.0),
        ("verl_hpc_step_seconds", (*BASE, ("stage", "gen"))): ("gauge", 1.5),
        ("verl_hpc_memory_bytes", (*BASE, ("kind", "rss"))): ("gauge", 0.5 * 2**30),
        ("verl_hpc_memory_bytes", (*BASE, ("kind", "max_allocated"))): ("gauge", 2.0 * 2**30),
        ("verl_hpc_throughput_tokens_per_second", BASE): ("gauge", 900.0),
        ("verl_hpc_transfer_bytes_per_second", (*BASE, ("path", "weight_sync"))): ("gauge", 0.25e9),
        ("verl_hpc_transfer_bytes_per_second", (*BASE, ("path", "rollout_transport"))): ("gauge", 1e9),
        ("verl_hpc_transfer_bytes", (*BASE, ("path", "weight_sync"))): ("gauge", 1000.0),
        ("verl_hpc_critic_score_mean", BASE): ("gauge", 0.75),
        ("verl_hpc_val_core_arith_acc_1", BASE): ("gauge", 0.5),
        ("verl_hpc_checkpoint_save_seconds", BASE): ("gauge", 2.5),
    }  # perf/wall_clock (a timestamp) and a `step` key (it has its own families) are not exported


def test_plain_keys_never_shadow_the_typed_families() -> None:
    assert sanitize("a//b-c.d@e") == "verl_hpc_a_b_c_d_e"
    got = samples_by_key(1, {"steps_total": 5.0, "step_seconds": 1.0, "steps": 2.0})
    assert set(got) == {("verl_hpc_step", BASE), ("verl_hpc_steps_total", BASE)}


def test_the_run_summary_becomes_counters() -> None:
    got = {s.name: (s.kind, s.value) for s in summary_samples(RunSummary(3, 2, 41.5), LABELS)}
    assert got == {"verl_hpc_requeues_total": ("counter", 2.0), "verl_hpc_attempts_total": ("counter", 3.0),
                   "verl_hpc_preemption_lost_seconds_total": ("counter", 41.5)}
    assert summary_samples(None, LABELS) == []


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Exposition text as {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def emitter(tmp_path: Path) -> Emitter:
    return Emitter(tmp_path / "run", "r1", "trainer", 0, "77")


def test_textfile_mode_writes_the_last_step_for_node_exporter(tmp_path: Path) -> None:
    cfg = PrometheusConfig(serve=False, textfile_dir=str(tmp_path / "textfiles"))
    sink = PrometheusSink(cfg, emitter(tmp_path), RunSummary(2, 1, 10.0))
    sink.log_scalars(1, {"timing_s/gen": 1.0, "timing_s/save_checkpoint": 4.0})
    sink.log_scalars(2, {"timing_s/gen": 2.0, "critic/score/mean": 0.5})
    sink.close()
    path = tmp_path / "textfiles" / "verl_hpc_77_trainer_rank0.prom"
    got = parse(path.read_text())  # closing keeps the file: node_exporter reports the last step
    labels = tuple(sorted(LABELS.items()))
    assert got[("verl_hpc_step", labels)] == 2.0
    assert got[("verl_hpc_steps_total", labels)] == 2.0
    assert got[("verl_hpc_step_seconds", tuple(sorted({**LABELS, "stage": "gen"}.items())))] == 2.0
    # a stage the last step did not run keeps its last value (the last checkpoint save took 4 s)
    assert got[("verl_hpc_step_seconds", tuple(sorted({**LABELS, "stage": "save_checkpoint"}.items())))] == 4.0
    assert got[("verl_hpc_critic_score_mean", labels)] == 0.5
    assert got[("verl_hpc_requeues_total", labels)] == 1.0
    assert got[("verl_hpc_preemption_lost_seconds_total", labels)] == 10.0
    assert not (tmp_path / "run" / "prometheus").exists()  # not serving: no scrape target


def test_serve_mode_publishes_a_file_sd_target_and_withdraws_it(tmp_path: Path) -> None:
    shared = tmp_path / "sd"  # logging.prometheus.sd_dir: one folder for every run's targets
    sink = PrometheusSink(PrometheusConfig(host="127.0.0.1", port=0, sd_dir=str(shared)), emitter(tmp_path), None)
    try:
        target_file = tmp_path / "run" / "prometheus" / "trainer_rank0.json"
        [group] = json.loads(target_file.read_text())
        assert sorted(p.name for p in shared.iterdir()) == [f"{emitter(tmp_path).run_name}_trainer_rank0.json"]
        assert json.loads(next(shared.iterdir()).read_text()) == [group]
        assert group["targets"] == [f"127.0.0.1:{sink.server.server_port}"]
        sink.log_scalars(7, {"actor/entropy": 3.25})
        got = parse(http_get(group["targets"][0].join(["http://", "/metrics"])))
        assert got[("verl_hpc_actor_entropy", tuple(sorted(LABELS.items())))] == 3.25
        assert got[("verl_hpc_step", tuple(sorted(LABELS.items())))] == 7.0
    finally:
        sink.close()
    assert not target_file.exists() and list(shared.iterdir()) == []


def test_a_taken_port_fails_the_sink_without_leaving_a_target(tmp_path: Path) -> None:
    """The factory leaves a sink out when its constructor raises; no target may point at someone else."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with taken, pytest.raises(OSError):
        PrometheusSink(PrometheusConfig(host="127.0.0.1", port=taken.getsockname()[1]), emitter(tmp_path), None)
    assert list((tmp_path / "run").glob("prometheus/*.json")) == []


def test_push_mode_groups_by_run_role_rank_and_job(tmp_path: Path) -> None:
    with pushgateway(tmp_path / "pushgateway") as url:
        sink = PrometheusSink(PrometheusConfig(serve=False, push_url=url), emitter(tmp_path), RunSummary(1, 0, 0.0))
        sink.log_scalars(4, {"actor/kl_loss": 0.125})
        sink.log_scalars(5, {"actor/kl_loss": 0.25})
        sink.close()
        got = parse(http_get(f"{url}/metrics"))
    labels = tuple(sorted({**LABELS, "job": "verl_hpc", "instance": ""}.items()))
    assert got[("verl_hpc_step", labels)] == 5.0
    assert got[("verl_hpc_actor_kl_loss", labels)] == 0.25
    assert got[("verl_hpc_attempts_total", labels)] == 1.0


def scraped(prom, expr: str, at: float) -> dict[float, float]:
    """A raw range vector's samples as {scrape time: value}: raw samples outlive the target."""
    [series] = prom.query(f"{expr}[10m]", time=at)
    return {float(ts): float(value) for ts, value in series["values"]}


def pairs_match_rows(prom, role: str, metric: str, key: str, rows: dict[int, dict], at: float, scale: float = 1.0):
    """Every scrape's (step, value) equals metrics.jsonl's row for that step; returns the steps seen."""
    steps = scraped(prom, f'verl_hpc_step{{role="{role}"}}', at)
    values = scraped(prom, metric.replace("}", f',role="{role}"}}') if "}" in metric else f'{metric}{{role="{role}"}}',
                     at)
    common = sorted(set(steps) & set(values))
    assert common, (steps, values)
    for ts in common:
        step = int(steps[ts])
        assert values[ts] == rows[step][key] * scale, (ts, step, values[ts], rows[step][key])
    return {int(steps[ts]) for ts in common}


def read_rows(path: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


@pytest.mark.slow
def test_a_real_prometheus_scrapes_a_split_run_and_the_dashboard_has_data(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    from tests.conftest import run_cli

    run_dir = tmp_path / "runs" / "split"
    with prometheus(tmp_path / "prometheus", run_dir) as prom:
        start = time.time()
        # 150 steps: the run must outlast Prometheus finding its file_sd target (2 s refresh) and
        # then scraping twice (1 s interval); 25 steps took 6 s once the intake went direct, and
        # 60 steps were scraped at one step only on an idle machine (4 Dec).
        done = run_cli("train", "configs/quickstart_split.yaml", "--run-dir", str(run_dir),
                       f"model.path={tiny_model_dir}", "logging.sinks=[jsonl,prometheus]", "trainer.total_steps=150",
                       "checkpoint.interval_steps=25", "logging.progress=off")
        end = time.time() + 2
        assert done.returncode == 0, done.stderr[-3000:]
        trainer = read_rows(run_dir / "tensorboard" / "metrics.jsonl")
        rollout = read_rows(run_dir / "tensorboard" / "rollout_rank2" / "metrics.jsonl")
        seen = pairs_match_rows(prom, "trainer", "verl_hpc_step_seconds{stage=\"update_actor\"}",
                                "timing_s/update_actor", trainer, end)
        pairs_match_rows(prom, "trainer", "verl_hpc_critic_score_mean", "critic/score/mean", trainer, end)
        pairs_match_rows(prom, "trainer", "verl_hpc_memory_bytes{kind=\"rss\"}", "memory/rss_gb", trainer, end,
                         scale=2.0**30)
        pairs_match_rows(prom, "rollout", "verl_hpc_step_seconds{stage=\"gen\"}", "timing_s/gen", rollout, end)
        assert len(seen) >= 2, seen  # several steps were scraped, not one
        [labelled] = prom.query('verl_hpc_requeues_total{role="trainer"}[10m]', time=end)
        assert {k: labelled["metric"][k] for k in ("job_id", "run", "role", "rank")} == {
            "job_id": "local", "run": "split", "role": "trainer", "rank": "0"}
        for expr in dashboard_exprs():
            query = expr.replace("$run", "split").replace("$__rate_interval", "1m").replace("$__interval", "1m")
            assert prom.query_range(query, start, end), f"no data for the dashboard's {query}"
    assert list((run_dir / "prometheus").glob("*.json")) == []  # every process withdrew its target
