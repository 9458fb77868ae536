"""Prometheus exposition of a run: a `/metrics` server, a Pushgateway push, a node_exporter textfile.

Why three modes: a login node or a workstation can be scraped (serve, found by Prometheus
through the file_sd target file this writes under the run directory); a compute node behind
a firewall usually cannot, so it pushes to a Pushgateway; and a site that already runs
node_exporter on every node collects a textfile with no new port at all. All three expose
the same registry, which holds one snapshot: the last step's samples, replaced as a whole
under a lock so that a scrape never mixes two steps.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, push_to_gateway, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from verl_hpc.metrics.prometheus_names import Sample, step_samples, summary_samples
from verl_hpc.metrics.sink import Emitter
from verl_hpc.utils.fs import write_atomic

if TYPE_CHECKING:  # metrics is the lowest layer: it reads the config's objects, never imports them
    from wsgiref.simple_server import WSGIServer

    from verl_hpc.config.observability import PrometheusConfig
    from verl_hpc.metrics.history import RunSummary

log = logging.getLogger("verl_hpc.metrics")
PUSH_JOB = "verl_hpc"
PUSH_TIMEOUT_S = 5.0  # a slow gateway delays a step by this much at most, then the sink is dropped
WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


class SnapshotCollector:
    """Yields the families of the last snapshot; the registry calls `collect` on every scrape."""

    def __init__(self, fixed: list[Sample]):
        self._lock = threading.Lock()
        self._fixed = fixed      # the run summary's counters: known at start, unchanged by steps
        self._samples: list[Sample] = []

    def replace(self, samples: list[Sample]) -> None:
        """The new step's samples, plus the last value of any series this step did not report.

        Why carry them: a checkpoint save or a validation happens on one step in many, and a
        gauge that vanished on the next step would be seen only by a scrape that happened to
        land inside that one step; as a gauge that keeps its last value it reads "the last
        save took 12 s", as `Gauge.set` would.
        """
        fresh = {(s.name, s.labels) for s in samples}
        with self._lock:
            carried = [s for s in self._samples if (s.name, s.labels) not in fresh]
            self._samples = [*samples, *carried]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            samples = [*self._samples, *self._fixed]
        yield from families(samples)


def families(samples: list[Sample]) -> list[Metric]:
    """Group samples by name into typed families (prometheus_client adds `_total` to counters)."""
    grouped: dict[str, Metric] = {}
    for sample in samples:
        names = [k for k, _ in sample.labels]
        family = grouped.get(sample.name)
        if family is None:
            if sample.kind == "counter":
                family = CounterMetricFamily(sample.name.removesuffix("_total"), sample.help, labels=names)
            else:
                family = GaugeMetricFamily(sample.name, sample.help, labels=names)
            grouped[sample.name] = family
        family.add_metric([v for _, v in sample.labels], sample.value)
    return list(grouped.values())


def advertised_host(host: str) -> str:
    """The address Prometheus should scrape: this host's name when it resolves, else loopback."""
    if host not in WILDCARD_HOSTS:
        return host
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return "127.0.0.1"
    return name


class PrometheusSink:
    """One emitting process's exposition; any combination of serve, push and textfile."""

    name = "prometheus"

    def __init__(self, cfg: PrometheusConfig, emitter: Emitter, summary: RunSummary | None):
        self.cfg, self.emitter = cfg, emitter
        self.labels = {"job_id": emitter.job_id, "run": emitter.run_name, "role": emitter.role,
                       "rank": str(emitter.rank)}
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector(summary_samples(summary, self.labels))
        self.registry.register(self.collector)  # type: ignore[arg-type]
        self.server: WSGIServer | None = None
        self.thread: threading.Thread | None = None
        self.target_files: list[Path] = []
        self.textfile: Path | None = None
        if cfg.textfile_dir:
            self.textfile = Path(cfg.textfile_dir).expanduser() / f"verl_hpc_{emitter.job_id}_{emitter.tag}.prom"
            self.textfile.parent.mkdir(parents=True, exist_ok=True)
        if cfg.serve:
            try:
                self._serve()
            except BaseException:
                self.close()  # the port is released even though the factory leaves this sink out
                raise

    def _serve(self) -> None:
        """Start `/metrics`, then publish where it is: a file_sd target under the run directory."""
        self.server, self.thread = start_http_server(self.cfg.port, self.cfg.host, self.registry)
        port = self.server.server_port
        address = f"{advertised_host(self.cfg.host)}:{port}"
        self.target_files = [self.emitter.run_dir / "prometheus" / f"{self.emitter.tag}.json"]
        if self.cfg.sd_dir:  # file_sd globs a file name only: one shared folder finds every run
            self.target_files.append(Path(self.cfg.sd_dir).expanduser()
                                     / f"{self.emitter.run_name}_{self.emitter.tag}.json")
        target = [{"targets": [address], "labels": {"run_dir": str(self.emitter.run_dir)}}]
        for path in self.target_files:
            write_atomic(path, json.dumps(target, indent=1) + "\n")
        log.info("prometheus: %s serves http://%s/metrics (target file %s)", self.emitter.tag, address,
                 ", ".join(map(str, self.target_files)))

    def log_scalars(self, step: int, metrics: Mapping[str, float]) -> None:
        self.collector.replace(step_samples(step, metrics, self.labels))
        if self.textfile is not None:
            write_to_textfile(str(self.textfile), self.registry)
        if self.cfg.push_url:
            push_to_gateway(self.cfg.push_url, job=PUSH_JOB, registry=self.registry, grouping_key=self.labels,
                            timeout=PUSH_TIMEOUT_S)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Prometheus stores numbers only; samples of text go to the other sinks."""

    def flush(self) -> None:
        """Every mode is written in `log_scalars`; nothing is buffered."""

    def close(self) -> None:
        """Stop serving and withdraw the target (it is gone); textfiles and pushed groups keep the last step."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.thread is not None:
            self.thread.join(timeout=5)
            self.thread = None
        for path in self.target_files:
            path.unlink(missing_ok=True)
        self.target_files = []
