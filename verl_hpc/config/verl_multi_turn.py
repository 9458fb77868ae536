"""verl's `actor_rollout_ref.rollout.multi_turn` keys, read into `rollout.multi_turn`.

Why a table of its own: a verl user's multi-turn section must run as written, key for key,
and a key that would change what verl does but means nothing here must be refused by name,
never dropped. Most keys carry over under the same name (`MultiTurnConfig` took verl's
names); three are verl's answers to problems this loop does not have and are accepted and
listed as ignored; a user simulator (`interaction_config_path`) is not run, so it is refused.
`verl-hpc verl` reads the section through `from_verl_multi_turn`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_hpc.config.errors import ConfigError

VERL_PREFIX = "actor_rollout_ref.rollout.multi_turn"
# verl key -> the `rollout.multi_turn` field it sets (the same name, by design).
SAME_NAME = ("enable", "max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length",
             "tool_response_truncate_side", "format", "tool_config_path")
# verl key -> why it is accepted and has no effect here.
IGNORED = {
    "use_inference_chat_template": "the history is never re-rendered: each turn appends the template's delta",
    "tokenization_sanity_check_mode": "the sampled ids are always kept; a template that would render them "
                                      "differently is counted in agent/template_mismatch",
    "completion_callback": "tool calls are parsed by the registered parser of `format`",
}
# verl key -> (values taken, hint) for keys that only work at verl's default.
ONLY = {"interaction_config_path": ((None,), "user simulators (interactions) are not run; give the tools as "
                                     "rollout.multi_turn.tools or a tool config file")}


def from_verl_multi_turn(section: Mapping[str, Any], prefix: str = VERL_PREFIX) -> tuple[dict[str, Any], list[str]]:
    """(the `rollout.multi_turn` fields, the verl keys accepted and ignored) for verl's section.

    A `null` that verl reads as "no limit" (`max_assistant_turns`, `max_user_turns`) leaves the
    field unset: the episode is then bounded by this loop's default turn count and, as in verl,
    by the response-token budget.
    """
    fields: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in section.items():
        path = f"{prefix}.{key}"
        if key in SAME_NAME:
            if value is not None or key == "tool_config_path":
                fields[key] = value
        elif key in IGNORED:
            ignored.append(path)
        elif key in ONLY:
            allowed, hint = ONLY[key]
            if value not in allowed:
                raise ConfigError(path, f"{value!r} is not taken, only {', '.join(map(repr, allowed))}", hint)
        else:
            raise ConfigError(path, "verl-hpc has no such multi-turn key",
                              f"the keys taken: {', '.join(sorted((*SAME_NAME, *IGNORED, *ONLY)))}")
    return fields, ignored
