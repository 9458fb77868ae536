"""Built-in synthetic tasks: each writes its own prompt file and ships its reward function."""

from __future__ import annotations

from pathlib import Path

from verl_hpc.data.tasks import arithmetic, arithmetic_preference, hidden_digit

TASKS = {"arithmetic": arithmetic, "arithmetic_preference": arithmetic_preference, "hidden_digit": hidden_digit}
TASK_REWARDS = {"arithmetic": "verl_hpc.data.tasks.arithmetic:score",
                "hidden_digit": "verl_hpc.data.tasks.hidden_digit:score"}


def write_task_prompts(name: str, out_path: str | Path, num_prompts: int, max_operand: int, seed: int) -> Path:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name].write_prompts(out_path, num_prompts=num_prompts, max_operand=max_operand, seed=seed)
