"""Whole verl-hpc sections made from several verl keys: devices, the reward, logging, the run.

Why whole sections: verl spreads them over many keys (`trainer.n_gpus_per_node`,
`trainer.device`, `rollout.name`, `rollout.tensor_model_parallel_size`, ...), while one
verl-hpc section (`resources`) says the same at once. Each function here is the `put`
of one key's row (config/verl_keys.py) and reads the other keys through `VerlArgs`.
"""

from __future__ import annotations

from typing import Any

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.verl_rules import NOT_SET, VerlArgs, as_list

ROLLOUT = "actor_rollout_ref.rollout"
ENGINES = {"vllm": "vllm", "hf": "hf"}
SINKS = {"console": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "file": "jsonl"}
VERL_SCORE = "verl.utils.reward_score:default_compute_score"


def resources(device: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    """verl's hybrid engine: every role on the same devices, one process per GPU (colocated)."""
    if device not in ("cuda", "cpu"):
        raise ConfigError("trainer.device", f"{device!r} is not a device verl-hpc trains on", "use cuda or cpu")
    gpus, nodes = args.integer("trainer.n_gpus_per_node", 1), args.integer("trainer.nnodes", 1)
    name = args.get(f"{ROLLOUT}.name")
    if name is NOT_SET or name is None:
        raise ConfigError(f"{ROLLOUT}.name", "is required (verl has no default)", "give vllm or hf")
    if name not in ENGINES:
        raise ConfigError(f"{ROLLOUT}.name", f"{name!r} is not a rollout engine verl-hpc runs",
                          f"use one of {', '.join(ENGINES)}")
    ids = list(range(gpus))
    actor: dict[str, Any] = {"device_type": device, "device_ids": ids, "strategy": "fsdp" if gpus * nodes > 1 else "hf"}
    if nodes > 1:
        actor.update(nodes=nodes, tasks_per_node=gpus, **({"gpus_per_node": gpus} if device == "cuda" else {}))
    rollout: dict[str, Any] = {"device_type": device, "device_ids": ids, "strategy": ENGINES[name]}
    if name == "vllm":
        rollout["vllm_args"] = {
            "tensor_parallel_size": args.integer(f"{ROLLOUT}.tensor_model_parallel_size", 1),
            "gpu_memory_utilization": float(args.get(f"{ROLLOUT}.gpu_memory_utilization")),
            "enforce_eager": bool(args.get(f"{ROLLOUT}.enforce_eager")),
            "enable_sleep_mode": bool(args.get(f"{ROLLOUT}.free_cache_engine")) and device == "cuda"}
        if args.get(f"{ROLLOUT}.max_model_len") not in (None, NOT_SET):
            rollout["vllm_args"]["max_model_len"] = args.integer(f"{ROLLOUT}.max_model_len", 1)
    return [("resources", {"actor": actor, "rollout": rollout, "placement": "colocated",
                           "timeout_seconds": float(args.get("actor_rollout_ref.nccl_timeout"))})]


def reward(_: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    """A reward model, the user's compute_score file, or verl's own default_compute_score (verl's order)."""
    if args.first("reward_model.enable", "reward.reward_model.enable"):
        path = args.first("reward_model.model.path", "reward.reward_model.model_path")
        if path in (None, NOT_SET):
            raise ConfigError("reward_model.model.path", "is required with reward_model.enable=True",
                              "give the reward model's directory")
        out: dict[str, Any] = {"model_path": path}
    else:
        path = args.first("custom_reward_function.path", "reward.custom_reward_function.path")
        name = args.first("custom_reward_function.name", "reward.custom_reward_function.name") or "compute_score"
        out = {"custom_reward_function": {"path": path, "name": name}} if path else {"function": VERL_SCORE}
    manager = args.first("reward_model.reward_manager", "reward.reward_manager.name") or "naive"
    if manager not in ("naive", "dapo", "batch"):
        raise ConfigError("reward_model.reward_manager", f"{manager!r} has no verl-hpc counterpart",
                          "use naive or dapo (the overlong buffer is reward_kwargs.overlong_buffer_cfg)")
    overlong = _overlong(args)
    if overlong is not None:
        out["overlong_buffer"] = overlong
    return [("reward", out)]


def _overlong(args: VerlArgs) -> dict[str, Any] | None:
    """DAPO's overlong buffer, from `reward_model.reward_kwargs.overlong_buffer_cfg.*` (or `reward.`)."""
    def get(leaf: str) -> Any:
        return args.first(*(f"{root}.reward_kwargs.overlong_buffer_cfg.{leaf}" for root in ("reward_model", "reward")))

    if not get("enable") or get("enable") is NOT_SET:
        return None
    length, factor = get("len"), get("penalty_factor")
    if length is NOT_SET:
        raise ConfigError("reward_model.reward_kwargs.overlong_buffer_cfg.len", "is required when the buffer is "
                          "enabled", "give the buffer's length in tokens")
    return {"enable": True, "len": length, "penalty_factor": 1.0 if factor is NOT_SET else factor}


def logging(value: Any, _: VerlArgs) -> list[tuple[str, Any]]:
    sinks: list[str] = ["jsonl"]
    for name in as_list(value):
        if name not in SINKS:
            raise ConfigError("trainer.logger", f"{name!r} has no verl-hpc sink", f"use some of {', '.join(SINKS)}")
        if SINKS[name] is not None and SINKS[name] not in sinks:
            sinks.append(SINKS[name])
    return [("logging.sinks", sinks)]


def run_dir(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    """verl's checkpoint folder, checkpoints/<project>/<experiment> by default, holds the whole run here."""
    if value is NOT_SET or value is None:
        value = f"checkpoints/{args.get('trainer.project_name')}/{args.get('trainer.experiment_name')}"
    return [("run_dir", str(value))]


def resume(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    if value == "auto":
        return [("checkpoint.resume", "auto")]
    if value == "disable":
        return [("checkpoint.resume", "never")]
    if value == "resume_path":
        path = args.get("trainer.resume_from_path")
        if path in (None, NOT_SET):
            raise ConfigError("trainer.resume_from_path", "is required with trainer.resume_mode=resume_path",
                              "give the checkpoint to start from")
        return [("checkpoint.resume", str(path))]
    raise ConfigError("trainer.resume_mode", f"{value!r} is not auto, disable or resume_path")


def validation(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    """val_before_train and test_freq need validation files (verl's default test set is gsm8k's)."""
    has_files = bool(as_list(args.get("data.val_files")) if args.get("data.val_files") else [])
    freq = args.get("trainer.test_freq")
    return [("trainer.val_before_train", bool(value) and has_files),
            ("trainer.test_freq", freq if has_files and isinstance(freq, int) and freq > 0 else None)]


def lora(rank: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    if not rank:
        return []
    model = "actor_rollout_ref.model"
    return [("model.lora", {"rank": args.integer(f"{model}.lora_rank", 1), "alpha": float(args.get(f"{model}.lora_alpha")),
                            "target_modules": args.get(f"{model}.target_modules")})]


def files(path: str) -> Any:
    """A file or a list of files -> a list (verl accepts both)."""
    return lambda v, _: [(path, [str(f) for f in as_list(v)] if v not in (None, "") else [])]
