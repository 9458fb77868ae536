"""`model.load: rank0`: one rank of a sharded group reads the weights; the others build on meta.

Real gloo processes. What must hold: every rank ends with exactly the weights, buffers and
tying a plain `from_pretrained` gives, and a non-first rank's memory grows by about its
shard, not by the whole model as when every rank reads it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_hpc.roles.loading import causal_lm_skeleton, is_skeleton, parameters_on_meta
from verl_hpc.runtime.process.env import free_port
from verl_hpc.utils.proc import exit_now


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _worker(rank: int, port: int, model_dir: str, out_dir: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from verl_hpc.roles.fsdp import shard_model
    from verl_hpc.roles.loading import GroupLoad
    from verl_hpc.runtime.build import load_causal_lm
    from verl_hpc.utils.dtensor import full_tensor

    group = dist.new_group([0, 1])
    causal_lm_skeleton(model_dir, torch.float32)  # imports and first-use allocations, before measuring
    before, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:  # the resident set's peak during the build (file pages read included)
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    load = GroupLoad(group, torch.device("cpu"), mode)
    model = causal_lm_skeleton(model_dir, torch.float32) if load.skeleton else load_causal_lm(model_dir, torch.float32)
    load.shard(model, lambda m: shard_model(m, group, "cpu"))
    done.set()
    sampler.join()
    grown = max(peak[0], _rss()) - before
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    out = {"params": {n: full_tensor(p.detach()) for n, p in model.named_parameters()},
           "buffers": {n: b.clone() for n, b in model.named_buffers()}, "grown": grown,
           "tied": model.lm_head.weight is model.model.embed_tokens.weight, "logits": model(ids).logits.detach()}
    torch.save(out, os.path.join(out_dir, f"{mode}{rank}.pt"))
    dist.destroy_process_group()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


def _spawn(model_dir: Path, out: Path, mode: str) -> list[dict]:
    mp.start_processes(_worker, args=(free_port(), str(model_dir), str(out), mode), nprocs=2,
                       start_method="spawn", join=True)
    return [torch.load(out / f"{mode}{rank}.pt", weights_only=True) for rank in (0, 1)]


def test_parameters_on_meta_keeps_buffers_real(tiny_model_dir: Path) -> None:
    model = causal_lm_skeleton(str(tiny_model_dir), torch.float32)
    assert is_skeleton(model) and all(p.is_meta for p in model.parameters())
    buffers = list(model.buffers())
    assert buffers and all(not b.is_meta for b in buffers)  # rotary tables: computed, not loaded
    with parameters_on_meta():
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.is_meta and not torch.nn.Linear(4, 4).weight.is_meta  # the patch is undone


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])  # tied head (Qwen2), untied (Llama)
def test_rank0_load_gives_every_rank_the_plain_weights(tmp_path: Path, preset: str) -> None:
    from verl_hpc.models.tiny import init_model
    from verl_hpc.runtime.build import load_causal_lm

    model_dir = init_model(tmp_path / preset, preset=preset, seed=3)
    plain = load_causal_lm(str(model_dir), torch.float32)
    ranks = _spawn(model_dir, tmp_path, "rank0")
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected_logits = plain(ids).logits
    tied = plain.lm_head.weight is plain.model.embed_tokens.weight
    for got in ranks:
        for name, param in plain.named_parameters():
            assert torch.equal(got["params"][name], param), name
        for name, buf in plain.named_buffers():
            assert torch.equal(got["buffers"][name], buf), name
        assert got["tied"] == tied
        assert torch.equal(got["logits"], expected_logits)


@pytest.mark.slow
def test_a_non_first_rank_holds_its_shard_not_the_model(tmp_path: Path) -> None:
    from verl_hpc.models.tiny import ModelPreset, build_model

    # Many mid-sized tensors (~150 MB, none over 3 MB): a shard is half the model, one tensor little.
    preset = ModelPreset(hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                         vocab_size=1024, tie_word_embeddings=False, family="llama")
    model = build_model(preset, 1024, pad_id=0, eos_id=1, seed=0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path / "model")
    every, rank0 = _spawn(tmp_path / "model", tmp_path, "every_rank"), _spawn(tmp_path / "model", tmp_path, "rank0")
    assert every[1]["grown"] >= 0.9 * model_bytes  # the baseline: a whole copy on every rank
    assert rank0[0]["grown"] >= 0.9 * model_bytes  # the first rank reads it, as before
    assert rank0[1]["grown"] <= 0.7 * model_bytes, (rank0[1]["grown"], model_bytes)  # its half, and one tensor
    for name, value in every[1]["params"].items():
        assert torch.equal(rank0[1]["params"][name], value), name
