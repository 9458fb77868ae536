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

When `max_num_gen_batches` rounds still hold too few informative groups (a policy that
has learned most prompts), the step trains on the groups it found (`on_exhausted:
train`): the largest number of them that every rank, and every role's group, can still
split evenly (`trainable_groups`), with a warning and `filter_groups/exhausted` = 1. When
not even one group can (none was informative: a policy that answers every prompt the
same way), the step trains on the last round's batch as generated, as GRPO without
dynamic sampling would: no policy gradient where a group's scores are equal, the KL and
entropy terms still act, and the run goes on. verl raises instead; `on_exhausted: error`
does too.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_hpc.config import RunConfig
from verl_hpc.data.prompts import PromptSampler
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.step.counters import Timer
from verl_hpc.runtime.step.stages import Collectives, Seat, Stages
from verl_hpc.utils.logging import get_logger

log = get_logger("trainer")


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


def filtered_rollouts(cfg: RunConfig, stages: Stages, collectives: Collectives, seat: Seat, step: int,
                      indices: list[int], policy_version: int, timer: Timer,
                      sampler: PromptSampler) -> tuple[RolloutBatch | None, dict[str, float]]:
    """This rank's rows (`seat.rows`) of a batch of informative groups, and the rounds' counts.

    Every round generates the rows of a full batch; a step that trains on fewer groups lays
    the seat out for them (`Seat.lay_out`) until the loop lays it out for the next step."""
    group_size = cfg.algorithm.sampling.n
    needed = cfg.trainer.batch_size // group_size
    kept: list[tuple[int, bytes]] = []  # (round, Arrow IPC of this rank's kept rows)
    have, generated = 0, 0
    for round_ in range(cfg.algorithm.filter_groups.max_num_gen_batches):
        if round_:
            stages.next_round(True)
            indices = sampler.next_indices()
        batch = last = stages.rollouts(step, indices, policy_version, timer, round_=round_)
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
    used = needed if have >= needed else _exhausted(cfg, seat, step, have, needed)
    metrics = {"filter_groups/num_gen_batches": float(len(kept)),
               "filter_groups/dropped_groups": float(generated - have), "filter_groups/kept_groups": float(used),
               "filter_groups/exhausted": float(have < needed)}
    if used == 0:  # the last round's rows, as generated for a full batch (the seat keeps its full layout)
        return last, metrics
    full = _ordered_batch([part for parts in collectives.gather_to_all(kept) for part in parts], used, group_size,
                          step)
    if used < needed:
        seat.lay_out(cfg, len(full))
    return full.take(seat.rows), metrics


def _exhausted(cfg: RunConfig, seat: Seat, step: int, have: int, needed: int) -> int:
    """The informative groups a step trains on when the rounds ran out: error, or the most that lay
    out evenly (0: none does, and the step trains on the last round as generated)."""
    rounds = cfg.algorithm.filter_groups.max_num_gen_batches
    found = f"step {step}: {have} of {needed} prompt groups had scores that were not all equal after {rounds} " \
            "generation rounds"
    if cfg.algorithm.filter_groups.on_exhausted == "error":
        raise RuntimeError(f"{found} (hint: raise algorithm.filter_groups.max_num_gen_batches, check that the "
                           "reward can tell responses apart, or set algorithm.filter_groups.on_exhausted: train)")
    n = cfg.algorithm.sampling.n
    used = trainable_groups(have, n, cfg.algorithm.mini_batch_size or cfg.trainer.batch_size, seat.world,
                            layout_worlds(cfg), cfg.algorithm.estimator.whole_groups)
    if seat.is_leader and used == 0:
        log.warning("%s; too few to split evenly, so training on the last round's %d groups as generated (no "
                    "policy gradient where a group's scores are equal; algorithm.filter_groups.on_exhausted: train)",
                    found, cfg.trainer.batch_size // n)
    elif seat.is_leader:
        log.warning("%s; training on %d of them (%d sequences; algorithm.filter_groups.on_exhausted: train)",
                    found, used, used * n)
    return used


def layout_worlds(cfg: RunConfig) -> list[int]:
    """Process counts of the role groups that split the step's rows by data/layout.py besides the
    trainers: a critic or an FSDP reference on devices of its own (as config/checks.py `_check_layout`)."""
    res, algo, worlds = cfg.resources, cfg.algorithm, []
    if algo.needs_critic and res.critic is not None and res.critic.device_ids != res.actor.device_ids:
        worlds.append(res.critic.world_size)
    if algo.needs_ref and res.ref is not None and res.ref.device_ids != res.actor.device_ids \
            and res.ref.strategy == "fsdp":
        worlds.append(res.ref.world_size)
    return worlds


def trainable_groups(have: int, n: int, mini_batch: int, world: int, other_worlds: list[int],
                     whole_groups: bool) -> int:
    """The most of `have` groups (of `n` rows) a smaller step can lay out like a full one.

    Its rows form whole mini-batches of `mini_batch`, or, when fewer than one, a single
    mini-batch of all of them; either way each of the `world` trainer ranks takes an equal
    share of every mini-batch (whole groups of it when the estimator needs them), and so
    does every other role group in `other_worlds`. 0 when no count of groups does.
    """
    for groups in range(have, 0, -1):
        rows = groups * n
        mini = min(mini_batch, rows)
        if rows % mini or any(mini % w for w in (world, *other_worlds)):
            continue
        if whole_groups and (mini // world) % n:
            continue
        return groups
    return 0


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
