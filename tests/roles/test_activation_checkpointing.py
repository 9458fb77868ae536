"""`model.gradient_checkpointing`: each decoder layer recomputed in backward, same gradients.

(With FSDP2 over two processes: tests/transport/test_dist_sync.py, the gradient_checkpointing case.)
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from tests.roles.test_chunked_logprobs import EOS, PAD, VOCAB, inputs
from verl_hpc.models.tiny import PRESETS, build_model
from verl_hpc.roles.critic import ValueModel
from verl_hpc.roles.forward import response_logprobs
from verl_hpc.roles.fsdp import (
    ActivationCheckpointingError,
    activation_checkpointing_on,
    checkpoint_activations,
)
from verl_hpc.roles.rollout.hf import HFRolloutEngine


def tiny(preset: str = "tiny") -> torch.nn.Module:
    return build_model(PRESETS[preset], VOCAB, PAD, EOS, seed=0)


def loss_and_saved(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Every parameter's gradient of an actor-like loss, and the elements autograd kept for it."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel()
        return tensor

    model.train()
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, entropy = response_logprobs(model, batch, 0.9, with_entropy=True)
    mask = batch["response_mask"]
    ((logprobs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    return {n: p.grad for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_recomputed_layers_give_the_same_gradients_and_keep_less(preset: str) -> None:
    batch = inputs(rows=6, response=12)
    kept_grads, kept = loss_and_saved(tiny(preset), batch)
    recomputed_grads, recomputed = loss_and_saved(checkpoint_activations(tiny(preset)), batch)
    for name, grad in kept_grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert recomputed < kept / 2, (recomputed, kept)  # layer inputs only, not every intermediate


def test_value_model_backbone_is_switched() -> None:
    backbone = build_model(PRESETS["tiny"], VOCAB, PAD, EOS, seed=0).model
    critic = checkpoint_activations(ValueModel(backbone, backbone.config.hidden_size))
    assert activation_checkpointing_on(critic)
    values = critic(inputs())
    values.sum().backward()
    assert critic.value_head.weight.grad is not None and backbone.embed_tokens.weight.grad is not None


def test_generation_is_untouched() -> None:
    """The rollout shares the actor's module: the same samples, and the actor's mode put back."""
    from types import SimpleNamespace

    from verl_hpc.config.schema import SamplingConfig

    tokens = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    sampling = SamplingConfig(n=1, max_new_tokens=6)
    prompts = [[5, 6, 7, 8], [9, 10]]
    switched_model = checkpoint_activations(tiny())
    switched_model.train()  # as the actor leaves it after an update
    answers = []
    for model in (tiny(), switched_model):
        torch.manual_seed(4)
        answers.append(HFRolloutEngine(model, tokens).generate(prompts, sampling))
    assert answers[0].response_ids == answers[1].response_ids
    assert answers[0].logprobs == answers[1].logprobs
    assert switched_model.training


def test_a_model_without_per_layer_checkpointing_is_refused_naming_the_field() -> None:
    with pytest.raises(ActivationCheckpointingError, match="model.gradient_checkpointing"):
        checkpoint_activations(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_ppo_run_with_the_memory_switches_matches_the_plain_run(tmp_path, tiny_model_dir) -> None:
    """`verl-hpc train`'s entry point, PPO: actor and critic recomputed, log-probs chunked small,
    micro-batches by a token budget; every step's metrics match the run with all three off."""
    from tests.runtime.test_runtime_embedded import quick_dict
    from verl_hpc.config import load_config
    from verl_hpc.launch.train import train
    from verl_hpc.metrics import read_jsonl_metrics

    runs = []
    for name, model in (("plain", {"gradient_checkpointing": False, "logprob_chunk_tokens": 0}),
                        ("switched", {"gradient_checkpointing": True, "logprob_chunk_tokens": 5})):
        data = quick_dict(tiny_model_dir, steps=2)
        data["model"].update(model)
        data["algorithm"]["name"] = "ppo"
        if name == "switched":  # a budget of a few rows: many micro-batches where the plain run has one
            data["algorithm"].update(use_dynamic_bsz=True, max_token_len_per_gpu=150)
        data["trainer"]["save_hf_model"] = False
        result = train(load_config(data=data), tmp_path / name)
        runs.append(read_jsonl_metrics(result.run_dir / "tensorboard" / "metrics.jsonl"))
    plain, switched = runs
    assert [r["step"] for r in switched] == [r["step"] for r in plain] == [1, 2]
    for before, after in zip(plain, switched, strict=True):
        for key in ("actor/pg_loss", "actor/entropy", "critic/vf_loss", "critic/score/mean"):
            assert after[key] == pytest.approx(before[key], rel=1e-4, abs=1e-5), key


class _NewApiModel(torch.nn.Module):
    """Only transformers 5.20+'s names: `checkpoint_activations` must call them, not the old ones."""

    supports_gradient_checkpointing = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        self.calls.append(activation_checkpointing_kwargs)

    @property
    def is_activation_checkpointing(self) -> bool:
        return bool(self.calls)

    def gradient_checkpointing_enable(self, **_):
        raise AssertionError("the deprecated name was called")


def test_the_current_transformers_api_is_used_where_it_exists() -> None:
    model = _NewApiModel()
    assert not activation_checkpointing_on(model)
    checkpoint_activations(model)
    assert model.calls == [{"use_reentrant": False}]
    assert activation_checkpointing_on(model)
