"""The hidden-digit task's reward: a look, then a lone number, then the right one, each earns its part."""

from __future__ import annotations

from typing import Any

import pytest

from verl_hpc.data.tasks.hidden_digit import (
    FORM_CREDIT,
    LOOK_CREDIT,
    best_constant_accuracy,
    make_examples,
    peek,
    score,
)


def episode(looked: bool, answered: bool = True) -> dict[str, Any]:
    """The `extra_info` of an episode as the agent loop hands it to the reward."""
    calls = [{"name": "peek", "arguments": {}, "error": None}] if looked else []
    messages = [{"role": "user", "content": "what is in the box"}]
    if looked:
        messages += [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "peek"}}]},
                     {"role": "tool", "content": "3"}]
    if answered:
        messages.append({"role": "assistant", "content": "3"})
    return {"tool_calls": calls, "messages": messages}


@pytest.mark.parametrize(("response", "finished", "looked", "expected"), [
    ("3", True, True, 1.0),                                   # looked, one number, the right one
    ("3 it is", True, True, 1.0 - FORM_CREDIT),               # right, but more than the number
    ("3", False, True, 1.0 - FORM_CREDIT),                    # right, but its turn did not end
    ("4", True, True, LOOK_CREDIT + FORM_CREDIT),             # a lone number, the wrong one
    ("box", True, True, LOOK_CREDIT),                         # looked and answered, no number
    ("3", True, False, 0.0),                                  # right without looking: a guess
])
def test_each_part_of_the_answer_earns_its_credit(response: str, finished: bool, looked: bool,
                                                  expected: float) -> None:
    got = score("what is in the box", response, "3", finished=finished, extra_info=episode(looked))
    assert got == pytest.approx(expected)


def test_no_answer_after_the_look_scores_nothing() -> None:
    assert score("q", "", "3", finished=False, extra_info=episode(True, answered=False)) == 0.0


def test_rows_hide_their_digit_for_the_tool_and_the_best_constant_is_their_commonest() -> None:
    rows = make_examples(200, seed=0, max_digit=4)
    assert {row["ground_truth"] for row in rows} <= {"0", "1", "2", "3", "4"}
    kwargs = rows[0]["extra_info"]["tools_kwargs"]["peek"]["create_kwargs"]
    assert peek(**kwargs) == rows[0]["ground_truth"]
    commonest = max(sum(r["ground_truth"] == d for r in rows) for d in "01234") / 200
    assert best_constant_accuracy(200, 0, 4) == commonest
