"""What each `algorithm.name` preset sets: the building blocks and its paper's defaults.

Why a table filled in *before* validation, and only into keys the user left out: a preset
is a shorthand for fields a user could set one by one (`adv_estimator`, `policy_loss`,
`loss_agg_mode`, ...), so a field written in the config always wins, and the resolved
config (`verl-hpc config show`, a run's config.yaml) lists every expanded field, so
a run never depends on this table changing later. No torch here: the config layer
imports it on a login node. Papers are cited in docs/algorithms.md.
"""

from __future__ import annotations

import copy
from typing import Any

DEFAULT_PRESET = "grpo"
_KL_IN_REWARD = {"estimator": "k1", "in_reward": True}  # log pi/pi_ref per token, subtracted from the reward

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"adv_estimator": "grpo", "policy_loss": "vanilla"},
    "ppo": {"adv_estimator": "gae", "policy_loss": "vanilla"},
    # Liu et al. 2025: no std normalisation, no 1/|o| length normalisation (a constant instead).
    "dr_grpo": {"adv_estimator": "grpo", "policy_loss": "vanilla", "norm_adv_by_std": False,
                "loss_agg_mode": "seq-mean-token-sum-norm"},
    # Ahmadian et al. 2024: leave-one-out baseline, KL penalty in the reward.
    "rloo": {"adv_estimator": "rloo", "policy_loss": "vanilla", "kl": _KL_IN_REWARD},
    # Hu et al. 2025: token-level KL in the reward, returns whitened over the global batch.
    "reinforce_pp": {"adv_estimator": "reinforce_pp", "policy_loss": "vanilla", "kl": _KL_IN_REWARD},
    "reinforce_pp_baseline": {"adv_estimator": "reinforce_pp_baseline", "policy_loss": "vanilla",
                              "kl": _KL_IN_REWARD},
    # Zheng et al. 2025: sequence ratio, clip ranges 3e-4 / 4e-4, mean over sequences.
    "gspo": {"adv_estimator": "grpo", "policy_loss": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
             "loss_agg_mode": "seq-mean-token-mean"},
    # Yu et al. 2025: clip-higher (0.2 / 0.28), token-level loss, dynamic sampling, no KL term.
    # The paper's overlong reward shaping sits in the reward section: reward.overlong_buffer.
    "dapo": {"adv_estimator": "grpo", "policy_loss": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
             "loss_agg_mode": "token-mean", "filter_groups": {"enable": True}, "kl": {"coef": 0.0}},
    # Li et al. 2023: the greedy response's score as baseline; KL in the reward (as verl's example).
    "remax": {"adv_estimator": "remax", "policy_loss": "vanilla", "kl": _KL_IN_REWARD},
    # Rafailov et al. 2023: offline preference pairs, no estimator, no reward; beta 0.1 (config/dpo.py).
    "dpo": {"dpo": {"beta": 0.1, "loss_type": "sigmoid"}},
}


def _merge_kl(preset: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """The user's KL keys over the preset's; a KL the user turned off gets no `in_reward`.

    Why the exception: `in_reward` needs the reference model, so a user who writes
    `kl.coef: 0` or `kl.estimator: off` under `rloo` means "no KL", not a config error.
    """
    merged = {**preset, **user}
    turned_off = user.get("estimator") == "off" or user.get("coef") in (0, 0.0)
    if turned_off and "in_reward" not in user:
        merged.pop("in_reward", None)
    return merged


def expand_preset(data: Any) -> Any:
    """`data` (an algorithm section as a dict) with the preset's values for the keys it lacks.

    Anything that is not a dict, or names an unknown preset, is returned unchanged:
    pydantic then reports it in one line naming the field.
    """
    if not isinstance(data, dict):
        return data
    name = data.get("name", DEFAULT_PRESET)
    preset = PRESETS.get(name) if isinstance(name, str) else None
    if preset is None:
        return data
    out = dict(data)
    for key, value in preset.items():
        if isinstance(value, dict):
            user = out.get(key)
            if user is None:
                out[key] = _merge_kl(copy.deepcopy(value), {})
            elif isinstance(user, dict):
                out[key] = _merge_kl(copy.deepcopy(value), user)
        elif key not in out:
            out[key] = value
    return out
