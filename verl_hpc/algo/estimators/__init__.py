"""The built-in estimators and losses; importing this package registers them."""

from verl_hpc.algo.estimators import (  # noqa: F401 - registration side effect
    gae,
    grpo,
    gspo,
    reinforce_pp,
    remax,
    rloo,
    vanilla,
)
