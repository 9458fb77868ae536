"""Single-digit addition, `a+b=` -> the sum: a task a random-init tiny model learns by RL.

Why this task (measured, see docs/configuration.md): answers are spelled digit by digit
with a ~64-token vocabulary, so a random policy's first number is right a few percent
of the time — enough for most GRPO groups of 8 to have reward spread from step one.
The reward reads the *first integer* of the response, so no constant answer scores
better than the most frequent sum (`best_constant_accuracy`), and a learned policy
must beat that bar, not just raise its mean. Full marks need the answer to stop too:
the number and then EOS (`finished`), nothing else; a right number that runs on
("7se7se") scores half. Without that the trained model never learns to stop, and
its greedy output is a right digit followed by noise up to max_new_tokens.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

_FIRST_INT = re.compile(r"\d+")


def make_examples(num_prompts: int, max_operand: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    examples = []
    for _ in range(num_prompts):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        examples.append({"prompt": f"{a}+{b}=", "ground_truth": str(a + b)})
    return examples


def write_prompts(out_path: str | Path, num_prompts: int, max_operand: int, seed: int) -> Path:
    """Write the prompts as Parquet (atomically); returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(make_examples(num_prompts, max_operand, seed))
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)
    return out


def first_integer(text: str) -> str | None:
    match = _FIRST_INT.search(text)
    return match.group(0) if match else None


def score(prompt: str, response: str, ground_truth: str, finished: bool | None = None, **_: object) -> float:
    """1.0 for exactly the sum then EOS; 0.5 for a right first integer that does not stop there; else 0.0.

    `finished` (the response ended with EOS) comes from `RuleReward`; a caller that cannot
    tell (None) gets the first-integer score alone.
    """
    answer = first_integer(response)
    if answer is None or answer != ground_truth.strip():
        return 0.0
    if finished is None:
        return 1.0
    return 1.0 if finished and response.strip() == answer else 0.5


def best_constant_accuracy(max_operand: int) -> float:
    """The accuracy of the best constant answer: the bar a learned policy must clear."""
    sums = Counter(a + b for a in range(max_operand + 1) for b in range(max_operand + 1))
    return max(sums.values()) / sum(sums.values())
