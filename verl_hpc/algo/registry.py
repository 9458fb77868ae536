"""Advantage estimators and policy losses, registered by name with what they need.

Why a registry: config validation (is a group size of 1 allowed?), the process plan
(does this run need a critic?), placement (must a prompt's samples sit on one rank?) and
the loop (which function turns scores into advantages?) all ask the same question about
an algorithm. Each estimator answers it once, in its declaration, instead of every
layer carrying its own `if name == "ppo"` chain; adding one is a file, a test and a docs
row. A module outside the package can register too (see `algorithm.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

Reducer = Callable[[Tensor], Tensor]


def local_sum(tensor: Tensor) -> Tensor:
    """The reducer of a lone trainer: the sum over one rank is the tensor itself."""
    return tensor


@dataclass
class AdvantageInputs:
    """What an estimator may read for this rank's rows of the step.

    `reduce_sum` sums a tensor over every trainer rank (identity on one rank), so
    batch-level statistics (PPO whitening) come out the same on any number of ranks
    without gathering the batch. Rows of one prompt group are always on one rank when
    the estimator declares `whole_groups`.
    """

    scores: Tensor          # [B] sequence score
    group_ids: Tensor       # [B] prompt group of each row
    response_mask: Tensor   # [B, R]
    token_rewards: Tensor   # [B, R] score on the last token, minus the KL penalty when in the reward
    values: Tensor | None   # [B, R] critic values (estimators that need a critic)
    algo: Any               # the run's AlgorithmConfig (gamma, lam, norm_adv_by_std, ...)
    reduce_sum: Reducer = local_sum
    baselines: Tensor | None = None  # [B] score of the prompt's greedy response (`greedy_baseline`)


Estimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class EstimatorSpec:
    """An advantage estimator and what it asks of the run."""

    name: str
    compute: Estimator
    needs_critic: bool = False      # values from a critic role (and a critic update)
    whole_groups: bool = False      # all samples of a prompt on the same trainer rank
    min_group_size: int = 1         # samples per prompt (algorithm.sampling.n) at least
    token_rewards: bool = False     # reads token_rewards, so a KL penalty in the reward is meaningful
    doc: str = ""
    greedy_baseline: bool = False   # one greedy response per prompt is generated and scored (ReMax)


@dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss: (logprobs, old_logprobs, advantages, mask, algo) -> (loss, stats)."""

    name: str
    compute: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    doc: str = ""


ESTIMATORS: dict[str, EstimatorSpec] = {}
POLICY_LOSSES: dict[str, PolicyLossSpec] = {}


def register_estimator(name: str, *, needs_critic: bool = False, whole_groups: bool = False,
                       min_group_size: int = 1, token_rewards: bool = False,
                       greedy_baseline: bool = False) -> Callable[[Estimator], Estimator]:
    """Decorator: `@register_estimator("grpo", whole_groups=True, min_group_size=2)`."""

    def add(fn: Estimator) -> Estimator:
        if name in ESTIMATORS and ESTIMATORS[name].compute is not fn:
            raise ValueError(f"an advantage estimator named {name!r} is already registered "
                             f"({ESTIMATORS[name].compute.__module__})")
        ESTIMATORS[name] = EstimatorSpec(name, fn, needs_critic, whole_groups, min_group_size, token_rewards,
                                         (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
                                         greedy_baseline)
        return fn

    return add


def register_policy_loss(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in POLICY_LOSSES and POLICY_LOSSES[name].compute is not fn:
            raise ValueError(f"a policy loss named {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLossSpec(name, fn, (fn.__doc__ or "").strip().splitlines()[0]
                                             if fn.__doc__ else "")
        return fn

    return add


def get_estimator(name: str) -> EstimatorSpec:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise KeyError(f"no advantage estimator {name!r}; registered: {', '.join(sorted(ESTIMATORS))}") from None


def get_policy_loss(name: str) -> PolicyLossSpec:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise KeyError(f"no policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}") from None
