"""Single-digit addition as preference pairs: `a+b=` with the right sum chosen, a wrong one rejected.

Why this task: it lets DPO run offline on the quickstart's tiny model with nothing to
download, and its success is checkable the way the RL task's is — the trained model's
greedy answer to `a+b=` is the sum or it is not (`arithmetic.score`). The rejected sum is
drawn uniformly from the other possible sums, so no constant answer is preferred and the
policy must read the prompt; `ground_truth` rides along for evaluation.
"""

from __future__ import annotations

import random
from pathlib import Path


def make_pairs(num_prompts: int, max_operand: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(num_prompts):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        wrong = rng.choice([s for s in range(2 * max_operand + 1) if s != a + b])
        pairs.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong),
                      "ground_truth": str(a + b)})
    return pairs


def write_prompts(out_path: str | Path, num_prompts: int, max_operand: int, seed: int) -> Path:
    """Write the pairs as Parquet (atomically); returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(make_pairs(num_prompts, max_operand, seed)), tmp)
    tmp.replace(out)
    return out
