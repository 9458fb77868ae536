"""LoRA (`model.lora`): adapters train, sync merged, checkpoint alone, survive kill -9, export both ways."""

from __future__ import annotations

import copy
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_cli
from tests.e2e.test_train_e2e import scalars
from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.schema import AlgorithmConfig, LoraConfig, OptimConfig
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.roles.actor import Actor, UpdatePlan
from verl_hpc.roles.lora import apply_lora
from verl_hpc.runtime.state.checkpointing import ModelState
from verl_hpc.transport.weights.views import merged_params

LORA = LoraConfig(rank=4, alpha=8.0)
VOLATILE = ("timing_s/", "perf/", "memory/")


def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def _inputs(rows: int = 6, prompt: int = 3, resp: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (rows, prompt + resp), generator=gen)
    mask = torch.ones(rows, resp)
    attention = torch.ones(rows, prompt + resp, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": torch.arange(prompt + resp).expand(rows, -1),
            "response_mask": mask, "advantages": torch.randn(rows, resp, generator=gen)}


def test_adapters_alone_train_and_the_first_step_is_the_base_models(tiny_model_dir: Path) -> None:
    plain, adapted = _model(tiny_model_dir), apply_lora(_model(tiny_model_dir), LORA, seed=0)
    ids = _inputs()["input_ids"]
    with torch.no_grad():  # B = 0: the adapted model starts exactly where the base model is
        assert torch.equal(plain(ids).logits, adapted(ids).logits)
    algo, optim = AlgorithmConfig(), OptimConfig(lr=1e-2)
    full, lora = Actor(plain, algo, optim, 1), Actor(adapted, algo, optim, 1)
    full_stats, lora_stats = full.update(_inputs(), UpdatePlan(6, 3, 1)), lora.update(_inputs(), UpdatePlan(6, 3, 1))
    for key in ("pg_loss", "entropy"):  # the same loss on the same weights; only the gradient's target differs
        assert lora_stats[key] == pytest.approx(full_stats[key], abs=1e-6), key
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(len(g["params"]) for g in lora.optimizer.param_groups) == len(trained)  # no state for the base
    state = ModelState(lora).state_dict()
    assert set(state["model"]) == trained  # the tied lm_head.weight (a frozen embedding) is left out too
    fresh = Actor(apply_lora(_model(tiny_model_dir), LORA, seed=5), algo, optim, 1)
    ModelState(fresh).load_state_dict(copy.deepcopy(state))
    with torch.no_grad():
        assert torch.equal(fresh.model(ids).logits, adapted(ids).logits)  # adapters + base = the trained model


def test_merged_weights_are_peft_merge(tiny_model_dir: Path) -> None:
    """The weights every engine gets: base + (alpha / r) B A under the base name, as peft's own merge."""
    model = apply_lora(_model(tiny_model_dir), LORA, seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.2)
    ours = dict(merged_params(model))
    reference = _model(tiny_model_dir)
    assert list(ours) == [n for n, _ in reference.named_parameters()]  # the plain architecture, in order
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_model = get_peft_model(_model(tiny_model_dir), PeftLoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear"))
    peft_model.base_model.model.load_state_dict({k: v for k, v in model.state_dict().items() if ".lora_" in k},
                                                strict=False)
    merged = dict(peft_model.merge_and_unload().named_parameters())
    for name, tensor in ours.items():
        assert torch.allclose(tensor, merged[name], atol=1e-6), name


def test_bad_lora_settings_are_one_line_naming_the_field(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        apply_lora(_model(tiny_model_dir), LoraConfig(rank=4, target_modules=["no_such_proj"]), seed=0)
    assert err.value.path == "model.lora.target_modules" and "no_such_proj" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/quickstart.yaml", ["model.lora.rank=0"])
    assert "model.lora.rank" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_lora_on_fsdp_ranks_survives_kill_9_and_exports_merged_and_adapter(tmp_path: Path,
                                                                         tiny_model_dir: Path) -> None:
    """Split placement, the actor FSDP2-sharded over 2 ranks: adapters in sharded DCP, rollouts merged."""
    args = ["configs/quickstart_split.yaml", f"model.path={tiny_model_dir}", "model.lora.rank=8",
            "model.lora.alpha=16", "checkpoint.interval_steps=4", "logging.progress=off"]
    whole = tmp_path / "whole"
    proc = run_cli("train", *args, "--run-dir", str(whole), "trainer.total_steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    interrupted = tmp_path / "interrupted"
    cli = subprocess.Popen([sys.executable, "-m", "verl_hpc", "train", *args, "--run-dir", str(interrupted),
                            "trainer.total_steps=400"], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    marker = interrupted / "checkpoints" / "step_00000008" / "manifest.json"
    deadline = time.monotonic() + 240
    while not marker.exists() and time.monotonic() < deadline and cli.poll() is None:
        time.sleep(0.2)
    os.kill(cli.pid, signal.SIGKILL)
    cli.wait()
    assert marker.exists()
    proc = run_cli("train", *args, "--run-dir", str(interrupted), "trainer.total_steps=10", "--allow-config-change")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, got = scalars(whole), scalars(interrupted)
    compared = [tag for tag in expected if not tag.startswith(VOLATILE)]
    assert len(compared) > 15 and len(got["critic/score/mean"]) == 10
    for tag in compared:
        assert got[tag] == expected[tag], tag  # bit for bit, step by step
    step_dir = interrupted / "checkpoints" / "step_00000010"
    checkpoint_bytes = sum(f.stat().st_size for f in step_dir.rglob("*.distcp"))
    model_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert checkpoint_bytes < model_bytes  # adapters and their AdamW state only, not the base weights

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for out, extra in ((merged, []), (adapter, ["--adapter"])):
        proc = run_cli("export", str(interrupted), str(out), *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    from peft import PeftModel

    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {name: model(ids).logits for name, model in (
            ("merged", _model(merged)), ("end of run", _model(interrupted / "hf_model")),
            ("peft", PeftModel.from_pretrained(_model(tiny_model_dir), adapter)), ("base", _model(tiny_model_dir)))}
    assert torch.equal(logits["merged"], logits["end of run"])
    assert torch.allclose(logits["merged"], logits["peft"], atol=1e-5)
    assert not torch.allclose(logits["merged"], logits["base"], atol=1e-3)  # it did train


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_colocated_vllm_samples_from_the_merged_adapters(tmp_path: Path) -> None:
    """vLLM holds the plain architecture: each sync must carry W + (alpha / r) B A, or the
    engine's probabilities of the sampled tokens drift from the trainer's LoRA model."""
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/quickstart_vllm.yaml", "--run-dir", str(run_dir), "model.lora.rank=8",
                   "trainer.total_steps=3", "logging.progress=off")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert [row["actor/policy_version"] for row in rows] == [1.0, 2.0, 3.0]
    assert rows[-1]["perf/weight_sync_bytes"] > 0
    assert rows[-1]["training/rollout_probs_diff_max"] < 1e-4  # sampled by the trained weights
