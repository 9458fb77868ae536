"""verl's multi-turn section maps key for key; what would change its meaning is refused by name."""

from __future__ import annotations

import pytest

from verl_hpc.config import ConfigError
from verl_hpc.config.multi_turn import MultiTurnConfig
from verl_hpc.config.verl_multi_turn import from_verl_multi_turn

# The multi-turn section of verl's GSM8K tool-agent example, as a user passes it.
VERL_SECTION = {"enable": True, "max_assistant_turns": 5, "max_user_turns": None, "max_parallel_calls": 1,
                "max_tool_response_length": 256, "tool_response_truncate_side": "middle", "format": "hermes",
                "tool_config_path": "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml",
                "use_inference_chat_template": False, "tokenization_sanity_check_mode": "strict",
                "interaction_config_path": None}


def test_verl_keys_map_to_the_same_fields_and_validate() -> None:
    fields, ignored = from_verl_multi_turn(VERL_SECTION)
    assert fields == {"enable": True, "max_assistant_turns": 5, "max_parallel_calls": 1,
                      "max_tool_response_length": 256, "tool_response_truncate_side": "middle", "format": "hermes",
                      "tool_config_path": VERL_SECTION["tool_config_path"]}
    assert ignored == ["actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
                       "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode"]
    mt = MultiTurnConfig(**fields)
    assert mt.enable and mt.max_assistant_turns == 5 and mt.user_turns == 5


@pytest.mark.parametrize(("key", "value", "match"), [
    ("interaction_config_path", "interaction.yaml", r"multi_turn.interaction_config_path: 'interaction.yaml' is "
                                                    r"not taken, only None \(hint: user simulators"),
    ("max_turns", 3, r"multi_turn.max_turns: verl-hpc has no such multi-turn key \(hint: the keys taken: "),
])
def test_a_key_that_would_change_the_run_is_refused_by_name(key: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        from_verl_multi_turn({"enable": True, key: value})
