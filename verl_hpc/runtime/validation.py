"""Validation: held-out prompts (`data.val_files`) generated and scored, never trained on.

Why on the trainer ranks' own engines: they hold the newest weights already (synced every
step), so validation costs generation and scoring only. Each trainer rank takes an even
slice of the validation prompts; the sums per data source are gathered on the leader,
which reports verl's `val-core/<data_source>/reward/mean@<val_n>`. Greedy by default
(top-k 1), so the number moves only when the policy does.
"""

from __future__ import annotations

from verl_hpc.config import RunConfig, SamplingConfig
from verl_hpc.data.layout import even_slices
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.allocator import generate_guarded
from verl_hpc.runtime.placement.base import Placement

DEFAULT_SOURCE = "val"  # rows whose file has no data_source column


def validation_sampling(cfg: RunConfig) -> SamplingConfig:
    sampling = cfg.algorithm.sampling
    return sampling.model_copy(update={"top_k": 1}) if cfg.trainer.val_greedy else sampling


def due(cfg: RunConfig, step: int) -> bool:
    """After every `test_freq` steps and after the last one; before training if `val_before_train`."""
    trainer = cfg.trainer
    if not cfg.data.val_files:
        return False
    if step == 0:
        return trainer.val_before_train
    return trainer.test_freq is not None and (step % trainer.test_freq == 0 or step == trainer.total_steps)


def validate(placement: Placement, policy_version: int) -> dict[str, float]:
    """This rank's slice generated and scored; the leader returns the metrics ({} elsewhere)."""
    roles, cfg = placement.roles, placement.cfg
    dataset, all_ids = roles.val_dataset, roles.val_prompt_ids
    if dataset is None or all_ids is None:
        raise RuntimeError("validation asked of a process without the validation set")
    n = cfg.trainer.val_n
    start, end = even_slices(len(all_ids), placement.world, placement.rank)
    index = [i for i in range(start, end) for _ in range(n)]
    prompt_ids = [all_ids[i] for i in index]
    engine = getattr(roles.engine, "inner", roles.engine)  # a replay engine validates with the real one
    engine.wake_up()  # type: ignore[union-attr]
    out = generate_guarded(engine, prompt_ids, validation_sampling(cfg), roles.allocator) if prompt_ids else None
    engine.sleep()  # type: ignore[union-attr]
    batch = RolloutBatch.from_generation(
        prompt_ids, out.response_ids if out else [], out.logprobs if out else [], group_ids=index,
        prompt_index=index, ground_truth=[dataset.answers[i] for i in index], policy_version=policy_version,
        data_source=[dataset.data_sources[i] for i in index], extra_info=[dataset.extra_infos[i] for i in index])
    scores = roles.reward.score(batch).tolist() if len(batch) else []  # type: ignore[union-attr]
    sums: dict[str, list[float]] = {}
    for i, score in zip(index, scores, strict=True):
        entry = sums.setdefault(dataset.data_sources[i] or DEFAULT_SOURCE, [0.0, 0.0])
        entry[0] += float(score)
        entry[1] += 1.0
    parts = placement.gather_to_leader(sums)
    if parts is None:
        return {}
    merged: dict[str, list[float]] = {}
    for part in parts:
        for source, (total, count) in part.items():
            entry = merged.setdefault(source, [0.0, 0.0])
            entry[0] += total
            entry[1] += count
    return {f"val-core/{source}/reward/mean@{n}": total / count for source, (total, count) in sorted(merged.items())}
