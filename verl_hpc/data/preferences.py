"""Preference pairs from Parquet or JSONL: a prompt (text or chat messages), a chosen and a rejected reply.

Why the prompt column is read as the RL prompts are (`check_prompt`, verl's chat layout):
a DPO file made from the same sources as a GRPO file must render its prompts with the same
chat template, or the policy is optimised on a context it never sees at generation time.
A reply is text, or chat messages whose last one is the reply (TRL's conversational form).
Every row is checked before training; a bad one fails in one line naming file, row and column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_hpc.data.prompts import prompt_key_for, read_table
from verl_hpc.data.records import MISSING, RowError, answer_text, check_prompt, key_values

PAIR_KEYS = ("chosen", "rejected")


def reply_text(value: Any, where: str) -> str:
    """A reply as text: a string, or the content of the last of a list of chat messages."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content")
    if not isinstance(value, str) or not value.strip():
        raise RowError("data.train_files", f"{where}: holds {value!r:.40}, not a non-empty reply",
                       "give every row a chosen and a rejected reply as text (or chat messages)")
    return value


class PreferenceDataset:
    """Rows of (prompt, chosen, rejected), with the ground truth where the file has one."""

    def __init__(self, files: list[str | Path], prompt_key: str = "prompt"):
        self.prompts: list[str | list[dict[str, str]]] = []
        self.chosen: list[str] = []
        self.rejected: list[str] = []
        self.answers: list[str | None] = []
        self.where: list[str] = []
        for f in files:
            self._add(Path(f), prompt_key)
        if not self.prompts:
            raise RowError("data.train_files", f"no preference pairs in {[str(f) for f in files]}",
                           "give files with prompt, chosen and rejected rows")

    def _add(self, path: Path, prompt_key: str) -> None:
        table = read_table(path)
        key = prompt_key_for(table.schema, prompt_key)
        columns = {name: key_values(table, name) for name in (key, *PAIR_KEYS)}
        missing = [name for name, values in columns.items() if values is MISSING]
        if missing:
            raise RowError("data.train_files", f"{path}: no column {missing[0]!r} (has {table.column_names})",
                           "give every row prompt, chosen and rejected")
        answers = key_values(table, "ground_truth")
        for row in range(table.num_rows):
            where = f"{path} row {row}"
            self.prompts.append(check_prompt(columns[key][row], f"{where}, column {key!r}", "data.prompt_key"))
            self.chosen.append(reply_text(columns["chosen"][row], f"{where}, column 'chosen'"))
            self.rejected.append(reply_text(columns["rejected"][row], f"{where}, column 'rejected'"))
            self.answers.append(None if answers is MISSING else answer_text(answers[row]))
            self.where.append(where)

    def __len__(self) -> int:
        return len(self.prompts)


def reply_ids(tokenizer: Any, replies: list[str], eos_id: int, max_len: int, where: list[str],
              field: str) -> list[list[int]]:
    """Each reply's tokens then EOS (the policy must learn to stop there), at most `max_len`."""
    encoded = tokenizer(replies, add_special_tokens=False)["input_ids"]
    out = [[*ids, eos_id] for ids in encoded]
    for i, ids in enumerate(out):
        if len(ids) > max_len:
            raise RowError(field, f"{where[i]}: a reply of {len(ids)} tokens (EOS included) is longer than "
                           f"{max_len}", "raise algorithm.dpo.max_response_length or shorten the reply")
    return out
