"""verl's command line -> a verl-hpc config (config/verl_args.py): pure, no run.

The command lines below are verl's own example scripts (GRPO, PPO, RLOO, REINFORCE++,
GSPO, DAPO), with local paths: every key they use must be taken or knowingly ignored.
"""

from __future__ import annotations

import pytest

from verl_hpc.config import ConfigError
from verl_hpc.config.verl_args import IGNORED, KEYS, parse_overrides, verl_to_config

COMMON = ["data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
          "actor_rollout_ref.model.path=/models/Qwen2-7B-Instruct", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
          "trainer.logger=['console','wandb']", "trainer.project_name='verl_example'", "trainer.save_freq=-1",
          "trainer.total_epochs=15", "trainer.critic_warmup=0", "actor_rollout_ref.rollout.name=vllm"]
GRPO = ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.val_batch_size=1312",
        "data.max_prompt_length=512", "data.max_response_length=512", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size=128",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.actor.fsdp_config.grad_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=128", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=128", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.kl_ctrl.kl_coef=0.001", "trainer.experiment_name='deepseek_llm_7b_function_rm'"]
PPO = ["algorithm.adv_estimator=gae", "data.train_batch_size=1024", "data.filter_overlong_prompts=True",
       "data.truncation='error'", "actor_rollout_ref.model.use_remove_padding=True",
       "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
       "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
       "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "critic.optim.lr=1e-5",
       "critic.model.use_remove_padding=False", "critic.model.path=/models/deepseek-llm-7b-chat",
       "critic.model.enable_gradient_checkpointing=True", "critic.ppo_micro_batch_size_per_gpu=32",
       "critic.model.fsdp_config.param_offload=False", "critic.model.fsdp_config.optimizer_offload=False",
       "algorithm.use_kl_in_reward=False", "trainer.total_training_steps=2", "trainer.use_legacy_worker_impl=False"]
RLOO = ["algorithm.adv_estimator=rloo", "data.train_batch_size=1024", "data.max_response_length=1024",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=80",
        "actor_rollout_ref.rollout.n=5", "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl",
        "algorithm.kl_ctrl.kl_coef=0.001", "trainer.test_freq=5"]
REINFORCE_PP = ["algorithm.adv_estimator=reinforce_plus_plus", "data.train_batch_size=1024",
                "actor_rollout_ref.actor.optim.lr=3e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=1024",
                "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=mse",
                "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.rollout.n=8"]
GSPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "data.shuffle=true",
        "data.train_batch_size=512", "actor_rollout_ref.rollout.n=16", "actor_rollout_ref.actor.clip_ratio_low=3e-4",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004", "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480", "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05",
        "actor_rollout_ref.actor.optim.weight_decay=0.1", "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.actor.entropy_checkpointing=true", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.top_p=0.7", "trainer.total_training_steps=500",
        "reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=false",
        "+reward_model.reward_kwargs.max_resp_len=8192", "trainer.log_val_generations=2"]
DAPO = ["algorithm.adv_estimator=grpo", "data.train_batch_size=512", "data.gen_batch_size=1536",
        "data.max_response_length=8192", "data.truncation='left'", "actor_rollout_ref.rollout.n=16",
        "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.clip_ratio_c=10.0", "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
        "+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4", "actor_rollout_ref.rollout.top_k=-1",
        "reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", "trainer.total_training_steps=200",
        "trainer.resume_mode=auto", "trainer.default_local_dir=/ckpts/DAPO"]
EXAMPLES = {"grpo": GRPO, "ppo": PPO, "rloo": RLOO, "reinforce_pp": REINFORCE_PP, "gspo": GSPO, "dapo": DAPO}


def convert(extra: list[str], rows: int | None = 7473) -> dict:
    return verl_to_config([*COMMON, *extra], rows).config


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_verls_example_scripts_are_taken(name: str) -> None:
    cfg = convert(EXAMPLES[name])
    n = cfg["algorithm"]["sampling"]["n"]
    prompts = parse_overrides(EXAMPLES[name])["data.train_batch_size"]
    assert cfg["trainer"]["batch_size"] == prompts * n  # sequences, not prompts
    assert cfg["resources"]["actor"]["device_ids"] == list(range(8)) and cfg["resources"]["rollout"]["strategy"] == "vllm"


def test_batch_sizes_become_sequence_counts_and_the_yaml_says_so() -> None:
    conversion = verl_to_config([*COMMON, *GRPO], 7473)
    assert conversion.config["trainer"]["batch_size"] == 5120 and conversion.config["algorithm"]["mini_batch_size"] == 1280
    assert conversion.config["algorithm"]["micro_batch_size"] == 16  # verl's global 128 over 8 GPUs
    text = conversion.yaml()
    assert "trainer.batch_size: 5120 sequences = data.train_batch_size 1024 prompts x actor_rollout_ref.rollout.n 5" in text
    assert "algorithm.mini_batch_size: 1280 sequences" in text
    assert conversion.config["trainer"]["total_steps"] == 15 * (7473 // 1024)  # epochs x full batches


def test_keys_left_out_take_verls_defaults() -> None:
    cfg = convert(["algorithm.adv_estimator=grpo"])
    algo, optim = cfg["algorithm"], cfg["trainer"]["actor_optim"]
    assert (optim["lr"], optim["weight_decay"], optim["grad_clip"]) == (1e-6, 0.01, 1.0)
    assert (algo["lam"], algo["gamma"], algo["clip_ratio_c"], algo["value_clip"]) == (1.0, 1.0, 3.0, 0.5)
    assert (algo["clip_ratio_low"], algo["clip_ratio_high"], algo["entropy_coef"]) == (0.2, 0.2, 0.0)
    assert algo["kl"] == {"estimator": "off", "coef": 0.0, "in_reward": False}  # verl: no KL unless asked
    assert cfg["trainer"]["batch_size"] == 1024 and cfg["run_dir"] == "checkpoints/verl_example/gsm8k"
    assert cfg["model"]["gradient_checkpointing"] and cfg["model"]["remove_padding"]


@pytest.mark.parametrize(("extra", "kl"), [
    (["actor_rollout_ref.actor.use_kl_loss=True"], {"estimator": "low_var_kl", "coef": 0.001, "in_reward": False}),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=k3+"],
     {"estimator": "k3+", "coef": 0.001, "in_reward": False}),
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.01"],
     {"estimator": "kl", "coef": 0.01, "in_reward": True}),
])
def test_one_kl_from_verls_two_switches(extra: list[str], kl: dict) -> None:
    assert convert(["algorithm.adv_estimator=gae", *extra])["algorithm"]["kl"] == kl


def test_estimators_and_presets() -> None:
    assert convert(["algorithm.adv_estimator=gae"])["algorithm"]["name"] == "ppo"
    assert convert(DAPO)["algorithm"]["name"] == "dapo"
    dapo = convert(DAPO)
    assert dapo["algorithm"]["filter_groups"] == {"enable": True, "max_num_gen_batches": 10}
    assert dapo["reward"]["overlong_buffer"] == {"enable": True, "len": 4096, "penalty_factor": 1.0}
    assert dapo["algorithm"]["clip_ratio_c"] == 10.0 and dapo["data"]["truncation"] == "left"
    assert dapo["trainer"]["actor_optim"]["warmup_steps"] == 10
    gspo = convert(GSPO)
    assert gspo["algorithm"]["policy_loss"] == "gspo" and gspo["trainer"]["actor_optim"]["warmup_steps"] == 25
    assert gspo["algorithm"]["clip_ratio_low"] == 3e-4  # Hydra reads 3e-4 as a number, YAML 1.1 would not
    assert gspo["trainer"]["val_greedy"] is False
    assert convert(REINFORCE_PP)["algorithm"]["adv_estimator"] == "reinforce_pp"


@pytest.mark.parametrize(("extra", "field", "words"), [
    (["data.no_such_key=1"], "data.no_such_key", "maps to nothing"),
    (["algorithm.adv_estimator=opo"], "algorithm.adv_estimator", "not an estimator"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True"], "algorithm.use_kl_in_reward",
     "one KL"),
    (["algorithm.kl_ctrl.type=adaptive"], "algorithm.kl_ctrl.type", "no verl-hpc counterpart"),
    (["critic.ppo_mini_batch_size=64"], "critic.ppo_mini_batch_size", "differs from"),
    (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name", "not a rollout engine"),
    (["~data.shuffle"], "~data.shuffle", "not a verl override"),
])
def test_what_maps_to_nothing_is_refused_naming_the_key(extra: list[str], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        convert(["algorithm.adv_estimator=grpo", *extra])
    assert err.value.path == field and words in err.value.one_line() and "\n" not in err.value.one_line()


def test_ray_and_speed_keys_are_accepted_and_listed() -> None:
    conversion = verl_to_config([*COMMON, *GRPO, "ray_kwargs.ray_init.num_cpus=64"], 7473)
    ignored = {key for key, _, _ in conversion.ignored}
    assert {"ray_kwargs.ray_init.num_cpus", "actor_rollout_ref.actor.fsdp_config.grad_offload",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size", "data.val_batch_size"} <= ignored
    assert "ray_kwargs.ray_init.num_cpus=64: only Ray's" in conversion.yaml()


def test_epochs_need_the_row_count_or_total_training_steps() -> None:
    with pytest.raises(ConfigError, match="trainer.total_epochs"):
        verl_to_config([*COMMON, "algorithm.adv_estimator=grpo"], None)
    assert verl_to_config([*COMMON, "trainer.total_training_steps=7"], None).config["trainer"]["total_steps"] == 7


def test_every_row_names_a_verl_key_once() -> None:
    keys = [k.key for k in KEYS]
    assert len(keys) == len(set(keys)) and not set(keys) & set(IGNORED)
