"""`model.mixed_precision`: bf16 compute by default where the device has it, fp32 master weights.

A CPU has no native bf16 here, so `auto` must leave every CPU number the fp32 one; explicit
bf16 compute (autocast on a lone rank) runs on CPU too, which is how the GPU-only resolution
is exercised without a GPU. tests/gpu runs it on CUDA when a GPU is lent.
"""

from __future__ import annotations

import pytest
import torch

from tests.roles.test_chunked_logprobs import inputs, tiny
from verl_hpc.config import ConfigError
from verl_hpc.config.loader import load_config
from verl_hpc.roles.forward import response_logprobs
from verl_hpc.roles.precision import autocast_forward, compute_dtype, native_bf16

CPU = torch.device("cpu")


def test_auto_is_fp32_on_cpu_and_explicit_settings_are_kept() -> None:
    assert not native_bf16(CPU)
    assert compute_dtype("auto", CPU) is None
    assert compute_dtype("none", CPU) is None
    assert compute_dtype("bfloat16", CPU) is torch.bfloat16 and compute_dtype("float16", CPU) is torch.float16
    if torch.cuda.is_available():
        gpu = torch.device("cuda", 0)
        assert compute_dtype("auto", gpu) is (torch.bfloat16 if torch.cuda.is_bf16_supported() else None)


def test_the_default_is_auto_and_a_cpu_config_takes_it() -> None:
    cfg = load_config("configs/quickstart.yaml")
    assert cfg.model.mixed_precision == "auto"
    with pytest.raises(ConfigError, match=r"model\.mixed_precision: bfloat16 compute is for GPUs"):
        load_config("configs/quickstart.yaml", overrides=["model.mixed_precision=bfloat16"])


def test_auto_on_cpu_keeps_the_fp32_numbers_bit_for_bit() -> None:
    batch = inputs()
    plain = response_logprobs(tiny(), batch, 1.0)[0]
    model = tiny()
    autocast_forward(model, compute_dtype("auto", CPU))
    assert torch.equal(response_logprobs(model, batch, 1.0)[0], plain)


@pytest.mark.parametrize("chunk", [0, 7])  # the whole head, and the chunked head outside autocast
def test_autocast_computes_in_bf16_and_keeps_fp32_weights_and_gradients(chunk: int) -> None:
    batch = inputs()
    reference = tiny()
    want = response_logprobs(reference, batch, 1.0, chunk_tokens=chunk)[0]
    model = tiny()
    keys = list(model.state_dict())
    autocast_forward(model, torch.bfloat16)
    assert model(input_ids=batch["input_ids"]).logits.dtype == torch.bfloat16
    logprobs = response_logprobs(model, batch, 1.0, chunk_tokens=chunk)[0]
    assert not torch.is_autocast_enabled("cpu")  # switched off again after the forward
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, want, atol=0.1, rtol=0.05)  # bf16 compute: close, not equal
    assert not torch.equal(logprobs, want)
    (logprobs * batch["response_mask"]).sum().backward()
    assert list(model.state_dict()) == keys  # checkpoints and exports see the bare model
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in model.parameters() if p.requires_grad)


def test_a_forward_that_raises_leaves_autocast_off() -> None:
    model = autocast_forward(tiny(), torch.bfloat16)
    with pytest.raises(IndexError):
        model(input_ids=torch.full((1, 3), 10_000))  # an id past the vocab
    assert not torch.is_autocast_enabled("cpu")
