"""Device pinning and the GPU usage snapshot, on whatever machine the tests run on."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from verl_hpc.utils import devices as resource
from verl_hpc.utils.devices import get_gpu_usage, pin_to_device, visible_cuda_ids

requires_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_cpu_is_cpu() -> None:
    assert pin_to_device("cpu") == torch.device("cpu")
    assert pin_to_device("cpu", device_ids=[0, 1], local_rank=1) == torch.device("cpu")


@requires_no_cuda
def test_cuda_without_gpu_names_field_and_hint() -> None:
    with pytest.raises(RuntimeError, match=r"actor\.device_type: 'cuda' requested.*hint: set device_type: cpu"):
        pin_to_device("cuda", device_ids=[0], field="actor.device_type")
    with pytest.raises(RuntimeError, match="device_type"):
        pin_to_device("cuda")


def test_unknown_device_type() -> None:
    with pytest.raises(RuntimeError, match="unknown device type 'tpu'"):
        pin_to_device("tpu")


def test_cuda_ordinal_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids are physical when CUDA_VISIBLE_DEVICES lists them, else torch ordinals."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert resource._cuda_ordinal([2, 3], 1, 2, "device_type") == 1
    assert resource._cuda_ordinal([0, 1], 1, 2, "device_type") == 1
    assert resource._cuda_ordinal(None, 1, 2, "device_type") == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # Slurm --gpus-per-task=1
    assert resource._cuda_ordinal(None, 3, 1, "device_type") == 0
    with pytest.raises(RuntimeError, match=r"rollout\.device_ids: GPU 7 is not visible"):
        resource._cuda_ordinal([7], 0, 1, "rollout.device_type")
    with pytest.raises(RuntimeError, match="local rank 2 has no entry"):
        resource._cuda_ordinal([0, 1], 2, 2, "device_type")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match="only 2 GPU"):
        resource._cuda_ordinal(None, 2, 2, "device_type")


def test_visible_cuda_ids() -> None:
    assert visible_cuda_ids("0,2") == [0, 2]
    assert visible_cuda_ids("GPU-1234,GPU-5678") is None
    assert visible_cuda_ids("") == []


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None and torch.cuda.is_available(),
                    reason="a real GPU is visible through NVML")
def test_gpu_usage_is_labelled_empty_without_gpu() -> None:
    usage = get_gpu_usage()
    assert usage["available"] is False
    assert usage["devices"] == []
    assert isinstance(usage["reason"], str) and usage["reason"]


def test_gpu_usage_never_raises_when_nvml_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    class BrokenNvml:
        @staticmethod
        def nvmlInit() -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setitem(sys.modules, "pynvml", BrokenNvml)
    usage = get_gpu_usage()
    assert usage["available"] is False and "NVML could not start" in usage["reason"]


def test_gpu_usage_reports_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    class Memory:
        used, total = 3 << 30, 80 << 30

    class Rates:
        gpu = 57

    class FakeNvml:
        shut = False

        nvmlInit = staticmethod(lambda: None)
        nvmlDeviceGetCount = staticmethod(lambda: 2)
        nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
        nvmlDeviceGetMemoryInfo = staticmethod(lambda h: Memory)
        nvmlDeviceGetName = staticmethod(lambda h: b"NVIDIA H200")
        nvmlDeviceGetUUID = staticmethod(lambda h: f"GPU-{h}")

        @staticmethod
        def nvmlDeviceGetUtilizationRates(handle: int) -> type[Rates]:
            if handle == 1:
                raise RuntimeError("Not Supported")  # e.g. a MIG slice
            return Rates

        @classmethod
        def nvmlShutdown(cls) -> None:
            cls.shut = True

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml)
    usage = get_gpu_usage()
    assert usage["available"] is True and FakeNvml.shut
    assert usage["devices"][0] == {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-0",
                                   "memory_used_bytes": 3 << 30, "memory_total_bytes": 80 << 30,
                                   "utilization_percent": 57}
    assert usage["devices"][1]["utilization_percent"] is None
