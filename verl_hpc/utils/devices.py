"""Device pinning and a GPU usage snapshot that never takes the job down.

Why here and small: every role calls `pin_to_device` once before building a model, and
the metrics loop calls `get_gpu_usage` every step. The first must fail loudly and early
(a CUDA config on a CPU node should not surface as an obscure error minutes later); the
second must never fail (a monitoring hiccup is not worth a lost training step).

torch loads on the first `pin_to_device`, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["CUDA_HINT", "get_gpu_usage", "pin_to_device", "visible_cuda_ids"]

CUDA_HINT = ("set device_type: cpu in the resources section (resources.device_type=cpu moves every role), "
             "or run on a GPU node (Slurm: --gres=gpu:N / gpus_per_node) with a CUDA build of torch")


def pin_to_device(device_type: str, device_ids: list[int] | None = None, local_rank: int = 0,
                  field: str = "device_type") -> torch.device:
    """The device this process computes on; for CUDA also made the current device.

    CUDA ids: `device_ids[local_rank]` when given, read as a physical GPU id if
    `CUDA_VISIBLE_DEVICES` lists it (Slurm and our launcher restrict visibility), else as
    a torch ordinal. Without ids: the only visible GPU when exactly one is visible (Slurm's
    `--gpus-per-task=1`), else ordinal `local_rank`. `field` names the config key in errors.
    """
    import torch

    if device_type == "cpu":
        return torch.device("cpu")
    if device_type != "cuda":
        raise RuntimeError(f"{field}: unknown device type {device_type!r} (hint: use cuda or cpu)")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (" (a CPU-only build)" if torch.version.cuda is None else "")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(f"{field}: 'cuda' requested but CUDA is not available here ({build}, "
                           f"CUDA_VISIBLE_DEVICES={visible!r}) (hint: {CUDA_HINT})")
    ordinal = _cuda_ordinal(device_ids, local_rank, torch.cuda.device_count(), field)
    torch.cuda.set_device(ordinal)
    return torch.device("cuda", ordinal)


def visible_cuda_ids(value: str | None = None) -> list[int] | None:
    """Integer ids in CUDA_VISIBLE_DEVICES; None when unset or not integers (UUIDs, MIG)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES") if value is None else value
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def _cuda_ordinal(device_ids: list[int] | None, local_rank: int, count: int, field: str) -> int:
    """Map the configured id (or the local rank) to a torch ordinal, or explain why not."""
    visible = visible_cuda_ids()
    if device_ids:
        ids_field = field.rsplit(".", 1)[0] + ".device_ids" if "." in field else "device_ids"
        if not 0 <= local_rank < len(device_ids):
            raise RuntimeError(f"{ids_field}: local rank {local_rank} has no entry in {device_ids} "
                               "(hint: list one device id per process on this node)")
        wanted = device_ids[local_rank]
        if visible is not None and wanted in visible:
            return visible.index(wanted)
        if wanted < count:
            return wanted
        raise RuntimeError(f"{ids_field}: GPU {wanted} is not visible; {count} GPU(s) are, "
                           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} "
                           "(hint: use ids that exist on this node)")
    if count == 1:
        return 0
    if local_rank < count:
        return local_rank
    raise RuntimeError(f"{field}: local rank {local_rank} but only {count} GPU(s) are visible "
                       "(hint: start at most one process per GPU)")


def get_gpu_usage() -> dict[str, Any]:
    """Per-GPU memory and utilisation from NVML; a labelled empty result when unavailable.

    Why NVML rather than torch.cuda: it sees other processes' memory (a vLLM engine in
    another process), and it needs no CUDA context. Indices are NVML's (physical), which
    ignore CUDA_VISIBLE_DEVICES; the uuid lets a reader match them. Never raises.
    """
    try:
        import pynvml
    except ImportError:
        return _unavailable("pynvml (nvidia-ml-py) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as err:
        return _unavailable(f"NVML could not start (no NVIDIA driver or GPU?): {err}")
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return _unavailable("NVML found no GPU")
        return {"available": True, "reason": None, "devices": [_device_usage(pynvml, i) for i in range(count)]}
    except Exception as err:
        return _unavailable(f"NVML query failed: {err}")
    finally:
        with contextlib.suppress(Exception):  # a failed shutdown changes nothing we report
            pynvml.nvmlShutdown()


def _device_usage(pynvml: Any, index: int) -> dict[str, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization: int | None = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # MIG slices and some vGPUs do not report utilisation
        utilization = None
    return {"index": index, "name": _text(pynvml.nvmlDeviceGetName(handle)),
            "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)), "memory_used_bytes": int(memory.used),
            "memory_total_bytes": int(memory.total), "utilization_percent": utilization}


def _text(value: str | bytes) -> str:
    """Old pynvml releases return bytes, new ones str."""
    return value.decode() if isinstance(value, bytes) else value


def _unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "reason": reason, "devices": []}
