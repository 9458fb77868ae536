"""`python -m bench NAME [--quick]`: run one benchmark, print its table, save its JSON.

Why a tiny runner of our own: each benchmark is a module with `run(quick) -> dict` and
`table(result) -> str`; results land in bench/results/<name>.json (<name>-quick.json for
--quick) so runs on different machines can be compared file to file.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

BENCHMARKS = {"checkpoint": "bench.checkpoint"}
RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller inputs")
    parser.add_argument("--dir", help="scratch directory for files the benchmark writes (default: tmp)")
    args = parser.parse_args(argv)
    module = importlib.import_module(BENCHMARKS[args.name])
    result = module.run(quick=args.quick, scratch=args.dir)
    result["machine"] = {"host": platform.node(), "python": platform.python_version(),
                         "platform": platform.platform(), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(module.table(result))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
