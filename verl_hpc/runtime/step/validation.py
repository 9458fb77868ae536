"""Validation: held-out prompts (`data.val_files`) generated and scored, never trained on.

Why on the engines that already hold the newest weights (the trainers' own in one process
and colocated, the rollout group's in split placement, synced for the step being validated):
validation then costs generation and scoring only. Each generating rank takes an even slice
of the validation prompts; rows are scored where the run scores (a local reward, or the
reward group, which knows the schedule from the config and serves one exchange more); the
sums per data source are gathered on the leader, which reports verl's
`val-core/<data_source>/reward/mean@<val_n>`. Greedy by default (top-k 1), so the number
moves only when the policy does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_hpc.config import RunConfig, SamplingConfig
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.allocator import generate_guarded
from verl_hpc.roles.reward import scored

if TYPE_CHECKING:
    from verl_hpc.runtime.build import Roles
    from verl_hpc.runtime.step.stages import Collectives, Stages

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


def validation_rows(roles: Roles, cfg: RunConfig, start: int, end: int, policy_version: int,
                    step: int) -> RolloutBatch:
    """Validation prompts [start, end), each `val_n` times, generated (and scored if a reward is local).

    Row r = prompt * val_n + sample is filed as group r // n, sample r % n (n: the training
    group size), so row positions stay unique wherever rows travel by position (reward group).
    """
    dataset, all_ids = roles.val_dataset, roles.val_prompt_ids
    if dataset is None or all_ids is None:
        raise RuntimeError("validation asked of a process without the validation set")
    val_n, n = cfg.trainer.val_n, cfg.algorithm.sampling.n
    index = [i for i in range(start, end) for _ in range(val_n)]
    rows = [i * val_n + j for i in range(start, end) for j in range(val_n)]
    prompt_ids = [all_ids[i] for i in index]
    if roles.agent is not None and index:  # multi-turn: validation rows are episodes too
        batch = roles.agent.rows(step, [r // n for r in rows], [r % n for r in rows], index, dataset,
                                 validation_sampling(cfg), policy_version, keep=False)
        return batch.with_columns(score=roles.reward.score(batch)) if roles.reward is not None else batch
    engine = getattr(roles.engine, "inner", roles.engine)  # a replay engine validates with the real one
    engine.wake_up()  # type: ignore[union-attr]
    out = generate_guarded(engine, prompt_ids, validation_sampling(cfg), roles.allocator) if prompt_ids else None
    engine.sleep()  # type: ignore[union-attr]
    batch = RolloutBatch.from_generation(
        prompt_ids, out.response_ids if out else [], out.logprobs if out else [], group_ids=[r // n for r in rows],
        prompt_index=index, ground_truth=[dataset.ground_truths[i] for i in index], policy_version=policy_version,
        step=step, sample_index=[r % n for r in rows], data_source=[dataset.data_sources[i] for i in index],
        extra_info=[dataset.extra_infos[i] for i in index])
    if roles.reward is not None and len(batch):
        batch = scored(batch, roles.reward)
    return batch


def validate(cfg: RunConfig, stages: Stages, collectives: Collectives, policy_version: int,
             step: int) -> dict[str, float]:
    """Trainer ranks: this rank's rows generated and scored; the leader returns the metrics ({} elsewhere)."""
    batch = stages.validation_rollouts(step, policy_version)
    scored = stages.score_validation(batch)
    sums: dict[str, list[float]] = {}
    sources = scored.column("data_source").to_pylist() if len(scored) else []
    for source, score in zip(sources, scored.column("score").to_pylist() if len(scored) else [], strict=True):
        entry = sums.setdefault(source or DEFAULT_SOURCE, [0.0, 0.0])
        entry[0] += float(score)
        entry[1] += 1.0
    parts = collectives.gather_to_leader(sums)
    if parts is None:
        return {}
    merged: dict[str, list[float]] = {}
    for part in parts:
        for source, (total, count) in part.items():
            entry = merged.setdefault(source, [0.0, 0.0])
            entry[0] += total
            entry[1] += count
    n = cfg.trainer.val_n
    return {f"val-core/{source}/reward/mean@{n}": total / count for source, (total, count) in sorted(merged.items())}
