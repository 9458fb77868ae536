"""verl's dataset layout, read as is: chat or text prompts, nested keys, rows checked one by one.

Why here and not in the user's preprocessing: a verl user arrives with the Parquet that
verl's `examples/data_preprocess/*.py` wrote — `prompt` as a list of `{role, content}`
messages, the answer nested in `reward_model.ground_truth`, `data_source` and
`extra_info` beside it. Flattening that by hand is where answers silently became empty
strings. So a key may be a dotted path into struct columns, every row is checked before
anything is generated, and a bad row fails in one line that names the file, the row
(0-based, as Arrow and pandas count) and the column.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

MISSING = object()  # a key whose column (or struct field) the table does not have


class RowError(ValueError):
    """One malformed row or key: `field` is the config field to look at, `hint` the fix.

    The data layer sits below the config layer, so it cannot raise `ConfigError`; the
    runtime and the config checks turn this into one (same field, message and hint).
    """

    def __init__(self, field: str, message: str, hint: str | None = None):
        self.field, self.message, self.hint = field, message, hint
        super().__init__(f"{field}: {message}" + (f" (hint: {hint})" if hint else ""))


def key_type(schema: pa.Schema, key: str) -> pa.DataType | None:
    """The Arrow type a (possibly dotted) key names in `schema`; None if it names nothing.

    A column whose own name holds a dot wins over a path, as in pandas and verl.
    """
    if key in schema.names:
        return schema.field(key).type
    head, *rest = key.split(".")
    if head not in schema.names:
        return None
    kind = schema.field(head).type
    for part in rest:
        if not pa.types.is_struct(kind) or kind.get_field_index(part) < 0:
            return None
        kind = kind.field(part).type
    return kind


def key_values(table: pa.Table, key: str) -> list[Any] | object:
    """Each row's value at `key` (None where a row or struct is null); MISSING if no such key."""
    if key_type(table.schema, key) is None:
        return MISSING
    if key in table.column_names:
        return table.column(key).to_pylist()
    head, *rest = key.split(".")
    values = table.column(head).to_pylist()
    for part in rest:
        values = [v.get(part) if isinstance(v, dict) else None for v in values]
    return values


def is_prompt_type(kind: pa.DataType) -> bool:
    """Text, or a list of structs (chat messages): what a prompt column may hold."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return True
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_struct(kind.value_type)


CALL_KEYS = ("tool_calls", "tool_call_id", "name")  # kept on a prompt's messages: earlier calls render as written


def check_prompt(value: Any, where: str, field: str) -> str | list[dict[str, Any]]:
    """A prompt as text or as chat messages; anything else is a RowError naming `where`.

    Why tool calls are kept: a prompt may show the model earlier calls and their replies (worked
    examples, or a conversation to go on from); the multi-turn template renders them from these
    keys, and a small model copies the call's form from them (examples/gsm8k --tool-shots).
    """
    hint = "give text, or a list of {role, content} messages (verl's `prompt` column)"
    if value is None:
        raise RowError(field, f"{where}: the prompt is missing (null)", hint)
    if isinstance(value, str):
        if not value.strip():
            raise RowError(field, f"{where}: the prompt is empty", "drop the row or write a prompt")
        return value
    if not isinstance(value, list):
        raise RowError(field, f"{where}: holds {type(value).__name__} {value!r:.40}, not text or a list of "
                       "messages", hint)
    if not value:
        raise RowError(field, f"{where}: the prompt is empty (no messages)", "drop the row or add a message")
    for k, message in enumerate(value):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not (isinstance(message.get("content"), str) or (calls and message.get("content") is None)):
            raise RowError(field, f"{where}: message {k} is {message!r:.60}, not {{role, content}} strings", hint)
    if not any((m["content"] or "").strip() for m in value):
        raise RowError(field, f"{where}: the prompt is empty (every message's content is blank)",
                       "drop the row or write a prompt")
    return [{"role": m["role"], "content": m["content"] or "",
             **{key: m[key] for key in CALL_KEYS if m.get(key) is not None}} for m in value]


def answer_text(value: Any) -> str | None:
    """A ground truth as text (numbers from JSONL included; lists and dicts as JSON): what logs and
    our own reward signature show; None stays None. The object itself rides beside it (`answer_json`)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def answer_json(value: Any) -> str | None:
    """A ground truth that is not text (a list, a dict, a number) as JSON, so the object itself can
    reach the reward after any transport; None for text and missing ones (the text column says it all)."""
    return None if value is None or isinstance(value, str) else json.dumps(value, default=str)


def info_text(value: Any) -> str | None:
    """`extra_info` of any shape (struct, map, text) as JSON text: one string column in the batch."""
    return None if value is None else json.dumps(value, default=str)


def render_prompts(tokenizer: Any, prompts: list[str | list[dict[str, Any]]], where: list[str],
                   field: str) -> list[str]:
    """Text as is; messages through the tokenizer's chat template (`add_generation_prompt=True`)."""
    chat = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if chat and not getattr(tokenizer, "chat_template", None):
        raise RowError(field, f"{where[chat[0]]}: holds chat messages, but the model's tokenizer has no "
                       "chat template", "use a chat model (tokenizer_config.json with chat_template), or "
                       "store the prompts as text")
    out = []
    for p in prompts:
        out.append(p if isinstance(p, str) else
                   tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False))
    return out


def fit_lengths(ids: list[list[int]], max_len: int, truncation: str, where: list[str],
                field: str) -> list[list[int]]:
    """verl's `data.truncation`: `error` names the first over-long row, `left`/`right` cut that side."""
    if truncation == "left":
        return [row[-max_len:] for row in ids]
    if truncation == "right":
        return [row[:max_len] for row in ids]
    for i, row in enumerate(ids):
        if len(row) > max_len:
            raise RowError(field, f"{where[i]}: {len(row)} prompt tokens (chat template included) are more "
                           f"than data.max_prompt_length={max_len}",
                           "raise data.max_prompt_length, set data.filter_overlong_prompts: true, or "
                           "data.truncation: left or right")
    return ids
