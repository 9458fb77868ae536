"""The hidden digit: a multi-turn task in which the only way to the answer is the tool's reply.

Every prompt is the same question ("what is in the box"); each row hides its own digit, given
to the `peek` tool through verl's per-row `extra_info.tools_kwargs.peek.create_kwargs`. The
model cannot see it, memorise it from the prompt or guess it better than the most frequent
digit of the data (`best_constant_accuracy`, about 1/10): a policy that ignores tool replies is
capped there, whatever it does. A policy that calls `peek` and copies the reply scores 1. An
answer given without opening the box scores 0 (a guess is not knowing): measured, without that
rule a random-init policy learns to stop calling before it learns to copy, because a call spends
turns and tokens that a guess does not.

Why it is learnable by the tiny model (`tiny-agent` preset, ~50 tokens, the call one token):
a random policy ends about a quarter of its first turns with the call, and a random first digit
matches 1 time in 10, so many groups of 8 have reward spread from the first step; what is left
to learn is "call, then copy the digit of the reply" — ten conditional copies, smaller than the
arithmetic task's table. Scoring is the arithmetic task's: the first integer of the final
answer, 1 when that is all it says and it ended its turn, 0.5 when it runs on.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

from verl_hpc.data.tasks.arithmetic import score as _first_integer_score

QUESTION = "what is in the box"
TOOL = "verl_hpc.data.tasks.hidden_digit:peek"


def make_examples(num_prompts: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        digit = rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": QUESTION}], "ground_truth": str(digit),
                     "data_source": "hidden_digit",
                     "extra_info": {"index": index, "tools_kwargs": {"peek": {"create_kwargs": {"digit": digit}}}}})
    return rows


def write_prompts(out_path: str | Path, num_prompts: int, max_operand: int = 0, seed: int = 0) -> Path:
    """Write the prompts as Parquet (atomically); `max_operand` is unused (the task config's shared field)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(make_examples(num_prompts, seed)), tmp)
    tmp.replace(out)
    return out


def peek(**state: Any) -> str:
    """Look inside the box and tell what digit it holds."""
    return str(state.get("digit", "empty"))


def looked(extra_info: dict[str, Any] | None) -> bool:
    """Whether the episode opened the box: a `peek` call that the tool answered."""
    calls = (extra_info or {}).get("tool_calls") or []
    return any(c.get("name") == "peek" and c.get("error") is None for c in calls)


def score(prompt: str, response: str, ground_truth: str, finished: bool | None = None,
          extra_info: dict[str, Any] | None = None, **_: object) -> float:
    """The final answer's first integer against the hidden digit (1, 0.5 when it runs on, else 0), and 0
    for an answer given without opening the box: a guess is not knowing what is in it."""
    if not looked(extra_info):
        return 0.0
    return _first_integer_score(prompt, response, ground_truth, finished)


def best_constant_accuracy(num_prompts: int, seed: int) -> float:
    """The share of the most frequent hidden digit: the best any policy ignoring the tool can do."""
    digits = Counter(row["ground_truth"] for row in make_examples(num_prompts, seed))
    return max(digits.values()) / num_prompts
