"""The direct intake's parts: who owns a row, where an endpoint binds, rows routed to their owners.

The end-to-end proof (replayed rollouts through W = 1, 2, 3 trainer ranks) is in
tests/test_placement_equivalence.py; these pin the pure layout inverses and the routing over
real Flight endpoints on loopback.
"""

from __future__ import annotations

import numpy as np
import pytest

from verl_hpc.data.layout import even_owner, even_slices, rank_rows, row_owner
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.runtime.placement.intake import RolloutRouter, TrainerIntake, bind_host, positions

TOKEN = "intake-secret"


@pytest.mark.parametrize(("batch", "mini", "world"), [(128, 128, 1), (128, 64, 2), (96, 96, 3), (96, 48, 3),
                                                      (12, 6, 3), (32, 8, 4)])
def test_row_owner_inverts_the_training_layout(batch: int, mini: int, world: int) -> None:
    for rank in range(world):
        assert (row_owner(np.array(rank_rows(batch, mini, world, rank)), batch, mini, world) == rank).all()


def test_even_owner_inverts_even_slices() -> None:
    for total in range(30):
        for parts in range(1, 6):
            for part in range(parts):
                start, end = even_slices(total, parts, part)
                assert (even_owner(np.arange(start, end), total, parts) == part).all()


def test_bind_host_keeps_one_machine_on_loopback_and_opens_a_node_elsewhere() -> None:
    assert bind_host("127.0.0.1", is_leader=False) == "127.0.0.1"
    assert bind_host("localhost", is_leader=False) == "localhost"
    assert bind_host("::1", is_leader=False) == "::1"
    assert bind_host("node7", is_leader=True) == "node7"       # the leader binds the job's first host
    assert bind_host("node7", is_leader=False) == "0.0.0.0"    # another node: every interface, by hostname
    assert bind_host("10.0.0.5", is_leader=False) == "0.0.0.0"


def _batch(groups: int, n: int, step: int) -> RolloutBatch:
    rows = groups * n
    return RolloutBatch.from_generation([[1, 2]] * rows, [[3, g % 7 + 4] for g in range(rows)], None,
                                        group_ids=[r // n for r in range(rows)], prompt_index=list(range(rows)),
                                        ground_truth=["1"] * rows, policy_version=0, step=step,
                                        sample_index=[r % n for r in range(rows)])


@pytest.mark.parametrize("same_node", [True, False], ids=["unix-socket", "flight"])
def test_producers_send_each_trainer_rank_exactly_its_rows(same_node: bool) -> None:
    """Two producers, each half of the groups; three trainer ranks each get their rows, no others."""
    groups, n, world = 12, 4, 3
    batch_size = mini = groups * n
    intakes = [TrainerIntake("127.0.0.1", TOKEN) for _ in range(world)]
    local = [i.local_location for i in intakes] if same_node else None
    routers = [RolloutRouter([i.location for i in intakes], TOKEN, f"rollout{p}", local) for p in range(2)]
    assert all(c.same_node == same_node for r in routers for c in r.clients)
    try:
        whole = _batch(groups, n, step=5)
        for p, router in enumerate(routers):
            start, end = even_slices(groups, 2, p)
            part = whole.take(np.arange(start * n, end * n))
            router.put(part, row_owner(positions(part, n), batch_size, mini, world))
        for rank, intake in enumerate(intakes):
            mine = rank_rows(batch_size, mini, world, rank)
            got = intake.take(5, len(mine), 10.0, lambda have: f"only {have}")
            assert positions(got, n).tolist() == mine  # its rows, in the training order
            counts = intake.counters()
            assert counts["rows"] == len(mine) and counts["messages"] >= 1
            assert intake.counters()["rows"] == 0  # counted once per call
            assert (intake.server.stats()["streams_opened"] == 0) == same_node
            assert counts["local_messages"] == (counts["messages"] if same_node else 0)
    finally:
        for router in routers:
            router.close()
        for intake in intakes:
            intake.shutdown()


def test_restored_rollouts_are_refiled_for_this_rank_only() -> None:
    intake = TrainerIntake("127.0.0.1", TOKEN)
    try:
        saved = RolloutBatch.concat([_batch(4, 2, step=7), _batch(4, 2, step=8)])
        intake.restore(saved, lambda b: row_owner(positions(b, 2), 8, 8, 2) == 1)
        assert sorted(intake.pending) == [7, 8]
        assert positions(intake.take(7, 4, 1.0, str), 2).tolist() == [4, 5, 6, 7]
        assert len(intake.take(9, 0, 0.2, str)) == 0  # a rank with no rows of a key gets an empty batch
        with pytest.raises(TimeoutError, match="only 4"):
            intake.take(8, 5, 0.2, lambda have: f"only {have}")
    finally:
        intake.shutdown()
