"""The run configuration: one typed object per concern, validated before anything starts.

Why pydantic models rather than dicts: a typo or a wrong type in a 64-node job must fail
on the login node in a second, naming the field, not an hour later in rank 37. Checks
that span sections (batch divisible by group size, strategies that need a package)
live in `RunConfig`'s validator so every entry point (CLI, Python API, Slurm) gets them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, field_validator, model_validator

from verl_hpc.config.base import StrictModel
from verl_hpc.config.dpo import DPOConfig
from verl_hpc.config.multi_turn import RolloutConfig
from verl_hpc.config.observability import LoggingConfig
from verl_hpc.config.presets import PRESETS, expand_preset
from verl_hpc.config.resources import ResourceConfig
from verl_hpc.config.reward import (  # noqa: F401  (re-exported: the reward section's classes)
    DEFAULT_JUDGE_PROMPT,
    CustomRewardFunction,
    JudgeConfig,
    OverlongBufferConfig,
    RewardConfig,
)
from verl_hpc.config.sources import ReasoningGymConfig

# Tokens per chunk of the log-prob/entropy passes (`model.logprob_chunk_tokens`).
LOGPROB_CHUNK_TOKENS = 1024


class TaskConfig(StrictModel):
    """A built-in synthetic task that writes its own prompt file (see verl_hpc.data.tasks)."""

    name: Literal["arithmetic", "arithmetic_preference", "hidden_digit"] = "arithmetic"
    num_prompts: int = Field(512, ge=1)
    max_operand: int = Field(4, ge=1, le=9)
    seed: int = 0


class LoraConfig(StrictModel):
    """Low-rank adapters on the actor (peft's LoRA); the base weights stay frozen."""

    rank: int = Field(ge=1, description="the adapters' rank r (verl's `lora_rank`)")
    alpha: float = Field(16.0, gt=0, description="the adapters' scale is alpha / rank (verl's `lora_alpha`)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names that get adapters (e.g. [q_proj, v_proj]); all-linear: every "
        "linear layer but the output head")


class ParamOffloadConfig(StrictModel):
    """Which pass-only roles keep their weights in host memory between passes (verl's `param_offload`)."""

    ref: bool = Field(False, description="the reference policy's weights live in host memory except during its "
                      "log-prob pass (FSDP2's CPUOffloadPolicy when sharded); no effect on a CPU")
    critic: bool = Field(False, description="the critic's weights live in host memory except during its value "
                         "pass and update (sharded: FSDP2's CPUOffloadPolicy, which also runs its optimizer step on "
                         "the CPU); no effect on a CPU")


class ModelConfig(StrictModel):
    """A local Hugging Face directory; with `init_preset` it is built there on first use."""

    path: str
    init_preset: str | None = None
    init_seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    mixed_precision: Literal["auto", "none", "bfloat16", "float16"] = Field(
        "auto", description="the compute dtype of forward and backward (FSDP2's param dtype, or autocast "
        "on a lone rank); master weights, gradient reduction and optimizer state stay fp32. auto: bfloat16 "
        "on a CUDA GPU that has it natively, fp32 (none) elsewhere, CPUs included")
    critic_path: str | None = None
    logprob_chunk_tokens: int = Field(
        LOGPROB_CHUNK_TOKENS, ge=0, description="log-probs and entropies are computed this many tokens at a time "
        "from the last hidden states, and the logits recomputed in backward, so the `[tokens, vocab]` logits "
        "never exist for more than a chunk (1024 tokens x 49k vocab: 0.2 GB, against 1.2 GB for a SmolLM2 "
        "batch whole); a micro-batch within one chunk, a model whose vocabulary is no wider than its "
        "hidden size, or 0, computes its logits whole")
    gradient_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in backward (actor and critic): "
        "activation memory of one layer instead of all, for about one more forward per update")
    remove_padding: bool = Field(
        False, description="pack each micro-batch's sequences into fewer rows for every trainer-side forward "
        "(actor, old and reference log-probs, critic; verl's `use_remove_padding`): no layer computes pad tokens, "
        "attention stays within each sequence; log-probs equal the padded path's to float rounding")
    load: Literal["rank0", "every_rank"] = Field(
        "rank0", description="how a sharded role's ranks get the weights: rank0 reads the files on the group's "
        "first rank only and broadcasts each tensor, the others building on the meta device (one full copy per "
        "group in host memory, not one per rank); every_rank: each rank reads the whole model, then shards it")
    lora: LoraConfig | None = Field(
        None, description="train low-rank adapters on the actor instead of every weight (needs peft): only "
        "the adapters get gradients, optimizer state and checkpoint space; rollout engines get the merged "
        "weights every sync; `verl-hpc export` writes the merged model, `--adapter` the adapter alone")
    param_offload: ParamOffloadConfig = Field(
        default_factory=ParamOffloadConfig, description="accelerator memory freed between passes for the actor's "
        "activations and the rollout's KV cache, for one host-to-device copy of the weights per pass")
    memory_plan: Literal["auto", "off"] = Field(
        "auto", description="auto: before the first step, estimate each role's peak memory from the model, batch "
        "and engine, compare it with what its devices have free, and switch on the memory switches it needs "
        "(cheapest first) and those that pay for themselves; a switch set in the config is never changed; the "
        "plan is logged per role and checked against the measured peak every step (docs/memory.md). off: the "
        "switches as written")
    memory_budget_gb: float | None = Field(
        None, gt=0.0, description="with memory_plan: auto, the memory (GB) each process may use, instead of "
        "what its device has free (host RAM, cgroup and address-space limits on a CPU; the CUDA allocator's "
        "free memory on a GPU); for `verl-hpc plan` on a login node, or a node shared with other jobs")
    memory_headroom: float = Field(
        0.15, ge=0.0, lt=1.0, description="with memory_plan: auto, the share of the budget the plan leaves "
        "unused for what it does not model (allocator fragmentation, libraries); a measured step peak above "
        "the estimate by more than this share re-plans at the next step")

    @field_validator("memory_plan", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML 1.1 reads a bare `off`/`on` as a boolean; take it as the user meant it."""
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value


class DataConfig(StrictModel):
    """Prompts from Parquet/JSONL files, a built-in task, or reasoning-gym's generators."""

    train_files: list[str] = Field(default_factory=list)
    task: TaskConfig | None = None
    reasoning_gym: ReasoningGymConfig | None = Field(None, description="prompts generated by reasoning-gym "
                                                     "and scored by its checker (docs/data.md)")
    prompt_key: str = Field("prompt", description="the prompt column: text, or chat messages (a list of "
                            "`{role, content}`) rendered with the tokenizer's chat template; `messages` is used "
                            "when `prompt` is absent")
    answer_key: str | None = Field(None, description="the ground-truth column, a dotted path into a struct "
                                   "allowed (`reward_model.ground_truth`); unset = `ground_truth`, else verl's "
                                   "`reward_model.ground_truth`, when the file has it")
    reward_fn_key: str = Field("data_source", description="the column handed to the reward as `data_source` "
                               "(verl's key); a file without it gives None")
    extra_info_key: str = Field("extra_info", description="the column handed to the reward as `extra_info` "
                                "(any shape; decoded back from JSON)")
    max_prompt_length: int = Field(64, ge=1, description="prompt tokens, chat template included")
    truncation: Literal["error", "left", "right"] = Field(
        "error", description="a prompt over max_prompt_length: stop naming the row (verl's default), or "
        "keep its last (`left`) or first (`right`) tokens")
    filter_overlong_prompts: bool = Field(False, description="drop prompts over max_prompt_length "
                                          "before training (verl's key)")
    shuffle: bool = True
    # Every trainer rank writes the rows it trained on to <run_dir>/rollouts/ (Arrow IPC) ...
    val_files: list[str] = Field(default_factory=list, description="held-out prompts (same layout as "
                                 "train_files), scored without training: see trainer.test_freq")
    record_rollouts: bool = Field(False, description="write each trainer rank's trained rows to "
                                  "`<run_dir>/rollouts/` (Arrow IPC), for `replay_rollouts`")
    # ... and a run with replay_rollouts: <that dir> trains on those responses instead of
    # sampling: the way to check that two placements compute the same numbers.
    replay_rollouts: str | None = Field(None, description="a `rollouts/` directory recorded by another run: "
                                        "train on its responses instead of sampling (placement checks)")


class SamplingConfig(StrictModel):
    """How the rollout engine samples: n responses per prompt form one GRPO group."""

    n: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(8, ge=1)
    stop: list[str] = Field(default_factory=list)


class KLConfig(StrictModel):
    """KL to the frozen reference policy; `estimator: off` skips the ref role entirely."""

    estimator: Literal["k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl", "k1+", "k2+", "k3+", "abs+", "kl+",
                       "mse+", "low_var_kl+", "off"] = Field(
        "k3", description="per-token KL estimator: `k1` (verl: `kl`) log-ratio, `abs` its absolute value, `k2` "
        "(`mse`) half its square, `k3` (`low_var_kl`) low-variance; a trailing `+` (`k3+`) keeps the value and "
        "takes k2's gradient (straight-through, as verl); `off` = no ref model")
    coef: float = Field(0.001, ge=0.0)
    in_reward: bool = False


class FilterGroupsConfig(StrictModel):
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`)."""

    enable: bool = Field(False, description="drop prompt groups whose scores are all equal (no signal for "
                         "a group-relative estimator) and generate more prompts until the batch is full")
    max_num_gen_batches: int = Field(10, ge=1, description="at most this many generation rounds per step "
                                     "(each of trainer.batch_size / sampling.n prompts); then `on_exhausted` "
                                     "says what happens")
    on_exhausted: Literal["train", "error"] = Field(
        "train", description="fewer informative groups than the batch needs after max_num_gen_batches rounds: "
        "`train` on the groups found (a smaller step, a warning, `filter_groups/exhausted` = 1), `error` stops "
        "the run (verl's behaviour)")


# algorithm.name -> estimator (None for dpo, which has none)
PRESET_ESTIMATORS = {name: preset.get("adv_estimator") for name, preset in PRESETS.items()}
LOSS_AGG_MODES = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                         "seq-mean-token-sum-norm"]


class AlgorithmConfig(StrictModel):
    """`name` is a preset (config/presets.py) that fills the fields left unset; `adv_estimator` and
    `policy_loss` name registered parts (verl_hpc.algo)."""

    name: Literal["grpo", "ppo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo",
                  "remax", "dpo"] = Field(
        "grpo", description="preset: fills the building blocks left unset with its paper's defaults "
        "(docs/algorithms.md); `config show` prints the expansion")
    adv_estimator: str | None = Field(None, description="registered advantage estimator (`grpo`, `gae`, `rloo`, "
                                      "`reinforce_pp`, `reinforce_pp_baseline`, or one a plugin registers); "
                                      "unset = the preset's")
    policy_loss: str = Field("vanilla", description="registered policy loss; `vanilla` = the clipped PPO "
                             "surrogate, `gspo` = one clipped ratio per sequence")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    clip_ratio_low: float = Field(0.2, gt=0.0)
    clip_ratio_high: float = Field(0.2, gt=0.0)
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip PPO (`vanilla`): where the advantage is "
                                "negative the token loss is capped at -A x this (verl's `clip_ratio_c`)")
    entropy_coef: float = Field(0.0, ge=0.0)
    value_clip: float | None = Field(0.2, gt=0.0)
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    norm_adv_by_std: bool = Field(True, description="GRPO: divide advantages by the group's std; false = "
                                  "subtract the mean only (Dr. GRPO)")
    loss_agg_mode: LOSS_AGG_MODES = Field(
        "token-mean", description="how token losses (policy, entropy bonus, KL, value) reduce: mean or sum over "
        "all tokens; or per sequence the mean, the sum, or the sum / `sampling.max_new_tokens` (`-norm`, Dr. "
        "GRPO), then mean over the sequences that have a token (verl's `agg_loss`)")
    ppo_epochs: int = Field(1, ge=1)
    mini_batch_size: int | None = Field(None, ge=1, description="sequences per optimizer step")
    micro_batch_size: int | None = Field(None, ge=1, description="sequences per forward pass")
    use_dynamic_bsz: bool = Field(False, description="micro-batches by tokens instead of rows (verl's key): rows "
                                  "grouped by length, each micro-batch cut to its own longest prompt and response "
                                  "and kept within `max_token_len_per_gpu`; same gradient, less padding")
    max_token_len_per_gpu: int = Field(16384, ge=1, description="with `use_dynamic_bsz`: the most tokens one "
                                       "forward computes, rows x (longest prompt + longest response), on each "
                                       "process (verl's ppo_max_token_len_per_gpu); a longer sequence goes alone")
    critic_warmup_steps: int = Field(0, ge=0)
    max_staleness: int = Field(0, ge=0)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig, description="DAPO's dynamic "
                                              "sampling: train on groups whose scores differ only")
    dpo: DPOConfig | None = Field(None, description="DPO's loss (algorithm.name: dpo fills it in): "
                                  "beta, loss_type sigmoid | ipo, label_smoothing, sft_coef")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: object) -> object:
        return expand_preset(data)

    @model_validator(mode="after")
    def _expand_preset(self) -> AlgorithmConfig:
        if self.adv_estimator is None and PRESET_ESTIMATORS[self.name] is not None:  # dpo has none
            self.adv_estimator = PRESET_ESTIMATORS[self.name]
        return self

    @property
    def estimator(self):  # -> EstimatorSpec (imported lazily: torch loads with verl_hpc.algo)
        from verl_hpc.algo import get_estimator

        return get_estimator(self.adv_estimator or PRESET_ESTIMATORS[self.name])

    @property
    def token_budget(self) -> int | None:
        """Tokens per micro-batch with `use_dynamic_bsz`, else None (micro-batches by rows)."""
        return self.max_token_len_per_gpu if self.use_dynamic_bsz else None

    @property
    def step_kind(self) -> str:
        """Which registered step kind runs (runtime/step/kinds.py): DPO's offline step, or the RL loop."""
        return "dpo" if self.dpo is not None else "rl"

    @property
    def needs_critic(self) -> bool:
        return self.step_kind == "rl" and self.estimator.needs_critic

    @property
    def needs_ref(self) -> bool:
        return self.step_kind == "dpo" or (self.kl.estimator != "off" and self.kl.coef > 0)  # DPO: the frozen ref


class OptimConfig(StrictModel):
    lr: float = Field(1e-3, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0, description="AdamW's epsilon: a gradient far below it moves its weight by "
                       "about lr * grad / eps instead of lr")
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float | None = Field(1.0, gt=0.0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"


class TrainerConfig(StrictModel):
    # `verl-hpc train` without --run-dir uses runs/<run_name>, by default runs/<config file stem>.
    run_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    total_steps: int = Field(100, ge=1)
    batch_size: int = Field(128, ge=1, description="sequences (prompts x sampling.n) per step")
    seed: int = 0
    actor_optim: OptimConfig = Field(default_factory=OptimConfig)
    critic_optim: OptimConfig = Field(default_factory=OptimConfig)
    save_hf_model: bool = True
    torch_threads: int | None = Field(None, ge=1)
    oom_retry: bool = True
    min_micro_batch_size: int = Field(1, ge=1)
    # Validation on data.val_files (verl's keys): `val-core/<data_source>/reward/mean@<val_n>`.
    test_freq: int | None = Field(None, ge=1, description="validate every N steps and after the last one "
                                  "(needs data.val_files); unset = only with val_before_train")
    val_before_train: bool = Field(False, description="validate once before the first step (logged at step 0)")
    val_n: int = Field(1, ge=1, description="responses per validation prompt (the @N of the metric name)")
    val_greedy: bool = Field(True, description="greedy validation (top-k 1); false = sample like training")


class CheckpointConfig(StrictModel):
    interval_steps: int | None = Field(None, ge=1)
    interval_minutes: float | None = Field(None, gt=0.0)
    keep_last: int = Field(2, ge=1)
    keep_every: int | None = Field(None, ge=1)
    async_save: bool = Field(True, alias="async")
    resume: str = "auto"


class SlurmConfig(StrictModel):
    time: str = "01:00:00"
    job_name: str = "verl-hpc"
    requeue: bool = True
    signal_grace_seconds: int = Field(120, ge=1)
    max_requeues: int = Field(5, ge=0)
    setup: list[str] = Field(default_factory=list)


# Checks across sections, files and registries (config/validate.py registers them on import).
CROSS_CHECKS: list[Callable[[RunConfig], None]] = []


class RunConfig(StrictModel):
    """Everything one run needs; `run_dir` is filled from the CLI when not given.

    `plugins` are modules (`pkg.mod`) or files (`path/x.py`) imported before validation in
    every process, so estimators or losses registered there are known everywhere.
    """

    plugins: list[str] = Field(default_factory=list, description="modules (`pkg.mod`) or files (`path/x.py`) "
                               "imported first in every process: register estimators/losses there")
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig | None = None  # required unless algorithm.name: dpo (config/checks.py)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="multi-turn agent episodes "
                                   "(`rollout.multi_turn`, verl's keys)")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    resources: ResourceConfig = Field(default_factory=ResourceConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    run_dir: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: object) -> object:
        plugins = data.get("plugins") if isinstance(data, dict) else None
        if isinstance(plugins, list) and all(isinstance(p, str) for p in plugins):  # else: a type error below
            from verl_hpc.config.user_code import import_plugins

            import_plugins(plugins)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        for check in CROSS_CHECKS:
            check(self)
        return self
