"""Render the configuration reference in docs/configuration.md from the pydantic schema.

Why generated: a hand-kept table of ~200 fields drifts from the code the first time a
default changes. This script walks `RunConfig` (nested sections included), reads each
field's type, bounds, default and alias from pydantic, and takes its one-line
description from `Field(description=...)` or else from DESCRIPTIONS below. Only the
block between the markers is rewritten; the guide around it is hand-written.

    python tools/gen_config_docs.py           # rewrite the generated block
    python tools/gen_config_docs.py --check   # exit 1 if docs/configuration.md is stale
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from generated_block import write_or_check  # tools/, beside this script
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from verl_hpc.config.loader import BASE_KEY
from verl_hpc.config.resources import ROLE_NAMES, VALID_STRATEGIES
from verl_hpc.config.schema import RunConfig
from verl_hpc.models.tiny import PRESETS

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"
BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"

# Sections that share one model class are described once, under a template prefix;
# `{role}` in such a description becomes the concrete name (actor, critic, ...).
TEMPLATES: dict[str, tuple[str, str]] = {
    **{f"resources.{role}": ("resources.<role>", role) for role in ROLE_NAMES},
    "trainer.actor_optim": ("trainer.<optim>", "actor"),
    "trainer.critic_optim": ("trainer.<optim>", "critic"),
}

DESCRIPTIONS: dict[str, str] = {
    # top level
    "base": "another config file this one is merged over (a path relative to this file; mappings merge key by "
            "key, other values replace; bases may chain); read by the loader, not kept in the resolved config",
    "model": "the policy model: a local Hugging Face directory, optionally built on first use",
    "data": "where prompts come from: Parquet/JSONL files and/or a built-in task",
    "reward": "how each response is scored: a Python function or a reward model (none for algorithm.name: dpo)",
    "algorithm": "GRPO or PPO: sampling, KL penalty, clipping, advantages and batch cutting",
    "trainer": "run length, batch size, seed and the optimizers",
    "resources": "per-role devices, strategies and Slurm sizes; same shape as `resource_config.yaml`",
    "checkpoint": "checkpoint cadence, retention and resume",
    "logging": "metric sinks (TensorBoard, JSONL, Prometheus, wandb, MLflow), sample tables, progress, log level",
    "slurm": "Slurm job settings (used when submitting; `verl-hpc train` uses only `requeue_margin_seconds`, "
             "with `--time-limit`)",
    "rollout": "how responses are produced beyond sampling: multi-turn agent episodes with tools (docs/agents.md)",
    "rollout.multi_turn": "agent episodes: generate, call tools, read their replies, generate again (verl's keys)",
    "run_dir": "output directory (`~`/`$VARS` expand); `--run-dir` wins; unset = `runs/<trainer.run_name>`",
    # model
    "model.path": "local Hugging Face directory of the policy; must hold `config.json` unless `init_preset` is set",
    "model.init_preset": "build a random-weight model + tokenizer of this preset ({presets}) at `path` when that "
                         "path is new (said in one line); a path that holds a model is used as it is, one that is "
                         "a near-typo of a model beside it is refused",
    "model.init_seed": "seed of the weights and tokenizer built by `init_preset`",
    "model.dtype": "parameter dtype of the policy (and critic); CPU training needs `float32`",
    "model.mixed_precision": "compute dtype of forward and backward (FSDP2's param dtype, autocast on a lone rank); master weights, optimizer state and gradient reduction stay fp32. `auto`: `bfloat16` on a CUDA GPU that has it natively, fp32 (`none`) elsewhere, CPUs included; `bfloat16`/`float16` are for GPUs",
    "model.critic_path": "PPO: Hugging Face directory the critic starts from; unset = `model.path`",
    # data
    "data.train_files": "prompt files (`.parquet`, `.jsonl`, `.json`), read in order and concatenated",
    "data.task": "a built-in synthetic task; its prompts go to `<run_dir>/data/`, read after `train_files`",
    "data.task.name": "which task: `arithmetic` is single-digit addition, `a+b=` → the sum; "
                      "`arithmetic_preference` the same prompts as DPO pairs (the sum chosen, a wrong one rejected); "
                      "`hidden_digit` a multi-turn task: call the `peek` tool and answer with the digit it tells "
                      "(with `rollout.multi_turn` and the `tiny-agent` preset)",
    "data.task.num_prompts": "number of prompts written (rows of `<run_dir>/data/<name>_prompts.parquet`)",
    "data.task.max_operand": "largest operand: prompts are `a+b=` with a, b in 0..max_operand",
    "data.task.seed": "seed of the prompt generator",
    "data.prompt_key": "column holding the prompt text",
    "data.answer_key": "column holding the answer, passed to the reward as `ground_truth` (may be absent)",
    "data.max_prompt_length": "tokens kept per prompt; a longer prompt keeps its last tokens",
    "data.shuffle": "reshuffle the prompt order every epoch (seeded by `trainer.seed`); false = file order",
    # reward
    "reward.function": "rule-based reward `module:function`, called per sequence as "
                       "`fn(prompt=, response=, ground_truth=)` → float",
    "reward.model_path": "sequence-classification HF directory; score = logit 0 at the last token",
    "reward.on_error": "a score that is not a finite number, or a raising function: `fail` (one line naming "
                       "the prompt index and value), `zero` (score 0), `skip` (its group's mean: no gradient); "
                       "counted in `reward/errors`",
    # algorithm
    "algorithm.name": "`grpo`: group-relative advantages, no critic; `ppo`: GAE advantages from a critic",
    "algorithm.sampling": "how the rollout engine samples responses",
    "algorithm.sampling.n": "responses sampled per prompt; for GRPO one group (needs ≥ 2)",
    "algorithm.sampling.temperature": "sampling temperature; training logprobs use the same temperature",
    "algorithm.sampling.top_p": "nucleus sampling: smallest token set holding this probability mass; 1 = off",
    "algorithm.sampling.top_k": "sample among the k most likely tokens; 0 = off",
    "algorithm.sampling.max_new_tokens": "response length cap in tokens (hits count in `response_length/clip_ratio`)",
    "algorithm.sampling.stop": "stop strings: a response ends after the first one it produces",
    "algorithm.kl": "KL penalty to the frozen reference policy",
    "algorithm.kl.coef": "weight of the KL penalty; 0 also skips the ref model",
    "algorithm.kl.in_reward": "PPO: subtract coef × KL from the token rewards instead of adding it to the "
                              "actor loss (GRPO then applies no KL at all)",
    "algorithm.clip_ratio_low": "PPO clip: the probability ratio is clipped below at 1 − this",
    "algorithm.clip_ratio_high": "PPO clip: the ratio is clipped above at 1 + this (> low = clip-higher)",
    "algorithm.entropy_coef": "weight of the entropy bonus in the actor loss; 0 = off",
    "algorithm.value_clip": "PPO critic: new values are clipped to old ± this; null = no value clipping",
    "algorithm.gamma": "PPO: per-token discount in GAE",
    "algorithm.lam": "PPO: GAE λ, bias (0) versus variance (1 = Monte Carlo returns)",
    "algorithm.norm_adv_by_std": "GRPO: divide advantages by the group's std; false = subtract the mean only",
    "algorithm.ppo_epochs": "passes over each step's batch (each pass shuffles and cuts mini-batches)",
    "algorithm.mini_batch_size": "sequences per optimizer step; null = the whole `trainer.batch_size`",
    "algorithm.micro_batch_size": "sequences per forward/backward (gradient accumulation); null = a mini-batch",
    "algorithm.critic_warmup_steps": "PPO: first steps that update only the critic, not the actor",
    "algorithm.max_staleness": "policy versions a rollout may lag the actor; 0 = strictly on-policy",
    # trainer
    "trainer.total_steps": "RL steps to run (each: generate → score → advantages → update)",
    "trainer.batch_size": "sequences (prompts × sampling.n) per step",
    "trainer.seed": "seed of Python, NumPy, torch and the prompt order",
    "trainer.run_name": "`verl-hpc train` without `--run-dir` uses `runs/<run_name>`; null = the config file's "
                        "name without `.yaml` (so the same command resumes)",
    "trainer.actor_optim": "AdamW and LR schedule of the actor (the policy)",
    "trainer.critic_optim": "AdamW and LR schedule of the critic (PPO only)",
    "trainer.<optim>.lr": "peak learning rate of the {role}",
    "trainer.<optim>.betas": "AdamW (β1, β2) of the {role}",
    "trainer.<optim>.weight_decay": "AdamW decoupled weight decay of the {role}",
    "trainer.<optim>.grad_clip": "clip the {role}'s global gradient norm to this; null = no clipping",
    "trainer.<optim>.warmup_steps": "steps of linear LR warm-up before the schedule; 0 = none",
    "trainer.<optim>.schedule": "LR after warm-up: `constant`, or `cosine` decay to 0 at `total_steps`",
    "trainer.save_hf_model": "export the trained policy to `<run_dir>/hf_model` at the end",
    "trainer.torch_threads": "torch CPU threads (`torch.set_num_threads`); null = torch's default (the local launcher's ranks share the machine's cores unless OMP_NUM_THREADS is set)",
    "trainer.oom_retry": "on an out-of-memory error, retry the step's update (or generation) with half the micro-batch (docs/elastic.md)",
    "trainer.min_micro_batch_size": "the smallest micro-batch an OOM retry may use; below it the run fails with the numbers",
    # resources
    "resources.actor": "the policy being trained",
    "resources.critic": "PPO value model; absent = shares the actor's devices",
    "resources.ref": "frozen reference policy for the KL penalty; absent = shares the actor's devices",
    "resources.reward": "reward model or function workers; absent = scored in the trainer",
    "resources.rollout": "the generation engine",
    "resources.placement": "`colocated`: rollout time-shares the actor's devices; `split`: disjoint devices",
    "resources.comm_backend": "torch.distributed backend; `auto` = nccl if actor, critic or ref is on CUDA, "
                              "else gloo",
    "resources.timeout_seconds": "timeout of collective operations between processes, in seconds",
    "resources.comm_env": "environment for every worker before the process group starts: `NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`, `NCCL_IB_*`, `NCCL_DEBUG`, `TORCH_NCCL_ASYNC_ERROR_HANDLING` (on by default with NCCL)",
    "resources.<role>.device_type": "where the {role} runs: `cuda` or `cpu`",
    "resources.<role>.device_ids": "device indices the {role} uses on a node; one process per id",
    "resources.<role>.strategy": "how the {role} runs its model; valid for {role}: {valid}",
    "resources.<role>.vllm_args": "vLLM engine arguments; only with `strategy: vllm` (roles: {vllm_roles})",
    "resources.<role>.vllm_args.tensor_parallel_size": "GPUs one vLLM engine shards the model over",
    "resources.<role>.vllm_args.gpu_memory_utilization": "fraction of each GPU's memory vLLM claims "
                                                         "(weights + KV cache)",
    "resources.<role>.vllm_args.enforce_eager": "disable CUDA graphs: slower decoding, faster start, less memory",
    "resources.<role>.vllm_args.max_model_len": "longest prompt + response in tokens; null = the model's limit",
    "resources.<role>.vllm_args.dtype": "vLLM weight dtype; `auto` = the model's",
    "resources.<role>.vllm_args.seed": "seed of the engine's sampler",
    "resources.<role>.vllm_args.kv_cache_space_gb": "CPU engine: KV-cache size in GiB; null = vLLM's default",
    "resources.<role>.vllm_args.enable_sleep_mode": "release the engine's GPU memory while the actor trains",
    "resources.<role>.nodes": "Slurm nodes of the {role}'s hetjob component",
    "resources.<role>.tasks_per_node": "Slurm `--ntasks-per-node` for the {role}; null = not requested",
    "resources.<role>.gpus_per_node": "Slurm `--gpus-per-node` for the {role}; null = not requested",
    "resources.<role>.cpus_per_task": "Slurm `--cpus-per-task` for the {role}",
    "resources.<role>.mem": "Slurm `--mem` per node for the {role}, e.g. `64G`; null = the partition default",
    "resources.<role>.partition": "Slurm `--partition` for the {role}; null = the cluster default",
    "resources.<role>.account": "Slurm `--account` for the {role}; null = your default account",
    "resources.<role>.qos": "Slurm `--qos` for the {role}; null = the default QOS",
    "resources.<role>.constraint": "Slurm `--constraint` (node features) for the {role}; null = none",
    "resources.env.mem": "Slurm `--mem` per node of the env component; null = the partition default",
    "resources.env.partition": "Slurm `--partition` of the env component (CPU nodes); null = the cluster default",
    "resources.env.account": "Slurm `--account` of the env component; null = your default account",
    "resources.env.qos": "Slurm `--qos` of the env component; null = the default QOS",
    "resources.env.constraint": "Slurm `--constraint` of the env component; null = none",
    # checkpoint
    "checkpoint.interval_steps": "save every N steps; null = no step-based saves",
    "checkpoint.interval_minutes": "save once this many minutes passed since the last save; null = off",
    "checkpoint.keep_last": "newest checkpoints kept; older ones are deleted",
    "checkpoint.keep_every": "also keep checkpoints whose step is a multiple of this; null = none",
    "checkpoint.async": "write checkpoints in the background while training continues",
    "checkpoint.resume": "`auto`: from the run directory's latest checkpoint if any; `never`; or a path",
    # logging
    "logging.tensorboard": "false drops `tensorboard` from `logging.sinks` (`metrics.jsonl` is written either way)",
    "logging.prometheus": "Prometheus exposition ([docs/monitoring.md](monitoring.md))",
    "logging.wandb": "Weights & Biases, offline by default",
    "logging.wandb.project": "the wandb project",
    "logging.wandb.entity": "the wandb entity (team or user); none: wandb's default",
    "logging.mlflow": "MLflow tracking",
    "logging.mlflow.experiment": "the MLflow experiment the run's runs go to",
    "logging.log_every": "record metrics every N steps (and at the last step)",
    "logging.sample_every": "every N steps, log a table of prompts, responses and scores to TensorBoard",
    "logging.num_samples": "rows in that sample table (trainer rank 0's own rows); 0 = no samples",
    "logging.progress": "`bar` (tqdm), `lines` (one line per 10 s), `off`; `auto` = bar on a terminal",
    "logging.level": "log level of the per-role log files and the console",
    # slurm
    "slurm.time": "wall-clock limit of the job, `HH:MM:SS` or `D-HH:MM:SS`",
    "slurm.job_name": "Slurm job name",
    "slurm.requeue": "requeue the job when it is preempted or nears its time limit",
    "slurm.signal_grace_seconds": "seconds before the time limit at which Slurm sends its notice (the backstop "
                                  "of the deadline; docs/slurm.md, Time limits)",
    "slurm.requeue_margin_seconds": "what a stop leaves before the end time for the requeue: the run stops where "
                                    "the next step + a save + this no longer fit (also `verl-hpc train --time-limit`)",
    "slurm.max_requeues": "give up after this many requeues",
    "slurm.setup": "shell lines run before the job starts (e.g. `module load cuda`)",
}


@dataclass
class Section:
    """One table: a section's dotted path, its one-line summary and its rows."""

    path: str
    summary: str
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)


class _Context(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The config class a field holds (directly or as `X | None`), else None."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _strip_none(annotation: Any) -> tuple[Any, bool]:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) < len(get_args(annotation)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True  # noqa: UP007
    return annotation, False


def _num(value: float) -> str:
    return f"{value:g}"


def bounds(info: FieldInfo) -> str:
    """`≥ 1`, `> 0`, `in (0, 1]` from the field's ge/gt/le/lt constraints."""
    low = high = None
    for meta in info.metadata:
        for attr, side in (("ge", "["), ("gt", "("), ("le", "]"), ("lt", ")")):
            value = getattr(meta, attr, None)
            if value is not None and attr in ("ge", "gt"):
                low = (side, value)
            elif value is not None:
                high = (side, value)
    if low and high:
        return f" in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
    if low:
        return f" {'≥' if low[0] == '[' else '>'} {_num(low[1])}"
    if high:
        return f" {'≤' if high[0] == ']' else '<'} {_num(high[1])}"
    return ""


def type_name(annotation: Any) -> str:
    """A readable name: `int`, `list[str]`, `"grpo" | "ppo"`, `section`."""
    if model_in(annotation) is not None:
        return "section"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, tuple, dict, set):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def render_type(path: str, info: FieldInfo) -> str:
    annotation, optional = _strip_none(info.annotation)
    text = type_name(annotation) + bounds(info)
    role = _role_of(path)
    if role is not None and path == f"resources.{role}.strategy":
        text = " | ".join(json.dumps(s) for s in VALID_STRATEGIES[role])
    return f"{text}, optional" if optional else text


def yaml_value(value: Any) -> str:
    """A default as it would be written in the YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value and value.strip() == value and ":" not in value else json.dumps(value)
    return repr(value)


def render_default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{yaml_value(value)}`"


def _role_of(path: str) -> str | None:
    parts = path.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "resources" and parts[1] in ROLE_NAMES else None


def description(path: str, info: FieldInfo) -> str | None:
    """`Field(description=...)` wins; else the exact path, else its template prefix."""
    if info.description:
        return info.description
    text, role = DESCRIPTIONS.get(path), None
    for prefix, (template, name) in TEMPLATES.items():
        if text is None and path.startswith(prefix + "."):
            text, role = DESCRIPTIONS.get(template + path[len(prefix):]), name
    if text is None:
        return None
    valid = ", ".join(f"`{s}`" for s in VALID_STRATEGIES.get(role or "", ()))
    presets = ", ".join(f"`{p}`" for p in PRESETS)
    vllm_roles = ", ".join(r for r, allowed in VALID_STRATEGIES.items() if "vllm" in allowed)
    return text.format_map(_Context(role=role or "", valid=valid, presets=presets, vllm_roles=vllm_roles))


def walk(model: type[BaseModel], prefix: str, summary: str, missing: list[str]) -> list[Section]:
    """The section for `model` at `prefix`, followed depth-first by its nested sections."""
    section, nested = Section(prefix, summary), []
    for name, info in model.model_fields.items():
        key = info.alias or name
        path = f"{prefix}.{key}" if prefix else key
        text = description(path, info)
        if text is None:
            missing.append(path)
        section.rows.append((path, render_type(path, info), render_default(info), text or ""))
        child = model_in(info.annotation)
        if child is not None:
            nested.extend(walk(child, path, text or "", missing))
    return [section, *nested]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sentence(text: str) -> str:
    """`the policy model` -> `The policy model.`; words such as `vLLM` keep their case."""
    if text.split()[0].islower():
        text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def render(sections: list[Section]) -> str:
    lines = [
        "<!-- Generated by `python tools/gen_config_docs.py` from verl_hpc/config/; edit the schema or the",
        "     script's DESCRIPTIONS, then rerun it. Hand edits inside the markers are overwritten. -->",
        "",
    ]
    for section in sections:
        title = f"`{section.path}`" if section.path else "Top level"
        lines += [f"### {title}", ""]
        if section.summary:
            lines += [_sentence(section.summary), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for path, kind, default, text in section.rows:
            lines.append(f"| `{path}` | `{_cell(kind)}` | {_cell(default)} | {_cell(text)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    args = parser.parse_args(argv)
    missing: list[str] = []
    sections = walk(RunConfig, "", "", missing)
    sections[0].rows.insert(0, (BASE_KEY, "str, optional", "`null`", DESCRIPTIONS[BASE_KEY]))  # a key of the file
    if missing:
        print(f"no description for: {', '.join(missing)} (add them to DESCRIPTIONS in {Path(__file__).name})",
              file=sys.stderr)
        return 1
    return write_or_check(DOC, str(DOC.relative_to(REPO)), render(sections), BEGIN, END, args.check, "tools/gen_config_docs.py")


if __name__ == "__main__":
    sys.exit(main())
