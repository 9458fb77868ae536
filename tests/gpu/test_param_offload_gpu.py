"""`model.param_offload` on a GPU, where it frees memory: run on the device machine, skipped elsewhere.

Why here: offload moves weights between host and device memory, and only a device shows
the saving — `torch.cuda.memory_allocated` falls by the weights' bytes between passes —
and only FSDP2's `CPUOffloadPolicy` on a CUDA mesh exercises the sharded path.
"""

from __future__ import annotations

import copy
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.gpu.test_gpu_paths import ON_GPU, _logs, _metrics
from tests.roles.test_param_offload import ppo_with_and_without_offload
from verl_hpc.roles.forward import response_logprobs
from verl_hpc.roles.offload import ParamOffload

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _inputs(device: torch.device, vocab: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(1, vocab, (4, 12), device=device)
    mask = torch.ones_like(ids)
    response_mask = torch.ones(4, 5, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
            "response_mask": response_mask, "responses": ids[:, -5:]}


def _causal_lm(path: Path, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).to(device).eval().requires_grad_(False)


def test_an_offloaded_ref_frees_its_weights_between_passes_and_computes_the_same(tiny_model_dir: Path) -> None:
    device = torch.device("cuda", 0)
    plain, ref = _causal_lm(tiny_model_dir, device), _causal_lm(tiny_model_dir, device)
    weights = sum(p.numel() * p.element_size() for p in ref.parameters())
    inputs = _inputs(device, ref.config.vocab_size)
    # The reference pass first: the first matmul allocates cuBLAS's workspace through the caching
    # allocator (32 MiB on Hopper, counted by memory_allocated and kept), which would otherwise
    # land between the two readings below and hide the weights' bytes.
    with torch.no_grad():
        want = response_logprobs(plain, inputs, 1.0)[0]
    before = torch.cuda.memory_allocated(device)
    offload = ParamOffload(ref, device, True, name="ref")
    freed = before - torch.cuda.memory_allocated(device)
    assert offload.active and freed >= 0.9 * weights, (freed, weights)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in ref.parameters())
    with torch.no_grad(), offload.resident():
        assert all(p.device == device for p in ref.parameters())
        got = response_logprobs(ref, inputs, 1.0)[0]
    assert torch.equal(got, want)
    assert torch.cuda.memory_allocated(device) <= before - 0.9 * weights  # gone again after the pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_sharded_offloaded_ref_keeps_its_shards_in_host_memory(tiny_model_dir: Path) -> None:
    from torch.distributed.tensor import DTensor

    from verl_hpc.roles.fsdp import shard_model

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        plain = _causal_lm(tiny_model_dir, device)
        ref = shard_model(copy.deepcopy(plain), dist.group.WORLD, "cuda", offload=True)
        assert all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in ref.parameters())
        inputs = _inputs(device, plain.config.vocab_size)
        with torch.no_grad():
            got, want = response_logprobs(ref, inputs, 1.0)[0], response_logprobs(plain, inputs, 1.0)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_a_ppo_run_on_cuda_with_ref_and_critic_offload_matches_one_without(tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    runs = ppo_with_and_without_offload(tmp_path, f"model.path={tiny_model_dir}", "trainer.total_steps=6",
                                        "logging.progress=off", "model.mixed_precision=none", *ON_GPU)
    assert "offloaded to host memory between passes" in _logs(runs["offload"])
    plain, offloaded = _metrics(runs["plain"]), _metrics(runs["offload"])
    for a, b in zip(plain, offloaded, strict=True):
        for key in ("critic/score/mean", "critic/vf_loss", "actor/pg_loss", "actor/kl"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
