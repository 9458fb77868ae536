"""The quickstart config as data: what a run gets for every section it does not give.

Why a dict in the package and not a read of `configs/quickstart.yaml`: an installed
package has no `configs/` folder, yet `HybridTrainer(config=load_resource_config(...))`
(the resources-only form) still needs a model, data, a reward and an algorithm.
`tests/launch/test_facade.py` keeps this equal to `configs/quickstart.yaml`.
"""

from __future__ import annotations

import copy
from typing import Any

QUICKSTART: dict[str, Any] = {
    "model": {"path": "~/.cache/verl-hpc/models/tiny-seed0", "init_preset": "tiny", "init_seed": 0},
    "data": {"task": {"name": "arithmetic", "num_prompts": 512, "max_operand": 4, "seed": 0}},
    "reward": {"function": "verl_hpc.data.tasks.arithmetic:score"},
    "algorithm": {
        "name": "grpo",
        "sampling": {"n": 8, "temperature": 1.0, "max_new_tokens": 4},
        "kl": {"estimator": "k3", "coef": 0.001},
        "entropy_coef": 0.01,
    },
    "trainer": {"total_steps": 500, "batch_size": 128, "seed": 0, "actor_optim": {"lr": 0.001, "grad_clip": 1.0}},
    "resources": {
        "actor": {"device_type": "cpu", "device_ids": [0], "strategy": "hf"},
        "rollout": {"device_type": "cpu", "device_ids": [0], "strategy": "hf"},
        "placement": "colocated",
    },
    "logging": {"sample_every": 20},
}


def quickstart() -> dict[str, Any]:
    """A fresh copy of the quickstart config (callers may change it)."""
    return copy.deepcopy(QUICKSTART)
