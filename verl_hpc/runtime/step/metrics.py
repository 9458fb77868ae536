"""Per-step metrics with verl's names, computed from the step's tensors (pure functions).

`data_metrics` is the definition over one whole batch. The trainer computes the same numbers
with `data_metrics_reduced`: every statistic is a sum or an extreme over rows, so each trainer
rank reduces partials of its own rows (two or three small all-reduces) instead of sending its
rows to rank 0, which at many nodes would funnel the whole step's data through one process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_hpc.algo import masked_mean, masked_sum, masked_var
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.data.trajectory import episode_counts, episode_metrics, episode_records

Reducer = Callable[[torch.Tensor], torch.Tensor]  # a 1-D float64 CPU tensor -> its sum/max over ranks
MASKED_KEYS = ("advantages", "returns", "values")


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def _masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    valid = values[mask.bool()]
    if valid.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(masked_mean(values, mask)), f"{prefix}/max": float(valid.max()),
            f"{prefix}/min": float(valid.min())}


def data_metrics(scores: torch.Tensor, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and response lengths of one batch.

    Response lengths count the tokens the model sampled (the loss mask): a multi-turn row's
    tool replies are not its length, and `clip_ratio` is the share that used the whole budget.
    """
    mask = inputs["response_mask"]
    lengths = mask.sum(dim=1)
    out = _stats("critic/score", scores)
    if "token_rewards" in inputs:
        out.update(_stats("critic/rewards", (inputs["token_rewards"] * mask).sum(dim=1)))
    for key in ("advantages", "returns", "values"):
        if key in inputs:
            out.update(_masked_stats(f"critic/{key}", inputs[key], mask))
    if "values" in inputs and "returns" in inputs:
        residual_var = masked_var(inputs["returns"] - inputs["values"], mask)
        out["critic/vf_explained_var"] = float(1.0 - residual_var / (masked_var(inputs["returns"], mask) + 1e-8))
    out.update(_stats("response_length", lengths))
    out["response_length/clip_ratio"] = float((lengths >= max_new_tokens).double().mean())
    out["prompt_length/mean"] = float(_prompt_tokens(inputs)) / mask.shape[0]
    return out


def _prompt_tokens(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Prompt tokens of the rows: attended positions left of the response columns.

    Why not attention minus the response mask: the response mask is the loss mask, and a
    multi-turn response holds inserted tokens (tool replies) that are neither prompt nor model's.
    """
    attention = inputs["attention_mask"]
    return attention[:, :attention.shape[1] - inputs["response_mask"].shape[1]].sum()


# --- the same numbers from reductions over the trainer ranks -----------------------------------


def _largest(x: torch.Tensor) -> torch.Tensor:
    """Max of `x`, -inf when empty: a rank without such entries leaves a max-reduction unchanged."""
    return torch.cat([x.reshape(-1), x.new_full((1,), float("-inf"))]).max()


def _extremes(maxes: dict[str, torch.Tensor], name: str, x: torch.Tensor,
              valid: torch.Tensor | None = None) -> None:
    """Max and negated min of `x` (of its `valid` entries): both reduce with one max."""
    high, low = x, -x
    if valid is not None:
        high, low = high.masked_fill(~valid, float("-inf")), low.masked_fill(~valid, float("-inf"))
    maxes[f"{name}/max"], maxes[f"{name}/neg_min"] = _largest(high), _largest(low)


def local_partials(scores: torch.Tensor, inputs: dict[str, torch.Tensor],
                   max_new_tokens: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's row counts and sums (to add up) and maxima (to max), float64 on the inputs' device."""
    mask = inputs["response_mask"].double()
    valid = mask != 0
    lengths = mask.sum(dim=1)
    scores = scores.to(mask.device, torch.float64)
    sums = {"rows": mask.new_tensor(float(mask.shape[0])), "score": scores.sum(), "length": lengths.sum(),
            "clipped": (lengths >= max_new_tokens).sum(), "attention": inputs["attention_mask"].sum(),
            "weight": mask.sum(), "valid": valid.sum(),  # weight: the model's response tokens (the loss mask)
            "prompt": _prompt_tokens(inputs).double()}
    maxes: dict[str, torch.Tensor] = {}
    _extremes(maxes, "score", scores)
    _extremes(maxes, "length", lengths)
    if "token_rewards" in inputs:
        rewards = (inputs["token_rewards"].double() * mask).sum(dim=1)
        sums["rewards"] = rewards.sum()
        _extremes(maxes, "rewards", rewards)
    for key in MASKED_KEYS:
        if key in inputs:
            sums[key] = masked_sum(inputs[key].double(), mask)
            _extremes(maxes, key, inputs[key].double(), valid)
    if "values" in inputs and "returns" in inputs:
        sums["residual"] = masked_sum(inputs["returns"].double() - inputs["values"].double(), mask)
    return sums, maxes


def deviation_partials(inputs: dict[str, torch.Tensor], sums: dict[str, float]) -> dict[str, torch.Tensor]:
    """Second pass of the variances: this rank's squared deviations from the *global* means.

    Why two passes: `masked_var` centres first; the one-pass sum-of-squares shortcut loses
    digits to cancellation when the mean is large next to the spread (returns often are).
    """
    mask = inputs["response_mask"].double()
    weight = sums["weight"] if sums["weight"] != 0 else 1.0
    returns = inputs["returns"].double()
    residual = returns - inputs["values"].double()
    return {"returns": masked_sum((returns - sums["returns"] / weight) ** 2, mask),
            "residual": masked_sum((residual - sums["residual"] / weight) ** 2, mask)}


def _variance(squared_deviations: float, weight: float) -> float:
    """`masked_var` from global sums: Bessel-corrected (n / (n - 1)) when more than one entry is valid."""
    var = squared_deviations / (weight if weight != 0 else 1.0)
    return var * (weight / (weight - 1)) if weight > 1 else var


def _stats_of(prefix: str, mean: float, maxes: dict[str, float], name: str) -> dict[str, float]:
    return {f"{prefix}/mean": mean, f"{prefix}/max": maxes[f"{name}/max"],
            f"{prefix}/min": -maxes[f"{name}/neg_min"]}


def metrics_from_partials(sums: dict[str, float], maxes: dict[str, float],
                          deviations: dict[str, float]) -> dict[str, float]:
    """`data_metrics`' keys and `perf/total_num_tokens`, from partials already reduced over the ranks."""
    rows = sums["rows"] or float("nan")
    out = _stats_of("critic/score", sums["score"] / rows, maxes, "score")
    if "rewards" in sums:
        out.update(_stats_of("critic/rewards", sums["rewards"] / rows, maxes, "rewards"))
    weight = sums["weight"] if sums["weight"] != 0 else 1.0
    for key in MASKED_KEYS:
        if key in sums and sums["valid"] > 0:  # `_masked_stats` leaves out a selection with nothing in it
            out.update(_stats_of(f"critic/{key}", sums[key] / weight, maxes, key))
    if deviations:
        residual_var = _variance(deviations["residual"], sums["weight"])
        returns_var = _variance(deviations["returns"], sums["weight"])
        out["critic/vf_explained_var"] = 1.0 - residual_var / (returns_var + 1e-8)
    out.update(_stats_of("response_length", sums["length"] / rows, maxes, "length"))
    out["response_length/clip_ratio"] = sums["clipped"] / rows
    out["prompt_length/mean"] = sums["prompt"] / rows
    out["perf/total_num_tokens"] = sums["attention"]
    return out


def _reduce(parts: dict[str, torch.Tensor], reducer: Reducer) -> dict[str, float]:
    """One reduction for all named scalars: packed into one float64 CPU vector (one device sync)."""
    packed = torch.stack([v.to(torch.float64) for v in parts.values()]).cpu()
    return dict(zip(parts, reducer(packed).tolist(), strict=True))


def data_metrics_reduced(scores: torch.Tensor, inputs: dict[str, torch.Tensor], max_new_tokens: int,
                         reduce_sum: Reducer, reduce_max: Reducer) -> dict[str, float]:
    """`data_metrics` over every trainer rank's rows (plus `perf/total_num_tokens`), each rank
    passing only its own rows.

    Every trainer rank must call it, with the same input keys: the reducers are collectives.
    That is one sum and one max of a packed vector, and one more sum for
    `critic/vf_explained_var` (see `deviation_partials`). With one rank the reducers are the
    identity and the numbers are `data_metrics`' own, computed in float64.
    """
    local_sums, local_maxes = local_partials(scores, inputs, max_new_tokens)
    sums, maxes = _reduce(local_sums, reduce_sum), _reduce(local_maxes, reduce_max)
    deviations: dict[str, float] = {}
    if "values" in inputs and "returns" in inputs:
        deviations = _reduce(deviation_partials(inputs, sums), reduce_sum)
    return metrics_from_partials(sums, maxes, deviations)


def episode_metrics_reduced(batch: RolloutBatch, reduce_sum: Reducer, reduce_max: Reducer) -> dict[str, float]:
    """`agent/*` over every trainer rank's episodes of the step, read from the rows' `trajectory`
    records (so a split run's trainers see what its rollout ranks ran). Every trainer rank must
    call it when episodes are on: a rank may hold none and still joins the reductions."""
    sums, maxes = episode_counts(episode_records(batch) or [])
    sums_t = {k: torch.tensor(v, dtype=torch.float64) for k, v in sums.items()}
    maxes_t = {k: torch.tensor(v, dtype=torch.float64) for k, v in maxes.items()}
    return episode_metrics(_reduce(sums_t, reduce_sum), _reduce(maxes_t, reduce_max))


def perf_metrics(total_tokens: float, step_seconds: float) -> dict[str, float]:
    """Tokens (prompt + response, every trainer rank's rows) and throughput of one step."""
    return {"perf/total_num_tokens": total_tokens, "perf/time_per_step": step_seconds,
            "perf/throughput": total_tokens / max(step_seconds, 1e-9)}


def prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in values.items()}


def sync_metrics(moved: int, seconds: float, overlapped: bool = False) -> dict[str, float]:
    """Bytes and throughput of one weight update (0 GB/s when nothing moved).

    `overlapped`: the sender only posted the transfer (it crosses during the next step), so
    its seconds say nothing of the bandwidth; the rollout ranks' own metrics do.
    """
    if overlapped:
        return {"perf/weight_sync_bytes": float(moved), "perf/weight_sync_overlapped": 1.0}
    return {"perf/weight_sync_bytes": float(moved),
            "perf/weight_sync_gbps": moved / seconds / 1e9 if moved and seconds > 0 else 0.0}


def turn_versions(batch: RolloutBatch) -> list[list[int]]:
    """The policy version of each turn of each row: a multi-turn row's own stamps, else its row's."""
    rows = batch.column("policy_version").to_pylist()
    if batch.is_trajectory and batch.has("turn_versions"):
        return [turns or [row] for turns, row in zip(batch.column("turn_versions").to_pylist(), rows, strict=True)]
    return [[row] for row in rows]


def version_metrics(versions: list[list[int]], policy_version: int) -> dict[str, float]:
    """How old the step's turns are against the trainer's `policy_version`.

    `rollout/policy_lag` is the oldest turn's lag (the one `algorithm.max_staleness` bounds);
    with partial rollouts an episode's later turns may come from newer weights, which
    `rollout/turn_policy_lag_mean` and `rollout/spanning_episodes` (the share of episodes
    whose turns come from more than one version) show.
    """
    turns = [v for row in versions for v in row]
    if not turns:
        return {}
    return {"rollout/policy_lag": float(policy_version - min(turns)),
            "rollout/turn_policy_lag_mean": policy_version - sum(turns) / len(turns),
            "rollout/spanning_episodes": sum(len(set(row)) > 1 for row in versions) / len(versions)}
