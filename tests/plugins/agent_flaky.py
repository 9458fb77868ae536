"""A `peek` tool that fails by the hidden digit: raises (0-2), hangs (3), floods (4), else answers."""

from __future__ import annotations

import time
from typing import Any


def peek(**state: Any) -> str:
    """Look inside the box."""
    digit = int(state.get("digit", 9))
    if digit <= 2:
        raise ValueError(f"box {digit} is jammed")
    if digit == 3:
        time.sleep(30)
    if digit == 4:
        return "y" * 1_000_000
    return str(digit)
