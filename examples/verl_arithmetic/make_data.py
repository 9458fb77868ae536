"""The quickstart's addition task (`a+b=` -> the sum) as Parquet in verl's layout.

Why: a verl command line reads verl's files (`data_source`, `prompt`, `ability`,
`reward_model: {style, ground_truth}`, `extra_info`), and the tiny model built here by
`verl-hpc init-model` learns this task in a few minutes on a CPU, so `verl-hpc verl` can
be tried (and tested) end to end without a download. The prompts are text, not chat
messages: the tiny tokenizer has no chat template.

    .venv/bin/python examples/verl_arithmetic/make_data.py [OUT_DIR]   # train.parquet, val.parquet
"""

from __future__ import annotations

import sys
from pathlib import Path

from verl_hpc.data.tasks.arithmetic import make_examples


def rows(count: int, seed: int, split: str) -> list[dict]:
    return [{"data_source": "arithmetic", "prompt": e["prompt"], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": e["ground_truth"]},
             "extra_info": {"split": split, "index": i}}
            for i, e in enumerate(make_examples(count, max_operand=4, seed=seed))]


def write(out_dir: Path, train: int = 512, val: int = 25) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.parquet", out_dir / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows(train, 0, "train")), paths[0])
    pq.write_table(pa.Table.from_pylist(rows(val, 1, "test")), paths[1])
    return paths


if __name__ == "__main__":
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else "data/verl_arithmetic")):
        print(path)
