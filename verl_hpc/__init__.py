"""verl-hpc: a Slurm/HPC launcher and checkpoint-resilient runtime for RL post-training of LLMs.

The package is layered, data flowing one way (docs/architecture.md, "Layers"). Importing the
package is cheap: heavy modules (torch, transformers) load only when the trainer is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verl_hpc.config import ConfigError, Dataflow, RunConfig, load_config, load_resource_config
from verl_hpc.utils.version import VERSION as __version__

if TYPE_CHECKING:
    from verl_hpc.api import HybridTrainer
    from verl_hpc.launch.executor import Executor, LocalExecutor, SlurmExecutor, submit
    from verl_hpc.launch.handle import RunHandle

    SlurmJob = RunHandle

__all__ = ["ConfigError", "Dataflow", "Executor", "HybridTrainer", "LocalExecutor", "RunConfig", "RunHandle",
           "SlurmExecutor", "SlurmJob", "__version__", "load_config", "load_resource_config", "submit"]

_EXECUTOR_NAMES = ("Executor", "LocalExecutor", "SlurmExecutor", "submit")


def __getattr__(name: str) -> Any:
    if name == "HybridTrainer":
        from verl_hpc.api import HybridTrainer

        return HybridTrainer
    if name in _EXECUTOR_NAMES:  # submitit loads only when submitting
        from verl_hpc.launch import executor

        return getattr(executor, name)
    if name in ("RunHandle", "SlurmJob"):  # SlurmJob: the name the handle of a submitted job had
        from verl_hpc.launch.handle import RunHandle

        return RunHandle
    raise AttributeError(f"module 'verl_hpc' has no attribute {name!r}")
