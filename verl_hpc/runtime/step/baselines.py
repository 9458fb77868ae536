"""Greedy baselines (estimators that declare `greedy_baseline`, ReMax): one greedy response
per prompt, generated and scored beside the sampled ones.

Why where the rows are generated: that process holds the engine with the step's weights
and (config checks see to it) the reward, so the baseline costs one more generate call on
the same engine and travels with its rows (`baseline_score`) through any placement. A
group's rows all sit on one generating rank (`whole_groups`), so each prompt's greedy
response is generated once.
"""

from __future__ import annotations

import torch

from verl_hpc.config import RunConfig
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.allocator import generate_guarded
from verl_hpc.runtime.build import Roles


def add_greedy_baselines(roles: Roles, cfg: RunConfig, batch: RolloutBatch) -> RolloutBatch:
    """`batch` with `baseline_score`: the score of its prompt's greedy response."""
    if not len(batch):
        return batch
    if roles.reward is None:
        raise RuntimeError("a greedy baseline is scored where it is generated, and no reward runs here")
    groups = batch.column("group_id").to_pylist()
    prompts = batch.column("prompt_index").to_pylist()
    first_rows: dict[int, int] = {}
    for row, group in enumerate(groups):
        first_rows.setdefault(group, row)
    rows = list(first_rows.values())
    index = [prompts[r] for r in rows]
    prompt_ids = [roles.prompt_ids[i] for i in index]
    engine = getattr(roles.engine, "inner", roles.engine)  # a replay engine's real one
    greedy = cfg.algorithm.sampling.model_copy(update={"top_k": 1})
    out = generate_guarded(engine, prompt_ids, greedy, roles.allocator)
    dataset = roles.dataset
    greedy_rows = RolloutBatch.from_generation(
        prompt_ids, out.response_ids, out.logprobs, group_ids=[groups[r] for r in rows], prompt_index=index,
        ground_truth=[dataset.ground_truths[i] for i in index], policy_version=int(batch.column("policy_version")[0].as_py()),
        data_source=[dataset.data_sources[i] for i in index], extra_info=[dataset.extra_infos[i] for i in index])
    scores = roles.reward.score(greedy_rows).tolist()
    by_group = dict(zip(first_rows, scores, strict=True))
    return batch.with_columns(baseline_score=torch.tensor([by_group[g] for g in groups], dtype=torch.float32))
