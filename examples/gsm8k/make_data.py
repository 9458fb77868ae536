"""A small GSM8K-style Parquet in verl's layout (examples/data_preprocess/gsm8k.py), problems written here.

Why our own problems: there is no data download here. The columns are verl's, so the same
file trains in verl and in verl-hpc: `data_source`, `prompt` (chat messages), `ability`,
`reward_model: {style, ground_truth}`, `extra_info: {split, index, answer, question}`.

    .venv/bin/python examples/gsm8k/make_data.py [OUT_DIR]   # writes train.parquet there
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils"]


def make_problems(count: int, seed: int = 0) -> list[tuple[str, str, int]]:
    """(question, worked answer ending in '#### N', N): two-step word problems like GSM8K's."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        have, more, gave = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 4)
        total = have + more - gave
        question = (f"{name} has {have} {item}, buys {more} more and gives {gave} away. "
                    f"How many {item} does {name} have now?")
        answer = f"{have} + {more} = {have + more}. {have + more} - {gave} = {total}.\n#### {total}"
        out.append((question, answer, total))
    return out


def rows(count: int, split: str = "train") -> list[dict]:
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(n)},
             "extra_info": {"split": split, "index": i, "answer": a, "question": q}}
            for i, (q, a, n) in enumerate(make_problems(count))]


def write(out_dir: Path, count: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows(count)), path)
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1] if len(sys.argv) > 1 else "data/gsm8k")))
