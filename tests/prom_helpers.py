"""A real Prometheus and Pushgateway for the tests, from Debian's packages in /usr/bin.

Why real servers rather than parsing `/metrics` alone: what users depend on is that
Prometheus finds the run through the file_sd target file, scrapes every step's values
under the right labels, and that the Grafana dashboard's PromQL returns data. Only the
real server checks all three. `tools/test.sh` installs both packages; without them the
tests that need them skip with the command that installs them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from verl_hpc.runtime.process.env import free_port

PROMETHEUS = "/usr/bin/prometheus"
PUSHGATEWAY = "/usr/bin/prometheus-pushgateway"
INSTALL = "apt-get install --no-install-recommends prometheus prometheus-pushgateway"


def need(binary: str) -> None:
    if shutil.which(binary) is None:
        pytest.skip(f"{binary} is not installed ({INSTALL}; tools/test.sh does it as root)")


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - a local test server
        return response.read().decode()


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    """Poll `url` until it answers 200; fail with the server's log if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[0]} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            http_get(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} not ready after {timeout} s:\n{log.read_text()[-3000:]}")


@contextmanager
def serving(args: list[str], ready_url: str, log: Path) -> Iterator[None]:
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(ready_url, proc, log)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PROM_CONFIG = """global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: verl_hpc
    file_sd_configs:
      - files: ['{glob}']
        refresh_interval: 2s
"""

# A Pushgateway is scraped with honor_labels: the pushed job_id/run/role/rank labels stay as pushed.
GATEWAY_CONFIG = """global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: pushgateway
    honor_labels: true
    static_configs:
      - targets: ['{target}']
"""


class Prometheus:
    """A running Prometheus and its HTTP API."""

    def __init__(self, url: str):
        self.url = url

    def api(self, path: str, **params: str | float) -> list[dict]:
        query = urllib.parse.urlencode(params)
        body = json.loads(http_get(f"{self.url}/api/v1/{path}?{query}"))
        assert body["status"] == "success", body
        return body["data"]["result"] if isinstance(body["data"], dict) else body["data"]

    def query(self, expr: str, **params: str | float) -> list[dict]:
        return self.api("query", query=expr, **params)

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)


@contextmanager
def prometheus(state: Path, run_dir: Path | None = None, gateway: str | None = None) -> Iterator[Prometheus]:
    """Prometheus on a free port, scraping every 1 s the targets in `<run_dir>/prometheus/*.json`
    (file_sd allows a wildcard in the last path element only, hence one run directory), or the
    Pushgateway at `gateway`."""
    need(PROMETHEUS)
    state.mkdir(parents=True, exist_ok=True)
    config = GATEWAY_CONFIG.format(target=gateway.split("://", 1)[-1]) if gateway else \
        PROM_CONFIG.format(glob=Path(run_dir or ".") / 'prometheus' / '*.json')
    (state / "prometheus.yml").write_text(config)
    address = f"127.0.0.1:{free_port()}"
    args = [PROMETHEUS, f"--config.file={state / 'prometheus.yml'}", f"--storage.tsdb.path={state / 'data'}",
            f"--web.listen-address={address}", "--log.level=warn"]
    with serving(args, f"http://{address}/-/ready", state / "prometheus.log"):
        yield Prometheus(f"http://{address}")


@contextmanager
def pushgateway(state: Path) -> Iterator[str]:
    """A Pushgateway on a free port (no persistence); yields its base URL."""
    need(PUSHGATEWAY)
    state.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    args = [PUSHGATEWAY, f"--web.listen-address={address}", "--log.level=warn"]
    with serving(args, f"http://{address}/-/ready", state / "pushgateway.log"):
        yield f"http://{address}"


@contextmanager
def pushgateway_if_installed(state: Path) -> Iterator[str | None]:
    """A Pushgateway, or None where it is not installed: for tests whose main subject is another."""
    if shutil.which(PUSHGATEWAY) is None:
        yield None
        return
    with pushgateway(state) as url:
        yield url


def pushed(url: str, name: str, **labels: str) -> float | None:
    """The value of `name` whose labels include `labels` in the Pushgateway's exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http_get(f"{url}/metrics")):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return None
