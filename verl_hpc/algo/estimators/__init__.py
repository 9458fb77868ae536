"""The built-in estimators and losses; importing this package registers them."""

from verl_hpc.algo.estimators import gae, grpo, gspo, reinforce_pp, rloo, vanilla  # noqa: F401 - registration side effect
