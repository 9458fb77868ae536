"""The addition task's reward in verl's signature: the response's first number must be the sum.

verl calls it as `custom_reward_function.path=examples/verl_arithmetic/reward.py` (name
`compute_score`), and so does `verl-hpc verl`.
"""

from __future__ import annotations

import re

_FIRST_NUMBER = re.compile(r"\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    match = _FIRST_NUMBER.search(solution_str)
    return 1.0 if match is not None and match.group(0) == str(ground_truth).strip() else 0.0
