"""A GSM8K reward in verl's signature: the number after '####' (else the last number) must match.

Why a dict: verl's reward functions may return `score` plus extras; verl-hpc logs the numeric
extras as `reward/extra/<key>` (here `acc` and `formatted`, the share that used '####').
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> tuple[str | None, bool]:
    """(the answer, whether it came after '####')."""
    if "####" in text:
        found = _NUMBER.findall(text.split("####")[-1])
        if found:
            return found[0].replace(",", ""), True
    found = _NUMBER.findall(text)
    return (found[-1].replace(",", "") if found else None), False


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer, formatted = extract_answer(solution_str)
    right = answer is not None and answer == str(ground_truth).strip()
    return {"score": 1.0 if right else 0.0, "acc": float(right), "formatted": float(formatted)}
