"""DAPO's dynamic sampling (`algorithm.filter_groups`, Yu et al. 2025, section 3.2).

Why: a prompt group whose scores are all equal (all right, all wrong) has zero
group-relative advantage everywhere; it costs a full update and teaches nothing, and as
the policy improves more groups go that way, so the effective batch shrinks. DAPO drops
such groups and keeps generating rounds of new prompts until the batch holds
`trainer.batch_size / n` informative groups (at most `max_num_gen_batches` rounds).

How every placement gets the same batch: each trainer rank filters its own rows (the
estimator keeps a group's rows on one rank), the kept rows of all ranks are gathered,
ordered by (round, group, sample), cut to the batch, renumbered as groups 0..G-1 and
handed out by the usual layout (this rank's `Seat.rows`), so the update sees a batch laid out
exactly like an unfiltered one. The rounds are driven from here; a rollout group of its
own is told by the leader whether another round follows (`Stages.next_round`).
"""

from __future__ import annotations

import numpy as np
import torch

from verl_hpc.config import RunConfig
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.step.counters import Timer
from verl_hpc.runtime.step.stages import Collectives, Stages


def informative_rows(batch: RolloutBatch) -> np.ndarray:
    """Row indices of the groups whose scores are not all equal."""
    if not len(batch):
        return np.zeros(0, dtype=np.int64)
    groups = batch.column("group_id").to_numpy()
    scores = batch.scores().numpy().astype(np.float64)
    keep = np.zeros(len(groups), dtype=bool)
    for group in np.unique(groups):
        rows = groups == group
        keep[rows] = np.ptp(scores[rows]) > 0
    return np.nonzero(keep)[0]


def filtered_rollouts(cfg: RunConfig, stages: Stages, collectives: Collectives, rows_here: list[int], step: int,
                      indices: list[int], policy_version: int, timer: Timer,
                      sampler: PromptSampler) -> tuple[RolloutBatch | None, dict[str, float]]:
    """This rank's rows (`rows_here`) of a batch of informative groups, and the rounds' counts."""
    group_size = cfg.algorithm.sampling.n
    needed = cfg.trainer.batch_size // group_size
    kept: list[tuple[int, bytes]] = []  # (round, Arrow IPC of this rank's kept rows)
    have, generated = 0, 0
    for round_ in range(cfg.algorithm.filter_groups.max_num_gen_batches):
        if round_:
            stages.next_round(True)
            indices = sampler.next_indices()
        batch = stages.rollouts(step, indices, policy_version, timer, round_=round_)
        if batch is None:
            return None, {}
        rows = informative_rows(batch)
        kept.append((round_, batch.take(rows).to_ipc()))
        counts = collectives.reduce_sum(torch.tensor([len(rows), len(batch)], dtype=torch.float64))
        have += int(counts[0]) // group_size
        generated += int(counts[1]) // group_size
        if have >= needed:
            break
    stages.next_round(False)
    if have < needed:
        raise RuntimeError(
            f"step {step}: {have} of {needed} prompt groups had scores that were not all equal after "
            f"{cfg.algorithm.filter_groups.max_num_gen_batches} generation rounds (hint: raise "
            "algorithm.filter_groups.max_num_gen_batches, or check that the reward can tell responses apart)")
    full = _ordered_batch([part for parts in collectives.gather_to_all(kept) for part in parts], needed, group_size,
                          step)
    metrics = {"filter_groups/num_gen_batches": float(len(kept)),
               "filter_groups/dropped_groups": float(generated - have), "filter_groups/kept_groups": float(needed)}
    return full.take(rows_here), metrics


def _ordered_batch(parts: list[tuple[int, bytes]], groups: int, n: int, step: int) -> RolloutBatch:
    """The first `groups` kept groups by (round, group id), renumbered 0..groups-1, in row order."""
    batches = [(round_, RolloutBatch.from_ipc(ipc)) for round_, ipc in parts]
    keys = sorted({(round_, int(g)) for round_, b in batches for g in b.column("group_id").to_pylist()})[:groups]
    new_id = {key: i for i, key in enumerate(keys)}
    chosen = []
    for round_, b in batches:
        ids = b.column("group_id").to_pylist()
        rows = [i for i, g in enumerate(ids) if (round_, g) in new_id]
        if rows:
            part = b.take(rows)
            chosen.append(part.with_columns(
                group_id=np.array([new_id[(round_, g)] for g in part.column("group_id").to_pylist()], np.int64),
                step=np.full(len(rows), step, np.int64)))
    full = RolloutBatch.concat(chosen).sorted_by_row()
    if len(full) != groups * n:
        raise RuntimeError(f"dynamic sampling assembled {len(full)} rows, expected {groups * n}")
    return full
