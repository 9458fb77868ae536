"""The C receiver of bench/native_receiver.c: built here, it takes every put, in order, and refuses strangers.

Why tested: the benchmark's claim (docs/benchmarks.md, "A receiver with no Python in its
loop") rests on this receiver keeping the route's contract as measured: each put answered
once it is held, every batch taken and decoded, none lost or repeated. Skipped, with the
fix, where the machine has no C compiler or Python headers (tools/test.sh installs gcc).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow.flight as flight
import pytest

from bench.native_receiver import NativeReceiver, build, build_problem
from bench.transport import make_batch
from verl_hpc.transport.rollouts.local import LocalConnection

needs_compiler = pytest.mark.skipif(build_problem() is not None, reason=f"{build_problem()}")


def _wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@needs_compiler
def test_the_native_receiver_acknowledges_and_hands_over_every_put_in_order() -> None:
    receiver = NativeReceiver("tok", capacity=2)
    conn = LocalConnection(receiver.path, "tok", "producer-0")
    statuses = [conn.send(make_batch(size, seed=seq).record_batch, seq, 10.0)
                for seq, size in enumerate([1 << 10, 64 << 10, 1 << 20, 64 << 10, 2 << 20, 1 << 10])]
    assert statuses == ["queued"] * 6
    assert _wait_for(lambda: receiver.taken == 6), receiver.taken  # each body decoded and checked as `get` does
    assert receiver.received == 6 and receiver.out_of_order == 0
    conn.close()
    receiver.close()
    receiver.close()  # twice is safe
    assert not os.path.exists(os.path.dirname(receiver.path))


@needs_compiler
def test_the_native_receiver_refuses_a_producer_without_the_token() -> None:
    receiver = NativeReceiver("tok", capacity=2)
    try:
        with pytest.raises(flight.FlightUnauthenticatedError, match="refused this producer's token"):
            LocalConnection(receiver.path, "not-the-token", "producer-0")
        assert receiver.received == 0
    finally:
        receiver.close()


def test_a_missing_compiler_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert "no C compiler" in (build_problem() or "") and "apt install gcc" in (build_problem() or "")
    with pytest.raises(RuntimeError, match="cannot build native_receiver.c: no C compiler"):
        build(str(tmp_path))


@needs_compiler
def test_the_transport_native_benchmark_reports_the_route_and_the_receiver_side_by_side(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.__main__ import main

    assert main(["transport_native", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "transport_native-quick.json").read_text())
    for row in result["rows"]:
        assert row["native_out_of_order"] == 0 and row["native_taken"] > 0
    for key in ("local_vs_raw_67KB", "native_vs_raw_67KB", "native_vs_local_1MB"):
        ratio = result["ratios"][key]
        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    assert "native/route" in capsys.readouterr().out
