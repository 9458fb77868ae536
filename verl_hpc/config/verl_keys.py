"""The table: every verl 0.9.1 key `verl-hpc verl` takes, and the ones it accepts and ignores.

One row per key: verl's default (from verl 0.9.1's ppo_trainer.yaml; `NOT_SET` where
verl derives it from another key or it has no effect unless given), the verl-hpc
field(s) it sets, a note, and the putter (config/verl_rules.py, verl_sections.py).
docs/verl.md is generated from this file (tools/gen_verl_docs.py).
"""

from __future__ import annotations

from typing import Any

from verl_hpc.config import verl_rules as r
from verl_hpc.config import verl_sections as s
from verl_hpc.config.verl_rules import NOT_SET, VerlKey

A, ACT, RO, CR = "actor_rollout_ref", "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"
NO_SHUFFLE = "verl-hpc takes the same mini-batches every epoch (verl's default shuffle=False)"


def _optim(prefix: str, optim: str, lr: float) -> list[VerlKey]:
    """The optimizer rows of the actor or the critic."""
    o = f"{prefix}.optim"
    return [
        VerlKey(f"{o}.lr", lr, f"trainer.{optim}.lr", put=r.to(f"trainer.{optim}.lr", float)),
        VerlKey(f"{o}.weight_decay", 0.01, f"trainer.{optim}.weight_decay", put=r.to(f"trainer.{optim}.weight_decay",
                                                                                       float)),
        VerlKey(f"{o}.betas", [0.9, 0.999], f"trainer.{optim}.betas", put=r.to(f"trainer.{optim}.betas", list)),
        VerlKey(f"{o}.lr_warmup_steps", -1, f"trainer.{optim}.warmup_steps",
                "when > 0; else lr_warmup_steps_ratio x the run's steps", r.warmup(optim, prefix)),
        VerlKey(f"{o}.lr_warmup_steps_ratio", 0.0, f"trainer.{optim}.warmup_steps", "see lr_warmup_steps"),
        VerlKey(f"{o}.lr_scheduler_type", "constant", f"trainer.{optim}.schedule", "constant or cosine",
                r.schedule(optim, prefix)),
        VerlKey(f"{o}.warmup_style", None, f"trainer.{optim}.schedule", "older name of lr_scheduler_type"),
        VerlKey(f"{o}.min_lr_ratio", 0.0, f"trainer.{optim}.schedule", "cosine: only 0.0 (decay to 0)"),
        VerlKey(f"{o}.num_cycles", 0.5, f"trainer.{optim}.schedule", "cosine: only 0.5 (half a cycle)"),
        VerlKey(f"{o}.clip_grad", 1.0, f"trainer.{optim}.grad_clip", "or the older `grad_clip`",
                r.grad_clip(optim, prefix)),
        VerlKey(f"{prefix}.grad_clip", NOT_SET, f"trainer.{optim}.grad_clip", "older name of optim.clip_grad"),
        VerlKey(f"{o}.optimizer", "AdamW", "—", "only AdamW", r.only(f"{o}.optimizer", ("AdamW",),
                                                                     "verl-hpc trains with AdamW")),
    ]


KEYS: list[VerlKey] = [
    # data
    VerlKey("data.train_files", "~/data/rlhf/gsm8k/train.parquet", "data.train_files", "a file or a list",
            s.files("data.train_files")),
    VerlKey("data.val_files", "~/data/rlhf/gsm8k/test.parquet", "data.val_files", "a file or a list",
            s.files("data.val_files")),
    VerlKey(r.TRAIN_BATCH, 1024, "trainer.batch_size", "prompts -> sequences: x rollout.n",
            r.sequences("trainer.batch_size", r.TRAIN_BATCH)),
    VerlKey("data.max_prompt_length", 512, "data.max_prompt_length", put=r.to("data.max_prompt_length", int)),
    VerlKey("data.max_response_length", 512, "algorithm.sampling.max_new_tokens",
            put=r.to("algorithm.sampling.max_new_tokens", int)),
    VerlKey("data.truncation", "error", "data.truncation", "error, left or right",
            put=r.to("data.truncation")),
    VerlKey("data.filter_overlong_prompts", False, "data.filter_overlong_prompts",
            put=r.to("data.filter_overlong_prompts", bool)),
    VerlKey("data.prompt_key", "prompt", "data.prompt_key", put=r.to("data.prompt_key")),
    VerlKey("data.reward_fn_key", "data_source", "data.reward_fn_key", put=r.to("data.reward_fn_key")),
    VerlKey("data.shuffle", True, "data.shuffle", put=r.to("data.shuffle", bool)),
    VerlKey("data.seed", NOT_SET, "trainer.seed", put=r.to("trainer.seed", int)),
    VerlKey("data.tokenizer", None, "—", "only null: the model's own tokenizer",
            r.only("data.tokenizer", (None,), "put the tokenizer in the model directory")),
    # actor_rollout_ref.model
    VerlKey(f"{A}.model.path", "~/models/deepseek-llm-7b-chat", "model.path", "a local Hugging Face directory",
            r.to("model.path", str)),
    VerlKey(f"{A}.model.enable_gradient_checkpointing", True, "model.gradient_checkpointing",
            "actor and critic", r.to("model.gradient_checkpointing", bool)),
    VerlKey(f"{A}.model.use_remove_padding", True, "model.remove_padding", "actor, ref and critic",
            r.to("model.remove_padding", bool)),
    VerlKey(f"{A}.model.lora_rank", 0, "model.lora", "> 0: LoRA of this rank", s.lora),
    VerlKey(f"{A}.model.lora_alpha", 16, "model.lora.alpha", "see lora_rank"),
    VerlKey(f"{A}.model.target_modules", "all-linear", "model.lora.target_modules", "see lora_rank"),
    VerlKey(f"{A}.model.custom_chat_template", None, "—", "only null",
            r.only(f"{A}.model.custom_chat_template", (None,), "put the template in tokenizer_config.json")),
    VerlKey(f"{A}.model.tokenizer_path", None, "—", "only null",
            r.only(f"{A}.model.tokenizer_path", (None,), "put the tokenizer in the model directory")),
    VerlKey(f"{A}.model.external_lib", None, "—", "only null",
            r.only(f"{A}.model.external_lib", (None,), "list the module under plugins: in the printed config")),
    # actor
    *_optim(ACT, "actor_optim", 1e-6),
    VerlKey(f"{ACT}.strategy", "fsdp", "resources.actor.strategy", "fsdp or fsdp2 (both FSDP2 here)",
            r.only(f"{ACT}.strategy", ("fsdp", "fsdp2"), "verl-hpc shards with FSDP2")),
    VerlKey(f"{ACT}.ppo_mini_batch_size", 256, "algorithm.mini_batch_size", "prompts -> sequences: x rollout.n",
            r.sequences("algorithm.mini_batch_size", f"{ACT}.ppo_mini_batch_size")),
    VerlKey(f"{ACT}.ppo_micro_batch_size_per_gpu", None, "algorithm.micro_batch_size", "sequences per process",
            r.micro_batch),
    VerlKey(f"{ACT}.ppo_micro_batch_size", None, "algorithm.micro_batch_size", "global, divided by the processes"),
    VerlKey(f"{ACT}.use_dynamic_bsz", False, "algorithm.use_dynamic_bsz", put=r.to("algorithm.use_dynamic_bsz", bool)),
    VerlKey(f"{ACT}.ppo_max_token_len_per_gpu", 16384, "algorithm.max_token_len_per_gpu",
            put=r.to("algorithm.max_token_len_per_gpu", int)),
    VerlKey(f"{ACT}.clip_ratio", 0.2, "algorithm.clip_ratio_low/high", "where clip_ratio_low/high are null"),
    VerlKey(f"{ACT}.clip_ratio_low", 0.2, "algorithm.clip_ratio_low", put=r.clip("low")),
    VerlKey(f"{ACT}.clip_ratio_high", 0.2, "algorithm.clip_ratio_high", put=r.clip("high")),
    VerlKey(f"{ACT}.clip_ratio_c", 3.0, "algorithm.clip_ratio_c", "dual clip", r.to("algorithm.clip_ratio_c", float)),
    VerlKey(f"{ACT}.policy_loss.loss_mode", "vanilla", "algorithm.policy_loss", "vanilla or gspo",
            r.to("algorithm.policy_loss")),
    VerlKey(f"{ACT}.loss_agg_mode", "token-mean", "algorithm.loss_agg_mode", put=r.to("algorithm.loss_agg_mode")),
    VerlKey(f"{ACT}.loss_scale_factor", None, "—", "only null: seq-mean-token-sum-norm divides by "
            "max_response_length", r.only(f"{ACT}.loss_scale_factor", (None,), "drop it")),
    VerlKey(f"{ACT}.entropy_coeff", 0, "algorithm.entropy_coef", put=r.to("algorithm.entropy_coef", float)),
    VerlKey(f"{ACT}.use_kl_loss", False, "algorithm.kl", "KL as a loss term (or use_kl_in_reward; not both)", r.kl),
    VerlKey(f"{ACT}.kl_loss_coef", 0.001, "algorithm.kl.coef", "with use_kl_loss"),
    VerlKey(f"{ACT}.kl_loss_type", "low_var_kl", "algorithm.kl.estimator", "with use_kl_loss"),
    VerlKey(f"{ACT}.ppo_epochs", 1, "algorithm.ppo_epochs", put=r.to("algorithm.ppo_epochs", int)),
    VerlKey(f"{ACT}.shuffle", False, "—", "only False", r.only(f"{ACT}.shuffle", (False,), NO_SHUFFLE)),
    # ref
    VerlKey(f"{A}.ref.fsdp_config.param_offload", False, "model.param_offload.ref",
            put=r.to("model.param_offload.ref", bool)),
    # rollout
    VerlKey(f"{RO}.name", NOT_SET, "resources.rollout.strategy", "vllm or hf (required, as in verl)"),
    VerlKey(f"{RO}.n", 1, "algorithm.sampling.n", put=r.to("algorithm.sampling.n", int)),
    VerlKey(f"{RO}.temperature", 1.0, "algorithm.sampling.temperature", put=r.to("algorithm.sampling.temperature",
                                                                                 float)),
    VerlKey(f"{RO}.top_p", 1.0, "algorithm.sampling.top_p", put=r.to("algorithm.sampling.top_p", float)),
    VerlKey(f"{RO}.top_k", -1, "algorithm.sampling.top_k", "-1 (off) -> 0",
            lambda v, _: [("algorithm.sampling.top_k", max(int(v), 0))]),
    VerlKey(f"{RO}.response_length", NOT_SET, "algorithm.sampling.max_new_tokens", "default: data.max_response_length",
            r.to("algorithm.sampling.max_new_tokens", int)),
    VerlKey(f"{RO}.tensor_model_parallel_size", 2, "resources.rollout.vllm_args.tensor_parallel_size", "vllm"),
    VerlKey(f"{RO}.gpu_memory_utilization", 0.5, "resources.rollout.vllm_args.gpu_memory_utilization", "vllm"),
    VerlKey(f"{RO}.enforce_eager", False, "resources.rollout.vllm_args.enforce_eager", "vllm"),
    VerlKey(f"{RO}.free_cache_engine", True, "resources.rollout.vllm_args.enable_sleep_mode", "vllm on cuda"),
    VerlKey(f"{RO}.max_model_len", None, "resources.rollout.vllm_args.max_model_len", "vllm"),
    VerlKey(f"{RO}.do_sample", True, "—", "only True", r.only(f"{RO}.do_sample", (True,), "training samples")),
    VerlKey(f"{RO}.multi_turn.enable", False, "—", "only False",
            r.only(f"{RO}.multi_turn.enable", (False,), "multi-turn tool rollouts are not taken from verl's keys")),
    VerlKey(f"{RO}.val_kwargs.do_sample", False, "trainer.val_greedy", "negated",
            lambda v, _: [("trainer.val_greedy", not v)]),
    VerlKey(f"{RO}.val_kwargs.n", 1, "trainer.val_n", put=r.to("trainer.val_n", int)),
    VerlKey(f"{A}.nccl_timeout", 600, "resources.timeout_seconds", "see trainer.device"),
    # critic
    *_optim(CR, "critic_optim", 1e-5),
    VerlKey(f"{CR}.model.path", NOT_SET, "model.critic_path", "default: the actor's model", r.to("model.critic_path",
                                                                                                   str)),
    VerlKey(f"{CR}.cliprange_value", 0.5, "algorithm.value_clip", put=r.to("algorithm.value_clip", float)),
    VerlKey(f"{CR}.model.fsdp_config.param_offload", False, "model.param_offload.critic",
            put=r.to("model.param_offload.critic", bool)),
    VerlKey(f"{CR}.ppo_mini_batch_size", NOT_SET, "algorithm.mini_batch_size", "only the actor's",
            r.same_as_actor(f"{CR}.ppo_mini_batch_size", f"{ACT}.ppo_mini_batch_size")),
    VerlKey(f"{CR}.ppo_epochs", NOT_SET, "algorithm.ppo_epochs", "only the actor's",
            r.same_as_actor(f"{CR}.ppo_epochs", f"{ACT}.ppo_epochs")),
    VerlKey(f"{CR}.loss_agg_mode", NOT_SET, "algorithm.loss_agg_mode", "only the actor's",
            r.same_as_actor(f"{CR}.loss_agg_mode", f"{ACT}.loss_agg_mode")),
    VerlKey(f"{CR}.shuffle", False, "—", "only False", r.only(f"{CR}.shuffle", (False,), NO_SHUFFLE)),
    # algorithm
    VerlKey("algorithm.adv_estimator", "gae", "algorithm.name, algorithm.adv_estimator",
            ", ".join(r.ESTIMATORS), r.estimator),
    VerlKey("algorithm.gamma", 1.0, "algorithm.gamma", put=r.to("algorithm.gamma", float)),
    VerlKey("algorithm.lam", 1.0, "algorithm.lam", put=r.to("algorithm.lam", float)),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", True, "algorithm.norm_adv_by_std",
            put=r.to("algorithm.norm_adv_by_std", bool)),
    VerlKey("algorithm.use_kl_in_reward", False, "algorithm.kl.in_reward", "see actor.use_kl_loss"),
    VerlKey("algorithm.kl_penalty", "kl", "algorithm.kl.estimator", "with use_kl_in_reward"),
    VerlKey("algorithm.kl_ctrl.kl_coef", 0.001, "algorithm.kl.coef", "with use_kl_in_reward"),
    VerlKey("algorithm.kl_ctrl.type", "fixed", "—", "only fixed",
            r.only("algorithm.kl_ctrl.type", ("fixed",), "verl-hpc's KL coefficient is fixed")),
    VerlKey("algorithm.filter_groups.enable", False, "algorithm.filter_groups.enable",
            put=r.to("algorithm.filter_groups.enable", bool)),
    VerlKey("algorithm.filter_groups.metric", "reward", "—", "groups are kept when their scores differ",
            r.filter_metric),
    VerlKey("algorithm.filter_groups.max_num_gen_batches", 0, "algorithm.filter_groups.max_num_gen_batches",
            "0 (no limit) -> 100", r.gen_batches),
    VerlKey("algorithm.filter_groups.on_exhausted", NOT_SET, "algorithm.filter_groups.on_exhausted",
            "verl-hpc's: train (default) or error (verl's behaviour)", r.to("algorithm.filter_groups.on_exhausted")),
    VerlKey("algorithm.use_pf_ppo", False, "—", "only False", r.only("algorithm.use_pf_ppo", (False,), "drop it")),
    # reward
    VerlKey("custom_reward_function.path", None, "reward.custom_reward_function.path",
            "else reward_model.enable, else verl's default_compute_score", s.reward),
    VerlKey("custom_reward_function.name", "compute_score", "reward.custom_reward_function.name", "see path"),
    VerlKey("reward.custom_reward_function.path", None, "reward.custom_reward_function.path", "newer spelling"),
    VerlKey("reward.custom_reward_function.name", "compute_score", "reward.custom_reward_function.name",
            "newer spelling"),
    VerlKey("reward_model.enable", False, "reward.model_path", "with reward_model.model.path"),
    VerlKey("reward_model.model.path", None, "reward.model_path", "with reward_model.enable"),
    VerlKey("reward.reward_model.enable", False, "reward.model_path", "newer spelling"),
    VerlKey("reward.reward_model.model_path", None, "reward.model_path", "newer spelling"),
    VerlKey("reward_model.reward_manager", "naive", "—", "naive, dapo or batch"),
    VerlKey("reward.reward_manager.name", "naive", "—", "newer spelling"),
    *[VerlKey(f"{root}.reward_kwargs.overlong_buffer_cfg.{leaf}", NOT_SET, f"reward.overlong_buffer.{ours}",
              "DAPO's overlong buffer") for root in ("reward_model", "reward")
      for leaf, ours in (("enable", "enable"), ("len", "len"), ("penalty_factor", "penalty_factor"))],
    # trainer
    VerlKey("trainer.device", "cuda", "resources", "every role on trainer.n_gpus_per_node devices (colocated)",
            s.resources),
    VerlKey("trainer.n_gpus_per_node", 8, "resources.<role>.device_ids", "see trainer.device"),
    VerlKey("trainer.nnodes", 1, "resources.actor.nodes", "see trainer.device"),
    VerlKey("trainer.total_epochs", 30, "trainer.total_steps", "epochs x (training rows // train_batch_size)",
            r.total_steps),
    VerlKey("trainer.total_training_steps", None, "trainer.total_steps", "wins over total_epochs"),
    VerlKey("trainer.save_freq", -1, "checkpoint.interval_steps", "-1 -> null",
            r.positive_or_none("checkpoint.interval_steps")),
    VerlKey("trainer.max_actor_ckpt_to_keep", None, "checkpoint.keep_last", "null (keep all) -> 1000000",
            lambda v, _: [("checkpoint.keep_last", int(v) if v else 1_000_000)]),
    VerlKey("trainer.val_before_train", True, "trainer.val_before_train", "with data.val_files", s.validation),
    VerlKey("trainer.test_freq", -1, "trainer.test_freq", "-1 -> null; with data.val_files"),
    VerlKey("trainer.val_only", False, "—", "only False", r.only("trainer.val_only", (False,), "drop it")),
    VerlKey("trainer.critic_warmup", 0, "algorithm.critic_warmup_steps", put=r.to("algorithm.critic_warmup_steps", int)),
    VerlKey("trainer.logger", NOT_SET, "logging.sinks", "console, tensorboard, wandb, mlflow, file; "
            "not given: verl-hpc's TensorBoard + JSONL", s.logging),
    VerlKey("trainer.project_name", "verl_examples", "logging.wandb.project", put=r.to("logging.wandb.project", str)),
    VerlKey("trainer.experiment_name", "gsm8k", "trainer.run_name, slurm.job_name", put=r.run_name),
    VerlKey("trainer.default_local_dir", NOT_SET, "run_dir", "default: checkpoints/<project>/<experiment>",
            s.run_dir),
    VerlKey("trainer.resume_mode", "auto", "checkpoint.resume", "auto, disable (never) or resume_path", s.resume),
    VerlKey("trainer.resume_from_path", None, "checkpoint.resume", "with resume_mode=resume_path"),
]
# Rows whose default is NOT_SET but whose putter must run anyway (it supplies the default itself).
ALWAYS = {"trainer.default_local_dir"}
DEFAULTS: dict[str, Any] = {k.key: k.default for k in KEYS}


def _reward_kwargs(sub: str, value: Any, _: r.VerlArgs) -> list[tuple[str, Any]]:
    return [(f"reward.custom_reward_function.reward_kwargs.{sub}", value)]


# Keys under these prefixes pass through (the rest of the key is the name).
PREFIX_KEYS = {"custom_reward_function.reward_kwargs.": _reward_kwargs,
               "reward.custom_reward_function.reward_kwargs.": _reward_kwargs}

RAY = "only Ray's (verl-hpc starts its processes itself)"
SPEED = "engine speed or memory only; same numbers"
IGNORED: dict[str, str] = {
    # a key ending in "*" covers every key that starts with what precedes it
    "ray_kwargs.*": RAY, "ray_init.*": RAY, "trainer.ray_wait_register_center_timeout": RAY,
    f"{A}.hybrid_engine": RAY, "global_profiler.*": RAY, "transfer_queue.*": RAY, "trainer.use_v1": RAY,
    "trainer.v1.*": RAY, "trainer.use_legacy_worker_impl": RAY, f"{RO}.agent.*": RAY, f"{RO}.mode": RAY,
    f"{RO}.nnodes": RAY, f"{RO}.n_gpus_per_node": RAY, f"{RO}.checkpoint_engine.*": RAY,
    f"{ACT}.profiler.*": RAY, f"{A}.ref.profiler.*": RAY, f"{RO}.profiler.*": RAY, f"{CR}.profiler.*": RAY,
    f"{ACT}.fsdp_config.*": SPEED, f"{A}.ref.fsdp_config.*": SPEED, f"{CR}.model.fsdp_config.*": SPEED,
    f"{CR}.fsdp.*": SPEED, f"{ACT}.ulysses_sequence_parallel_size": SPEED,
    f"{A}.ref.ulysses_sequence_parallel_size": SPEED, f"{CR}.ulysses_sequence_parallel_size": SPEED,
    f"{ACT}.use_torch_compile": SPEED, f"{A}.ref.use_torch_compile": SPEED,
    f"{ACT}.entropy_from_logits_with_chunking": SPEED, f"{ACT}.entropy_checkpointing": SPEED,
    f"{ACT}.calculate_entropy": SPEED, f"{ACT}.checkpoint.*": "checkpoints hold everything here",
    f"{CR}.checkpoint.*": "checkpoints hold everything here", f"{ACT}.data_loader_seed": "no shuffling (see shuffle)",
    f"{A}.ref.log_prob_*": "the ref uses the actor's micro-batches; " + SPEED,
    f"{RO}.log_prob_*": "old log-probs use the actor's micro-batches; " + SPEED,
    f"{A}.ref.strategy": "the ref shards like the actor", f"{CR}.strategy": "the critic shards like the actor",
    f"{CR}.ppo_micro_batch_size*": "the critic uses the actor's micro-batches; " + SPEED,
    f"{CR}.forward_micro_batch_size*": SPEED, f"{CR}.use_dynamic_bsz": "follows the actor's; " + SPEED,
    f"{CR}.ppo_max_token_len_per_gpu": SPEED, f"{CR}.forward_max_token_len_per_gpu": SPEED,
    f"{CR}.model.enable_gradient_checkpointing": "follows the actor's; " + SPEED,
    f"{CR}.model.use_remove_padding": "follows the actor's; " + SPEED, f"{CR}.enable": "a critic runs when gae needs it",
    f"{A}.model.override_config.*": "the model directory's config.json is used as it is",
    f"{A}.model.trust_remote_code": "only Hugging Face architectures load", f"{A}.model.use_shm": SPEED,
    f"{A}.model.use_liger": SPEED, f"{A}.model.use_fused_kernels": SPEED, f"{A}.model.fused_kernel_options.*": SPEED,
    f"{A}.model.enable_activation_offload": SPEED, f"{CR}.model.trust_remote_code": "only Hugging Face architectures",
    f"{RO}.dtype": SPEED, f"{RO}.max_num_batched_tokens": SPEED, f"{RO}.max_num_seqs": SPEED,
    f"{RO}.enable_chunked_prefill": SPEED, f"{RO}.enable_prefix_caching": SPEED, f"{RO}.load_format": SPEED,
    f"{RO}.layered_summon": SPEED, f"{RO}.disable_log_stats": SPEED, f"{RO}.engine_kwargs.*": SPEED,
    f"{RO}.cudagraph_capture_sizes": SPEED, f"{RO}.prompt_length": "data.max_prompt_length",
    f"{RO}.calculate_log_probs": "the engine's log-probs are always kept",
    f"{RO}.val_kwargs.temperature": "validation samples like training when do_sample",
    f"{RO}.val_kwargs.top_p": "validation samples like training when do_sample",
    f"{RO}.val_kwargs.top_k": "validation samples like training when do_sample",
    "data.val_batch_size": SPEED, "data.gen_batch_size": "each DAPO round generates data.train_batch_size prompts",
    "data.dataloader_num_workers": SPEED, "data.filter_overlong_prompts_workers": SPEED,
    "data.return_raw_chat": "prompts are rendered here", "data.return_raw_input_ids": "prompts are rendered here",
    "data.return_full_prompt": "prompts are rendered here", "data.trust_remote_code": "only Hugging Face tokenizers",
    "data.use_shm": SPEED, "trainer.balance_batch": SPEED, "trainer.log_val_generations": "validation rows are logged",
    "trainer.rollout_data_dir": "see data.record_rollouts", "trainer.validation_data_dir": "validation rows are logged",
    "trainer.esi_redundant_time": "Slurm signals the final checkpoint (slurm.signal_grace_seconds)",
    "trainer.default_hdfs_dir": "no HDFS", "trainer.del_local_ckpt_after_load": "checkpoints are kept",
    "trainer.max_critic_ckpt_to_keep": "one checkpoint holds every role",
    "reward_model.reward_kwargs.max_resp_len": "data.max_response_length",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": "reward/overlong/* metrics are always logged",
    "reward.reward_kwargs.overlong_buffer_cfg.log": "reward/overlong/* metrics are always logged",
    "reward_model.micro_batch_size_per_gpu": SPEED, "reward_model.micro_batch_size": SPEED,
    "reward_model.max_length": SPEED, "reward_model.use_dynamic_bsz": SPEED, "reward_model.launch_reward_fn_async": SPEED,
    "algorithm.kl_ctrl.horizon": "adaptive KL only", "algorithm.kl_ctrl.target_kl": "adaptive KL only",
    "algorithm.filter_groups.max_inflight_gen_batches": SPEED,
    "reward.num_workers": "verl's reward-loop workers; " + SPEED + " (verl-hpc: reward.num_workers via --set)",
}
