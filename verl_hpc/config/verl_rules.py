"""The pieces verl's key table is made of: a row type, the view of verl's values, the putters.

Why apart from the table (config/verl_keys.py): a row reads as "verl key, verl default,
verl-hpc field, how"; the "how" that needs more than a copy (batch counts times
`rollout.n`, one KL from two verl switches, devices from `trainer.*`) lives here as a
small pure function of the value and the other verl values (`VerlArgs`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_hpc.config.errors import ConfigError


class _NotSet:
    def __repr__(self) -> str:
        return "(not set)"


NOT_SET: Any = _NotSet()  # a verl key with no default that matters here: its row applies only when given
ROLLOUT_N = "actor_rollout_ref.rollout.n"
TRAIN_BATCH = "data.train_batch_size"


@dataclass(frozen=True)
class VerlKey:
    """One verl key: verl 0.9.1's default, the verl-hpc field(s) it sets, and how (`put`)."""

    key: str
    default: Any
    target: str
    note: str = ""
    put: Callable[[Any, VerlArgs], list[tuple[str, Any]]] | None = None  # None: another row reads it


class VerlArgs:
    """verl's values as a run would see them: the given ones over verl's defaults."""

    def __init__(self, given: dict[str, Any], train_rows: int | None, defaults: dict[str, Any]):
        self.given, self.train_rows, self.defaults = given, train_rows, defaults
        self.notes: list[str] = []

    def get(self, key: str) -> Any:
        return self.given[key] if key in self.given else self.defaults.get(key, NOT_SET)

    def first(self, *keys: str) -> Any:
        """The first of `keys` given, else the first default that is set (verl's old and new spellings)."""
        given = [self.given[k] for k in keys if k in self.given]
        return given[0] if given else next((d for d in map(self.get, keys) if d is not NOT_SET), NOT_SET)

    def integer(self, key: str, low: int = 0) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(key, f"must be an integer >= {low} (got {value!r})")
        return value

    @property
    def n(self) -> int:
        return self.integer(ROLLOUT_N, 1)

    @property
    def world(self) -> int:
        return self.integer("trainer.n_gpus_per_node", 1) * self.integer("trainer.nnodes", 1)

    def total_steps(self) -> int:
        """trainer.total_training_steps, else total_epochs x (training rows // data.train_batch_size)."""
        steps = self.get("trainer.total_training_steps")
        if steps is not None:
            return self.integer("trainer.total_training_steps", 1)
        epochs, prompts = self.integer("trainer.total_epochs", 1), self.integer(TRAIN_BATCH, 1)
        if self.train_rows is None:
            raise ConfigError("trainer.total_epochs", "needs the number of training prompts, which is unknown here",
                              "give trainer.total_training_steps")
        if self.train_rows < prompts:
            raise ConfigError(TRAIN_BATCH, f"{prompts} prompts per step is more than the {self.train_rows} rows of "
                              "data.train_files", "use a smaller data.train_batch_size")
        return epochs * (self.train_rows // prompts)

    def comments(self) -> list[str]:
        n, prompts = self.n, self.integer(TRAIN_BATCH, 1)
        mini = self.integer("actor_rollout_ref.actor.ppo_mini_batch_size", 1)
        return [f"trainer.batch_size: {prompts * n} sequences = data.train_batch_size {prompts} prompts x "
                f"{ROLLOUT_N} {n}",
                f"algorithm.mini_batch_size: {min(mini, prompts) * n} sequences = actor.ppo_mini_batch_size "
                f"{mini} prompts x {ROLLOUT_N} {n}", *self.notes]


def set_path(config: dict[str, Any], path: str, value: Any) -> None:
    """config[a][b][c] = value for path "a.b.c", creating the sections on the way."""
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


# --- putters: (value, args) -> [(verl-hpc path, value)] -------------------------------------------


def to(path: str, cast: Callable[[Any], Any] | None = None) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """Copy the value to `path` (through `cast`); None stays None."""
    return lambda v, _: [(path, cast(v) if cast is not None and v is not None else v)]


def positive_or_none(path: str) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """verl's `-1`/`0`/null for "off" -> null."""
    return lambda v, _: [(path, v if isinstance(v, int | float) and v > 0 else None)]


def only(key: str, allowed: tuple[Any, ...], hint: str) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """A verl value verl-hpc has only one answer to: accepted when it is that answer, else refused."""
    def check(value: Any, _: VerlArgs) -> list[tuple[str, Any]]:
        if value not in allowed:
            raise ConfigError(key, f"{value!r} has no verl-hpc counterpart (accepted: {', '.join(map(repr, allowed))})",
                              hint)
        return []
    return check


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def sequences(path: str, key: str) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """A count of prompts -> sequences (x rollout.n); a mini-batch never more than the batch."""
    def put(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
        prompts = args.integer(key, 1)
        if path == "algorithm.mini_batch_size":
            prompts = min(prompts, args.integer(TRAIN_BATCH, 1))
        return [(path, prompts * args.n)]
    return put


def micro_batch(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    """Per-GPU micro-batch in sequences; the old global `ppo_micro_batch_size` is divided by the world."""
    per_gpu = args.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    if per_gpu is not None:
        return [("algorithm.micro_batch_size", args.integer("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1))]
    total = args.get("actor_rollout_ref.actor.ppo_micro_batch_size")
    if total is None:
        return []
    return [("algorithm.micro_batch_size", max(1, args.integer("actor_rollout_ref.actor.ppo_micro_batch_size", 1)
                                              // args.world))]


def clip(side: str) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """clip_ratio_low/high, falling back to clip_ratio when null (as verl's losses read them)."""
    return lambda v, a: [(f"algorithm.clip_ratio_{side}", v if v is not None else a.get(
        "actor_rollout_ref.actor.clip_ratio"))]


def kl(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    """verl's two switches -> one KL: a loss term (actor.use_kl_loss) or a reward penalty (use_kl_in_reward)."""
    from verl_hpc.algo.losses import KL_KINDS  # torch: imported only when converting

    in_loss, in_reward = bool(value), bool(args.get("algorithm.use_kl_in_reward"))
    if in_loss and in_reward:
        raise ConfigError("algorithm.use_kl_in_reward", "and actor_rollout_ref.actor.use_kl_loss are both true; "
                          "verl-hpc applies one KL, in the loss or in the reward", "set one of them to False")
    if not (in_loss or in_reward):
        return [("algorithm.kl", {"estimator": "off", "coef": 0.0, "in_reward": False})]
    kind_key = "actor_rollout_ref.actor.kl_loss_type" if in_loss else "algorithm.kl_penalty"
    coef_key = "actor_rollout_ref.actor.kl_loss_coef" if in_loss else "algorithm.kl_ctrl.kl_coef"
    kind = args.get(kind_key)
    if kind not in KL_KINDS:
        raise ConfigError(kind_key, f"{kind!r} is not a KL kind verl-hpc computes", f"use one of {', '.join(KL_KINDS)}")
    return [("algorithm.kl", {"estimator": kind, "coef": float(args.get(coef_key)), "in_reward": in_reward})]


ESTIMATORS = {"gae": ("ppo", "gae"), "grpo": ("grpo", "grpo"), "grpo_vectorized": ("grpo", "grpo"),
              "rloo": ("rloo", "rloo"), "rloo_vectorized": ("rloo", "rloo"),
              "reinforce_plus_plus": ("reinforce_pp", "reinforce_pp"),
              "reinforce_plus_plus_baseline": ("reinforce_pp_baseline", "reinforce_pp_baseline"),
              "remax": ("remax", "remax")}


def estimator(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    if value not in ESTIMATORS:
        raise ConfigError("algorithm.adv_estimator", f"{value!r} is not an estimator verl-hpc has",
                          f"use one of {', '.join(ESTIMATORS)}")
    name, ours = ESTIMATORS[value]
    if ours == "grpo" and args.get("algorithm.filter_groups.enable"):
        name = "dapo"
    return [("algorithm.name", name), ("algorithm.adv_estimator", ours)]


def filter_metric(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    if value in ("acc", "seq_final_reward") and args.get("algorithm.filter_groups.enable"):
        args.notes.append(f"algorithm.filter_groups.metric={value}: verl-hpc keeps the groups whose scores differ")
    elif value not in ("reward", "score", "seq_reward", "acc", "seq_final_reward"):
        raise ConfigError("algorithm.filter_groups.metric", f"{value!r} is not a metric verl-hpc filters on",
                          "use score (the reward's score)")
    return []


def gen_batches(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    if isinstance(value, int) and value > 0:
        return [("algorithm.filter_groups.max_num_gen_batches", value)]
    if args.get("algorithm.filter_groups.enable"):
        args.notes.append("algorithm.filter_groups.max_num_gen_batches: verl's 0 (no limit) is 100 rounds here")
    return [("algorithm.filter_groups.max_num_gen_batches", 100)]


def total_steps(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
    return [("trainer.total_steps", args.total_steps())]


def warmup(optim: str, prefix: str) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """lr_warmup_steps when > 0, else lr_warmup_steps_ratio x total steps (verl's rule)."""
    def put(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
        if isinstance(value, int) and value > 0:
            return [(f"trainer.{optim}.warmup_steps", value)]
        ratio = float(args.get(f"{prefix}.optim.lr_warmup_steps_ratio") or 0.0)
        return [(f"trainer.{optim}.warmup_steps", int(ratio * args.total_steps()) if ratio else 0)]
    return put


def schedule(optim: str, prefix: str) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """constant or cosine (to 0 over half a cycle: verl's min_lr_ratio 0 and num_cycles 0.5 only)."""
    def put(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
        style = args.get(f"{prefix}.optim.warmup_style") or value
        if style not in ("constant", "cosine"):
            raise ConfigError(f"{prefix}.optim.lr_scheduler_type", f"{style!r} has no verl-hpc counterpart",
                              "use constant or cosine")
        if style == "cosine" and (float(args.get(f"{prefix}.optim.min_lr_ratio") or 0.0) != 0.0
                                  or float(args.get(f"{prefix}.optim.num_cycles")) != 0.5):
            raise ConfigError(f"{prefix}.optim.min_lr_ratio", "verl-hpc's cosine decays to 0 over half a cycle",
                              "use min_lr_ratio=0.0 and num_cycles=0.5")
        return [(f"trainer.{optim}.schedule", style)]
    return put


def grad_clip(optim: str, prefix: str) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """`grad_clip` (older) or `optim.clip_grad`, whichever is given; verl's default 1.0."""
    return lambda v, a: [(f"trainer.{optim}.grad_clip", a.first(f"{prefix}.grad_clip", f"{prefix}.optim.clip_grad"))]


def same_as_actor(key: str, actor_key: str) -> Callable[[Any, VerlArgs], list[tuple[str, Any]]]:
    """A critic setting verl-hpc shares with the actor: accepted when equal, refused otherwise."""
    def check(value: Any, args: VerlArgs) -> list[tuple[str, Any]]:
        if value != args.get(actor_key):
            raise ConfigError(key, f"{value!r} differs from {actor_key}={args.get(actor_key)!r}; verl-hpc uses one "
                              "for the actor and the critic", f"give both the same value, or drop {key}")
        return []
    return check


def run_name(value: Any, _: VerlArgs) -> list[tuple[str, Any]]:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(value)).strip("-.") or "verl"
    return [("trainer.run_name", name), ("slurm.job_name", name)]
