"""`python -m bench transport_native`: the same-node route against a receiver with no Python in its loop.

Why: the route misses issue 19's 0.5 of a raw socket at 64 KB, and the measured Python
floor is below the target too (`transport_floor.py`). The one design left is a receiver
that holds and acknowledges batches without the GIL; before the product takes on a C
extension, this measures what one buys, in the same run and against the same raw TCP
socket as `python -m bench transport`'s cross-process table: one producer process puts
through the route's own client end into (a) the route and (b) bench/native_receiver.c,
whose taker decodes and checks every batch as the trainer's `get` does.

Opt-in (not in `all`): it compiles C, so it needs a C compiler and Python's headers
(`native_receiver.build_problem` names what is missing).
"""

from __future__ import annotations

from typing import Any

from bench import transport, transport_procs
from bench.native_receiver import build_problem
from bench.transport import _label

QUICK_SIZES = [64 << 10, 1 << 20]
FULL_SIZES = [64 << 10, 1 << 20, 16 << 20]


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    problem = build_problem()
    if problem:
        raise SystemExit(f"transport_native needs to build bench/native_receiver.c: {problem}")
    rows = [transport_procs.measure_size(size, 3 if quick else 7, native=True)
            for size in (QUICK_SIZES if quick else FULL_SIZES)]
    for row in rows:
        if row["native_out_of_order"]:
            raise RuntimeError(f"the native receiver lost or repeated a put at {_label(row['bytes'])}")
    ratios = {}
    for row in rows:
        for name in ("local", "native", "floor"):
            ratios[f"{name}_vs_raw_{_label(row['bytes'])}"] = row[f"{name}_ratio"]
        ratios[f"native_vs_local_{_label(row['bytes'])}"] = row["native_vs_local"]  # > 1: native faster
    return {"rows": rows, "ratios": ratios}


def table(result: dict[str, Any]) -> str:
    lines = ["transport_native benchmark: one producer process, the route's client end, into the route "
             "and into a C receiver",
             "(each against the same raw TCP socket; raw us/put shows the sitting: ~15 when the vCPUs are awake, "
             "~90 when each wake-up waits for the host)",
             f"{'batch (IPC bytes)':<18}{'raw us/put':>11}{'route':>7}{'native':>8}{'floor':>7}{'native/route':>14}"
             "  target"]
    for row in result["rows"]:
        raw_us = row["bytes"] / row["raw_mb_s"]
        native = row["native_ratio"]["median"]
        goal = transport.target(row["bytes"])
        lines.append(f"{_label(row['bytes']):<18}{raw_us:>11.1f}{row['local_ratio']['median']:>7.2f}{native:>8.2f}"
                     f"{row['floor_ratio']['median']:>7.2f}{row['native_vs_local']['median']:>14.2f}"
                     f"  >= {goal} {'met' if native >= goal else 'MISSED'} (native)")
    return "\n".join(lines)
