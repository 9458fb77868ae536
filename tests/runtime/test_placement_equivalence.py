"""A placement never changes the numbers: recorded rollouts replayed through every placement.

One one-process run records the responses it trained on (`data.record_rollouts`); every
placement then replays them (`data.replay_rollouts`), so sampling noise is out and what
is left — scores, reference and old logprobs, values, advantages, losses, optimizer steps,
weight syncs — must agree within 1e-5 at every step and in the final weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_hpc.config import load_config
from verl_hpc.launch.train import train
from verl_hpc.metrics import read_jsonl_metrics

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5
COMMON_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac",
               "critic/advantages/mean", "critic/returns/mean", "critic/score/mean")
PPO_KEYS = ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/rewards/mean")

PLACEMENTS: dict[str, dict[str, Any]] = {
    "one process": {"actor": {"device_ids": [0]}, "placement": "colocated"},
    "colocated on 2": {"actor": {"device_ids": [0, 1], "strategy": "fsdp"}, "placement": "colocated"},
    "split 2 + 1": {"actor": {"device_ids": [0, 1], "strategy": "fsdp"}, "rollout": {"device_ids": [2]},
                    "placement": "split"},
    "split, ref on its own": {"actor": {"device_ids": [0, 1], "strategy": "fsdp"}, "rollout": {"device_ids": [2]},
                              "ref": {"device_ids": [3], "strategy": "fsdp"}, "placement": "split"},
}
CRITIC_AND_REF_GROUPS = {"actor": {"device_ids": [0, 1], "strategy": "fsdp"}, "rollout": {"device_ids": [2]},
                         "critic": {"device_ids": [3, 4], "strategy": "fsdp"},
                         "ref": {"device_ids": [5], "strategy": "fsdp"}, "placement": "split"}
REWARD_GROUP = {"actor": {"device_ids": [0, 1], "strategy": "fsdp"}, "rollout": {"device_ids": [2]},
                "reward": {"device_ids": [3], "strategy": "hf"}, "placement": "split"}


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("rm") / "rm"
    Qwen2ForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def base_config(model_dir: Path, algorithm: dict[str, Any], reward: dict[str, Any], steps: int) -> dict[str, Any]:
    return {
        "model": {"path": str(model_dir)},
        "data": {"task": {"name": "arithmetic", "num_prompts": 64, "max_operand": 4, "seed": 0}},
        "reward": reward,
        "algorithm": {"sampling": {"n": 4, "max_new_tokens": 4}, "kl": {"estimator": "k3", "coef": 0.1},
                      "ppo_epochs": 2, "mini_batch_size": 8, "entropy_coef": 0.01, **algorithm},
        "trainer": {"total_steps": steps, "batch_size": 16, "seed": 0, "torch_threads": 1,
                    # AdamW moves a weight by lr * m / (sqrt(v) + eps): a gradient error d moves it by up
                    # to lr / eps * d. With the default eps (1e-8) that is 1e5 * d, and a 2-layer model has
                    # weights whose gradient is mostly rounding (~1e-10): one rank's matmul and two ranks'
                    # reduce-scatter round differently, and such a weight ended 1.3e-5 (GRPO) or, at eps
                    # 1e-6, 6.5e-5 (PPO) apart after 12 steps while every loss agreed to 1e-6. eps = lr
                    # bounds the amplification by 1, so the final weights compare the placements, not how
                    # far AdamW magnifies the last bit of a near-zero gradient.
                    "actor_optim": {"lr": 1e-3, "eps": 1e-3}, "critic_optim": {"lr": 1e-3, "eps": 1e-3}},
        "resources": {"actor": {"device_ids": [0]}, "placement": "colocated", "timeout_seconds": 120},
        "logging": {"progress": "off", "num_samples": 0},
    }


def run(data: dict[str, Any], run_dir: Path, resources: dict[str, Any] | None = None, **data_keys: Any) -> Path:
    data = copy.deepcopy(data)
    if resources is not None:
        data["resources"] = {**data["resources"], **copy.deepcopy(resources)}
    data["data"].update(data_keys)
    result = train(load_config(data=data), run_dir)
    assert result.stopped_by is None and result.steps == data["trainer"]["total_steps"], result
    return run_dir


def rows(run_dir: Path) -> list[dict[str, float]]:
    return read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "hf_model" / "model.safetensors")


def assert_same_numbers(reference: Path, other: Path, keys: tuple[str, ...], label: str) -> None:
    ref_rows, other_rows = rows(reference), rows(other)
    assert [r["step"] for r in ref_rows] == [r["step"] for r in other_rows], label
    for a, b in zip(ref_rows, other_rows, strict=True):
        for key in keys:
            if key in a or key in b:
                assert key in a and key in b, f"{label}: step {a['step']} {key} missing on one side"
                assert abs(a[key] - b[key]) <= TOLERANCE * max(1.0, abs(a[key])), \
                    f"{label}: step {a['step']} {key}: {a[key]} vs {b[key]}"
    # The engine's probabilities of its samples are the trainer's (replayed: the recorded run's).
    assert all(r["training/rollout_probs_diff_max"] < 1e-4 for r in other_rows), label
    ref_w, other_w = final_weights(reference), final_weights(other)
    assert ref_w.keys() == other_w.keys()
    worst = max(float((ref_w[k] - other_w[k]).abs().max()) for k in ref_w)
    assert worst <= TOLERANCE, f"{label}: final weights differ by {worst}"


def replay_everywhere(tmp_path: Path, data: dict[str, Any], keys: tuple[str, ...],
                      placements: dict[str, dict[str, Any]]) -> None:
    recorded = run(data, tmp_path / "recorded", record_rollouts=True)
    replay_dir = str(recorded / "rollouts")
    results = {name: run(data, tmp_path / name.replace(" ", "_").replace(",", ""), resources,
                         replay_rollouts=replay_dir) for name, resources in placements.items()}
    reference = results.pop("one process")
    assert_same_numbers(recorded, reference, keys, "one process, sampled vs replayed")
    for name, run_dir in results.items():
        assert_same_numbers(reference, run_dir, keys, name)


def test_grpo_with_a_reward_model_agrees_on_every_placement(tmp_path: Path, tiny_model_dir: Path,
                                                             reward_model_dir: Path) -> None:
    data = base_config(tiny_model_dir, {"name": "grpo"}, {"model_path": str(reward_model_dir)}, steps=3)
    replay_everywhere(tmp_path, data, COMMON_KEYS, {**PLACEMENTS, "split, reward model on its own": REWARD_GROUP})
    kl = [r["actor/kl_loss"] for r in rows(tmp_path / "split_ref_on_its_own")]
    assert kl[1] > 0.0 and kl[2] > 0.0  # the ref group serves the KL once the actor has moved


def test_a_tiny_llama_agrees_on_every_placement(tmp_path: Path) -> None:
    """A second architecture (no attention biases, an untied head) through the same placements."""
    from verl_hpc.models.tiny import init_model

    model = init_model(tmp_path / "llama", preset="tiny-llama", seed=0)
    data = base_config(model, {"name": "grpo"}, {"function": "verl_hpc.data.tasks.arithmetic:score"}, steps=3)
    replay_everywhere(tmp_path, data, COMMON_KEYS, PLACEMENTS)


@pytest.mark.parametrize("in_reward", [False, True], ids=["kl_loss", "kl_in_reward"])
def test_ppo_agrees_on_every_placement(tmp_path: Path, tiny_model_dir: Path, in_reward: bool) -> None:
    algorithm = {"name": "ppo", "critic_warmup_steps": 2, "kl": {"estimator": "k3", "coef": 0.1,
                                                                 "in_reward": in_reward}}
    data = base_config(tiny_model_dir, algorithm, {"function": "verl_hpc.data.tasks.arithmetic:score"}, steps=4)
    # At lr 1e-3 a few tokens reach the clip boundary in the second epoch, where a 1e-7
    # difference in summation order flips a token between clipped and not and Adam turns it
    # into ~6e-5 in the weights (every per-step metric still agreed). At 1e-4 the ratios stay
    # inside the clip range, so the comparison measures the placements, not that discontinuity.
    data["trainer"]["actor_optim"] = {"lr": 1e-4}
    replay_everywhere(tmp_path, data, COMMON_KEYS + PPO_KEYS,
                      {**PLACEMENTS, "split, critic and ref on their own": CRITIC_AND_REF_GROUPS})
    metrics = rows(tmp_path / "one_process")
    assert "actor/pg_loss" not in metrics[0] and "actor/pg_loss" in metrics[2]  # warm-up: the critic alone
    if in_reward:  # the penalty sits in the rewards, not in the loss, and it moves them
        assert all(r["actor/kl_loss"] == 0.0 for r in metrics[2:])
        assert any(abs(r["critic/rewards/mean"] - r["critic/score/mean"]) > 1e-6 for r in metrics[2:])


# Direct intake: each producer sends every row straight to the trainer rank that trains
# it. W = 1, 2, 3 trainer ranks (an odd one included) with 1-3 producers; a mini-batch of 24
# rows keeps GRPO's groups of 4 whole on every rank at each W.
DIRECT_INTAKE: dict[str, dict[str, Any]] = {
    "one process": PLACEMENTS["one process"],
    "split 1 + 1": {"actor": {"device_ids": [0]}, "rollout": {"device_ids": [1]}, "placement": "split"},
    "split 2 + 3": {"actor": {"device_ids": [0, 1], "strategy": "fsdp"}, "rollout": {"device_ids": [2, 3, 4]},
                    "placement": "split"},
    "split 3 + 2": {"actor": {"device_ids": [0, 1, 2], "strategy": "fsdp"}, "rollout": {"device_ids": [3, 4]},
                    "placement": "split"},
}


def test_the_direct_intake_agrees_for_one_two_and_three_trainer_ranks(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = base_config(tiny_model_dir, {"name": "grpo"}, {"function": "verl_hpc.data.tasks.arithmetic:score"}, steps=3)
    data["trainer"]["batch_size"], data["algorithm"]["mini_batch_size"] = 48, 24
    replay_everywhere(tmp_path, data, COMMON_KEYS, DIRECT_INTAKE)
    for name, world in (("split_1_+_1", 1), ("split_2_+_3", 2), ("split_3_+_2", 3)):
        last = rows(tmp_path / name)[-1]  # rank 0 took in its own rows only: 48 / W of them
        assert last["perf/rollout_intake_rows"] == 48 / world, (name, last)
        # one machine: every batch took the same-node socket, none went through gRPC
        assert last["perf/rollout_intake_local_messages_total"] == last["perf/rollout_intake_messages_total"] > 0
        # the lone actor sent its weights as views of one flat buffer (and trained to the same numbers)
        log = (tmp_path / name / "logs" / "trainer_rank0.log").read_text()
        flat = "one flat buffer" in log
        assert flat == (world == 1), name
        # a sharded actor: every trainer rank sent its own rows to the first rollout rank, no gather
        assert ("every trainer rank sends its own rows" in log) == (world > 1), name
        # ... and left each sync in flight during the next step (no bandwidth from posting alone)
        synced = [r for r in rows(tmp_path / name) if r.get("perf/weight_sync_bytes", 0) > 0]
        assert synced and all(("perf/weight_sync_overlapped" in r) == flat for r in synced), name
        assert all(("perf/weight_sync_gbps" in r) != flat for r in synced), name
