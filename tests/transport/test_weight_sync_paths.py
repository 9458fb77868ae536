"""The copy-free weight-sync paths deliver exactly the sender's weights, and fall back when they must.

In place: an HF engine's parameters become views of one flat buffer and every later sync
lands in that same memory (no new tensors, nothing unpacked). Fallbacks: a consumer that
keeps every tensor (vLLM's loader) gets fresh, still-valid buckets; a bfloat16 receiver
gets the cast; a sender whose parameters lie back to back sends views; a bfloat16
sender casts on the way out. All bit for bit, both between a pair and to two receivers
(bucketed broadcasts, packing included).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.models.tiny import PRESETS, build_model
from verl_hpc.transport.weights.bucketed import _buckets, _pack
from verl_hpc.transport.weights.flat import flat_view, flatten_params, same_memory
from verl_hpc.utils.proc import exit_now

BUCKET = 4096  # bytes: many buckets (several packed ones) even for the tiny model


def _model(seed: int, preset: str = "tiny") -> torch.nn.Module:
    spec = PRESETS[preset]
    return build_model(spec, spec.vocab_size, pad_id=0, eos_id=1, seed=seed)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_flat_view_only_for_back_to_back_float32() -> None:
    flat = torch.arange(10, dtype=torch.float32)
    parts = [flat[0:4].view(2, 2), flat[4:7], flat[7:10]]
    view = flat_view(parts)
    assert view is not None and view.data_ptr() == flat.data_ptr() and torch.equal(view, flat)
    assert flat_view(parts[1:]) is not None and flat_view(parts[1:]).data_ptr() == parts[1].data_ptr()
    assert flat_view([parts[0], parts[2]]) is None  # a gap
    assert flat_view([parts[1], parts[0]]) is None  # out of order
    assert flat_view([torch.zeros(3), torch.zeros(3)]) is None  # two storages
    assert flat_view([flat.double()]) is None  # not the wire dtype
    assert flat_view([torch.zeros(3, 4).t()]) is None  # not contiguous


def test_flatten_params_keeps_values_and_ties_and_is_idempotent() -> None:
    model = _model(0, "tiny")
    before = _weights(model)
    params_before = list(model.parameters())
    flat = flatten_params(model)
    assert flat is not None and flat.numel() == sum(p.numel() for p in model.parameters())
    assert list(model.parameters()) == params_before  # same Parameter objects, new storage
    offset = 0
    for name, param in model.named_parameters():
        assert param.data_ptr() == flat.data_ptr() + offset * 4, name
        assert torch.equal(param, before[name]), name
        offset += param.numel()
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied weights stay tied
    again = flatten_params(model)
    assert again is not None and again.data_ptr() == flat.data_ptr()  # already flat: nothing moves
    half = _model(0).to(torch.bfloat16)
    ptrs = [p.data_ptr() for p in half.parameters()]
    assert flatten_params(half) is None and [p.data_ptr() for p in half.parameters()] == ptrs


def test_buckets_cover_in_order_and_send_large_params_alone() -> None:
    sizes = [("a", 100), ("b", 3000), ("c", 8), ("d", 2048), ("e", 900), ("f", 5000), ("g", 4)]
    buckets = _buckets(sizes, BUCKET)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for bucket in buckets:
        total = sum(sizes[i][1] for i in bucket)
        assert total <= BUCKET or len(bucket) == 1
        if any(2 * sizes[i][1] >= BUCKET for i in bucket):
            assert len(bucket) == 1  # half a bucket or more: sent as its own tensor, never copied
    assert _buckets([], BUCKET) == []


def test_pack_casts_and_handles_non_contiguous_into_the_buffer_front() -> None:
    buffer = torch.full((32,), -1.0)
    a, b = torch.randn(3, 4).t(), torch.randn(5, dtype=torch.float64)
    packed = _pack([a, b], buffer)
    assert packed.data_ptr() == buffer.data_ptr() and packed.numel() == 17
    assert torch.equal(packed, torch.cat([a.reshape(-1), b.float()]))
    assert torch.equal(buffer[17:], torch.full((15,), -1.0))


class _KeepAll:
    """A consumer like vLLM's loader: keeps every tensor until the last bucket has landed."""

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor] = {}
        self.policy_version = 0

    def load_weights(self, named_tensors, version: int) -> None:
        self.kept = dict(named_tensors)
        self.policy_version = version


def _sender(model: torch.nn.Module, out: Path) -> None:
    from verl_hpc.transport.weights.bucketed import STOP_VERSION, broadcast_weights

    world = dist.group.WORLD
    sent = []
    for version in (1, 2, 3, 4):  # in place twice, keep-all, bfloat16 receiver
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.125 * version)  # every sync carries different weights
        broadcast_weights(model, world, 0, version, True, bucket_bytes=BUCKET)
        sent.append(_weights(model))
    flatten_params(model)  # a sender whose parameters lie back to back: buckets go out as views
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-1.5)
    broadcast_weights(model, world, 0, 5, True, bucket_bytes=BUCKET)
    sent.append(_weights(model))
    model.to(torch.bfloat16)  # a bfloat16 sender: cast on the way out (big tensors without a kept buffer)
    broadcast_weights(model, world, 0, 6, True, bucket_bytes=BUCKET)
    sent.append(_weights(model))
    broadcast_weights(model, world, 0, STOP_VERSION, True, bucket_bytes=BUCKET)
    torch.save(sent, out / "sent.pt")


def _receiver(out: Path) -> None:
    from verl_hpc.roles.rollout.hf import HFRolloutEngine
    from verl_hpc.transport.weights.bucketed import (
        STOP_VERSION,
        broadcast_weights,
        engine_buffer,
        push_weights,
        receive_weights,
    )

    world = dist.group.WORLD
    engine = HFRolloutEngine(_model(1), SimpleNamespace(pad_token_id=0, eos_token_id=1))
    got, ptrs, landed_in_place = [], [], []
    for _ in range(2):
        buffer = engine_buffer(engine)
        version, tensors = receive_weights(engine.weight_specs(), world, 0, BUCKET, into=buffer)
        params = dict(engine.model.named_parameters())
        received = list(tensors)  # every yielded tensor must already be the engine's own memory
        landed_in_place.append(all(same_memory(params[name], t) for name, t in received))
        push_weights(iter(received), engine, version)
        got.append((version, _weights(engine.model)))
        ptrs.append([p.data_ptr() for p in engine.model.parameters()] + [buffer.data_ptr()])
    keeper = _KeepAll()
    version, tensors = receive_weights(engine.weight_specs(), world, 0, BUCKET)
    push_weights(tensors, keeper, version)
    got.append((version, {n: t.clone() for n, t in keeper.kept.items()}))
    half = _model(2).to(torch.bfloat16)
    got.append((broadcast_weights(half, world, 0, -1, False, bucket_bytes=BUCKET)[0], _weights(half)))
    plain = _model(3)
    got.append((broadcast_weights(plain, world, 0, -1, False, bucket_bytes=BUCKET)[0], _weights(plain)))
    got.append((broadcast_weights(plain, world, 0, -1, False, bucket_bytes=BUCKET)[0], _weights(plain)))
    version, tensors = receive_weights(engine.weight_specs(), world, 0, BUCKET, into=engine_buffer(engine))
    assert version == STOP_VERSION and list(tensors) == []
    params = dict(engine.model.named_parameters())
    in_place = all(same_memory(params[n], t) for n, t in keeper.kept.items())
    torch.save({"got": got, "ptrs": ptrs, "landed_in_place": landed_in_place, "keeper_in_engine": in_place},
               out / f"got{dist.get_rank()}.pt")


def _worker(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'init')}", rank=rank, world_size=world)
    try:
        _sender(_model(0), Path(out)) if rank == 0 else _receiver(Path(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3], ids=["pair", "broadcast-to-two"])
def test_in_place_and_fallback_syncs_are_bit_exact(tmp_path: Path, world: int) -> None:
    mp.start_processes(_worker, args=(world, str(tmp_path)), nprocs=world, start_method="spawn", join=True)
    sent = torch.load(tmp_path / "sent.pt", weights_only=True)
    for rank in range(1, world):
        _check_receiver(sent, torch.load(tmp_path / f"got{rank}.pt", weights_only=True))


def _check_receiver(sent: list[dict[str, torch.Tensor]], result: dict) -> None:
    assert [version for version, _ in result["got"]] == [1, 2, 3, 4, 5, 6]
    for k, (_, weights) in enumerate(result["got"]):
        for name, value in sent[k].items():
            expected = value.to(torch.bfloat16) if k == 3 else value.float()  # bf16 -> fp32 is exact
            assert weights[name].dtype == expected.dtype and torch.equal(weights[name], expected), (k, name)
    # Both in-place syncs were received straight into the engine's parameters (nothing to
    # unpack), and the second into the very memory of the first: no tensor was replaced.
    assert result["landed_in_place"] == [True, True]
    assert result["ptrs"][0] == result["ptrs"][1]
    assert not result["keeper_in_engine"]  # without a buffer the consumer got memory of its own
