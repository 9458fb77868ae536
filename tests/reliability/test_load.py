"""Load on the rollout path (tools/flight_load.py): 32 concurrent producers on loopback (over Flight,
and over the same-node socket) and a few large batches — every batch arrives exactly once (count and sha256 end to end), the buffer
never holds more than its capacity, producers block instead of piling up (backpressure), and
memory grows with the buffer, not with the traffic.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def load(*args: str) -> dict:
    """One load run in a fresh process, so its peak memory is its own."""
    proc = subprocess.run([sys.executable, "tools/flight_load.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("route", ["flight", "local"])
def test_32_producers_nothing_lost_or_doubled_and_memory_bounded(route: str) -> None:
    # The short run is long enough to reach the long one's concurrency (every producer with a batch in
    # flight, the buffer full): under load a 2-batch run peaked 20 MiB lower than on a quiet machine,
    # which is noise in the baseline, not memory the traffic added.
    short, long = (load("--producers", "32", "--batches", str(n), "--route", route) for n in (4, 24))
    for run in (short, long):
        assert run["batches_received"] == run["batches_sent"] == 32 * (4 if run is short else 24)
        assert run["lost"] == run["duplicated_or_unknown"] == run["server_duplicates"] == 0, run
        assert not run["errors"], run
        assert run["max_queued"] <= run["capacity"], run
        assert run["local_batches"] == (run["batches_sent"] if route == "local" else 0), run
    assert long["max_queued"] == long["capacity"] and long["max_blocked_puts"] >= 1, long  # producers waited
    traffic_added = long["mib_sent"] - short["mib_sent"]
    assert traffic_added > 200, (short, long)
    # Six times the traffic, yet memory grows by well under half of what was added.
    assert long["peak_rss_growth_mib"] < short["peak_rss_growth_mib"] + 0.5 * traffic_added, (short, long)


@pytest.mark.parametrize("route", ["flight", "local"])
def test_large_batches_arrive_whole(route: str) -> None:
    run = load("--producers", "4", "--batches", "2", "--rows", "64", "--tokens", "16384", "--route", route)
    assert run["batch_mib"] > 4  # Flight: several record batches on the wire, one batch on arrival
    assert run["batches_received"] == run["batches_sent"] == 8
    assert run["lost"] == run["duplicated_or_unknown"] == 0 and not run["errors"], run
