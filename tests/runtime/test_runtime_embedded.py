"""The embedded runtime from Python: the `HybridTrainer` facade, reward models, batching equivalence."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO
from tests.grad_helpers import gradients_at_the_step
from verl_hpc import ConfigError, HybridTrainer
from verl_hpc.config import LoggingConfig, load_config
from verl_hpc.metrics import Emitter, Progress, open_sinks, read_jsonl_metrics
from verl_hpc.roles.actor import Actor, UpdatePlan


def quick_dict(model_dir: Path, steps: int = 3) -> dict:
    data = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    data["model"] = {"path": str(model_dir)}
    data["trainer"].update(total_steps=steps, batch_size=32)
    data["logging"] = {"progress": "off", "sample_every": 1}
    return data


def _emitter(run_dir: Path) -> Emitter:
    return Emitter(run_dir, "test", "trainer", 0)


def test_facade_with_model_object_and_reward_callable(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    calls: list[str] = []

    def reward(prompt: str, response: str, ground_truth: str, **_: object) -> float:
        calls.append(prompt)
        return float(len(response) % 2)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    result = HybridTrainer(actor_model=model, reward_model=reward, config=quick_dict(tiny_model_dir),
                           run_dir=tmp_path / "run").train()
    assert result.steps == 3 and len(calls) == 3 * 32
    rows = read_jsonl_metrics(tmp_path / "run" / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["critic/score/mean"] <= 1.0 for r in rows)
    # the trained object is the one saved: its weights moved, and the export holds them
    saved = AutoModelForCausalLM.from_pretrained(result.hf_model_dir)
    for (name, a), (_, b) in zip(model.state_dict().items(), saved.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_reward_model_scores_rollouts(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm_dir = tmp_path / "rm"
    Qwen2ForSequenceClassification(cfg).save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    data = quick_dict(tiny_model_dir, steps=2)
    data["reward"] = {"model_path": str(rm_dir)}
    result = HybridTrainer(config=data, run_dir=tmp_path / "run").train()
    scores = [r["critic/score/mean"] for r in read_jsonl_metrics(result.run_dir / "tensorboard" / "metrics.jsonl")]
    assert len(scores) == 2 and all(s not in (0.0, 1.0) for s in scores)  # real-valued model scores


def test_run_dir_is_never_overwritten(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A finished run is refused (nothing left to do, nothing rewritten), with or without resume."""
    data = quick_dict(tiny_model_dir, steps=1)
    HybridTrainer(config=data, run_dir=tmp_path / "run").train()
    before = (tmp_path / "run" / "tensorboard" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="run_dir"):
        HybridTrainer(config=data, run_dir=tmp_path / "run").train()
    assert (tmp_path / "run" / "tensorboard" / "metrics.jsonl").read_text() == before
    never = {**data, "checkpoint": {"resume": "never"}}
    with pytest.raises(ConfigError, match="run_dir"):
        HybridTrainer(config=never, run_dir=tmp_path / "run").train()
    assert (tmp_path / "run" / "tensorboard" / "metrics.jsonl").read_text() == before
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700


def updates_at_micro_sizes(model_dir: Path, cfg, inputs: dict[str, torch.Tensor],
                           sizes: tuple[int, ...] = (16, 4)) -> list[tuple[dict[str, float], dict[str, torch.Tensor]]]:
    """One actor update of a 16-row mini-batch per micro-batch size, from the same weights: (stats, grads)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    results = []
    for micro in sizes:
        model = copy.deepcopy(base)
        actor = Actor(model, cfg.algorithm, cfg.trainer.actor_optim, total_steps=1)
        grads = gradients_at_the_step(actor)
        stats = actor.update(dict(inputs), UpdatePlan(mini_batch_size=16, micro_batch_size=micro, epochs=1))
        assert grads, "the update stepped"
        results.append((stats, grads))
    return results



def _random_batch(model_dir: Path, rows: int = 16, resp: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(3, 60, (rows, 4 + resp))
    response_mask = (torch.arange(resp) < torch.randint(1, resp + 1, (rows, 1))).float()
    attention = torch.cat([torch.ones(rows, 4, dtype=torch.long), response_mask.long()], dim=1)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "response_mask": response_mask, "advantages": torch.randn(rows, resp) * response_mask,
            "ref_logprobs": -torch.rand(rows, resp) * 4}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_accumulate_to_the_same_update(tiny_model_dir: Path, agg: str) -> None:
    """Gradient accumulation over 4 micro-batches gives the full batch's gradient.

    Gradients, not weights, are compared: Adam's first step is ~lr*sign(g), so float noise
    on near-zero gradient entries may flip a sign without anything being wrong.
    """

    cfg = load_config(data={**quick_dict(tiny_model_dir), "algorithm": {"loss_agg_mode": agg}})
    inputs = _random_batch(tiny_model_dir)
    (s1, w1), (s2, w2) = updates_at_micro_sizes(tiny_model_dir, cfg, inputs)
    assert abs(s1["pg_loss"] - s2["pg_loss"]) < 1e-6 and abs(s1["grad_norm"] - s2["grad_norm"]) < 1e-5
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-6, rtol=1e-4), name


def test_multiple_minibatches_and_epochs_use_precomputed_old_logprobs(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = quick_dict(tiny_model_dir, steps=2)
    data["algorithm"].update(mini_batch_size=16, micro_batch_size=8, ppo_epochs=2)
    result = HybridTrainer(config=data, run_dir=tmp_path / "run").train()
    rows = read_jsonl_metrics(result.run_dir / "tensorboard" / "metrics.jsonl")
    assert all("timing_s/old_log_prob" in r for r in rows)
    assert all(r["actor/pg_clipfrac"] >= 0.0 for r in rows)


def test_metrics_logger_writes_tensorboard_and_jsonl(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = open_sinks(LoggingConfig(), _emitter(tmp_path), tmp_path)
    for step in (1, 2):
        logger.log_scalars(step, {"critic/score/mean": step / 10, "bad": float("nan")})
    logger.log_text(2, "samples", "hello")
    logger.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.value for e in acc.Scalars("critic/score/mean")] == pytest.approx([0.1, 0.2])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "critic/score/mean": 0.1}, {"step": 2, "critic/score/mean": 0.2}]


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path: Path) -> None:
    """A disk that filled (or a kill) mid-line leaves half a JSON row; the resumed run must not trip on it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a": 3')
    assert [r["step"] for r in read_jsonl_metrics(path)] == [1, 2]
    logger = open_sinks(LoggingConfig(tensorboard=False), _emitter(tmp_path), tmp_path, purge_step=3)  # after step 2
    logger.log_scalars(3, {"a": 3.5})
    logger.close()
    assert read_jsonl_metrics(path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}, {"step": 3, "a": 3.5}]


def test_progress_prints_plain_lines_off_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(total=3, mode="auto", every_seconds=0.0, stream=stream)
    for step in (1, 2, 3):
        progress.update(step, {"critic/score/mean": 0.5})
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("[train] step 3/3") and "score/mean=0.5" in lines[-1]


def test_a_stop_signal_during_the_last_step_finishes_the_run(tmp_path: Path, tiny_model_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is left to resume, so the run completes (HF export included) instead of asking for a restart."""
    import os
    import signal

    from verl_hpc.runtime.step.loop import RLTrainer

    trainer = HybridTrainer(config=quick_dict(tiny_model_dir, steps=2), run_dir=tmp_path / "run")
    inner = RLTrainer.train_step

    def step_then_signal(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # what Slurm sends ahead of the time limit
        return out

    monkeypatch.setattr(RLTrainer, "train_step", step_then_signal)
    result = trainer.train()
    assert result.stopped_by is None and result.steps == 2
    assert result.hf_model_dir is not None and (result.hf_model_dir / "config.json").is_file()
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "manifest.json").is_file()
