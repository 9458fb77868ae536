"""Per-step metrics with verl's names, computed from the step's tensors (pure functions)."""

from __future__ import annotations

import torch

from verl_hpc.algo import masked_mean, masked_var


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
    """Scores, rewards, advantages, returns, values and response lengths of one batch."""
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
    out["response_length/clip_ratio"] = float((lengths >= max_new_tokens).float().mean())
    prompt_tokens = inputs["attention_mask"].sum() - mask.sum()
    out["prompt_length/mean"] = float(prompt_tokens) / mask.shape[0]
    return out


def perf_metrics(inputs: dict[str, torch.Tensor], step_seconds: float) -> dict[str, float]:
    total_tokens = float(inputs["attention_mask"].sum())
    return {"perf/total_num_tokens": total_tokens, "perf/time_per_step": step_seconds,
            "perf/throughput": total_tokens / max(step_seconds, 1e-9)}


def prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in values.items()}


def sync_metrics(moved: int, seconds: float) -> dict[str, float]:
    """Bytes and throughput of one weight update (0 GB/s when nothing moved)."""
    return {"perf/weight_sync_bytes": float(moved),
            "perf/weight_sync_gbps": moved / seconds / 1e9 if moved and seconds > 0 else 0.0}
