"""Environments: episodes whose user turns come from a game, a simulator or a grader.

One interface (`base.Environment`, shaped like OpenEnv's reset/step) and an adapter per
ecosystem (`sources.py`); `runner.EnvRunner` calls them for many episodes at once.
"""

from verl_hpc.roles.env.base import EnvFailure, Environment, EnvReply
from verl_hpc.roles.env.runner import EnvRunner
from verl_hpc.roles.env.sources import make_environment

__all__ = ["EnvFailure", "EnvReply", "Environment", "EnvRunner", "make_environment"]
