"""The hidden digit: a multi-turn task in which the only way to the answer is the tool's reply.

Every prompt is the same question ("what is in the box"); each row hides its own digit, given
to the `peek` tool through verl's per-row `extra_info.tools_kwargs.peek.create_kwargs`. The
model cannot see it, memorise it from the prompt or guess it better than the most frequent
digit of the data (`best_constant_accuracy`; the digits run 0..`data.task.max_operand`, 0..4 by
default, so about 1/5): a policy that ignores tool replies is capped there, whatever it does. A policy that calls `peek` and copies the reply scores 1.

The reward is shaped in three steps, each measured necessary for the tiny model:
- an answer given without opening the box scores 0: a guess is not knowing (without that rule a
  random policy learns to stop calling before it learns to copy, since a call spends turns and
  tokens a guess does not);
- opening the box and then answering earns `LOOK_CREDIT` whatever the answer: a random policy's
  answer is right only when it both calls and happens to write the digit (~1 episode in 50), so
  without it most groups have no reward spread at all;
- an answer that is one number and nothing else, its turn ended, earns `FORM_CREDIT`: with a
  budget long enough to end the answer, the policy otherwise never learned to end it (a run-on of
  random tokens whose first number is rarely the digit). The quickstart's budget (two model
  tokens: the call, then the digit) leaves no room for the end, so there it is never earned.
A policy that ignores the reply still earns at most LOOK_CREDIT + FORM_CREDIT + the remaining
credit x best_constant_accuracy; the test of the task compares the greedy policy's accuracy with
`best_constant_accuracy`, which no shaping changes.

What the reward cannot do alone: each look's credit also reinforces whatever answer followed
the look, so while the policy learns to look its answer settles on one digit, and then no copy
forms. The quickstart's KL to the initial policy keeps the answer spread until it does
(measured in docs/agents.md).

Why the tiny model can learn it (`tiny-agent` preset, ~50 tokens, the call one token): with the
quickstart's two tokens a random policy opens the box and answers in ~2% of episodes, so a few of
a step's eight groups have reward spread from the first step (measured: ~97% look by step 41).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

from verl_hpc.data.tasks.arithmetic import first_integer

QUESTION = "what is in the box"
LOOK_CREDIT = 0.2  # for opening the box at all: the first thing a random policy must find
FORM_CREDIT = 0.2  # for an answer that is one number and ends its turn: makes the digit a 1-in-5 choice
TOOL = "verl_hpc.data.tasks.hidden_digit:peek"


def make_examples(num_prompts: int, seed: int, max_digit: int = 9) -> list[dict[str, Any]]:
    """Rows whose hidden digits are drawn from 0..`max_digit`."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        digit = rng.randint(0, max_digit)
        rows.append({"prompt": [{"role": "user", "content": QUESTION}], "ground_truth": str(digit),
                     "data_source": "hidden_digit",
                     "extra_info": {"index": index, "tools_kwargs": {"peek": {"create_kwargs": {"digit": digit}}}}})
    return rows


def write_prompts(out_path: str | Path, num_prompts: int, max_operand: int = 9, seed: int = 0) -> Path:
    """Write the prompts as Parquet (atomically); the task config's `max_operand` is the largest hidden digit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(make_examples(num_prompts, seed, max_operand)), tmp)
    tmp.replace(out)
    return out


def peek(**state: Any) -> str:
    """Look inside the box and tell what digit it holds."""
    return str(state.get("digit", "empty"))


def looked(extra_info: dict[str, Any] | None) -> bool:
    """Whether the episode opened the box: a `peek` call that the tool answered."""
    calls = (extra_info or {}).get("tool_calls") or []
    return any(c.get("name") == "peek" and c.get("error") is None for c in calls)


def answered(extra_info: dict[str, Any] | None) -> bool:
    """Whether the episode ended with an answer (its last turn called no tool)."""
    messages = (extra_info or {}).get("messages") or []
    return bool(messages) and messages[-1].get("role") == "assistant" and not messages[-1].get("tool_calls")


def score(prompt: str, response: str, ground_truth: str, finished: bool | None = None,
          extra_info: dict[str, Any] | None = None, **_: object) -> float:
    """0 for an answer given without opening the box (a guess is not knowing what is in it) and for no
    answer at all. An answer after a look earns LOOK_CREDIT, FORM_CREDIT more when it is one number and
    nothing else with its turn ended, and the rest when its first number is the hidden digit."""
    if not (looked(extra_info) and answered(extra_info)):
        return 0.0
    answer = first_integer(response)
    lone = answer is not None and finished is not False and response.strip() == answer
    right = answer is not None and answer == ground_truth.strip()
    return LOOK_CREDIT + FORM_CREDIT * lone + (1.0 - LOOK_CREDIT - FORM_CREDIT) * right


def best_constant_accuracy(num_prompts: int, seed: int, max_digit: int = 9) -> float:
    """The share of the most frequent hidden digit: the best any policy ignoring the tool can do."""
    digits = Counter(row["ground_truth"] for row in make_examples(num_prompts, seed, max_digit))
    return max(digits.values()) / num_prompts
