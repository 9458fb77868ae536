"""`from verl_hpc.utils.resource import HybridTrainer, load_resource_config, pin_to_device`.

Why this module: the `HybridTrainer` facade's documented entry points (docs/elastic.md)
import the trainer, the resource-config loader and the device helpers from here. It sits
at the top of the layer table, beside `verl_hpc.api`, and nothing inside the package imports
it: the package's own code uses `verl_hpc.utils.devices`. The facade loads lazily, so this
module stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verl_hpc.config import load_resource_config
from verl_hpc.utils.devices import CUDA_HINT, get_gpu_usage, pin_to_device, visible_cuda_ids

if TYPE_CHECKING:
    from verl_hpc.api import HybridTrainer

__all__ = ["CUDA_HINT", "HybridTrainer", "get_gpu_usage", "load_resource_config", "pin_to_device",
           "visible_cuda_ids"]


def __getattr__(name: str) -> Any:
    if name == "HybridTrainer":  # the facade pulls in the launcher: load it only when asked for
        from verl_hpc.api import HybridTrainer

        return HybridTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
