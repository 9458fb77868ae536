"""The direct intake's parts: who owns a row, where an endpoint binds, rows routed to their owners.

The end-to-end proof (replayed rollouts through W = 1, 2, 3 trainer ranks) is in
tests/runtime/test_placement_equivalence.py; these pin the pure layout inverses and the routing over
real Flight endpoints on loopback.
"""

from __future__ import annotations

import numpy as np
import pytest

from verl_hpc.data.layout import even_owner, even_slices, rank_rows, row_owner
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.transport.rollouts.intake import RolloutRouter, TrainerIntake, bind_host, positions

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


@pytest.mark.parametrize("same_node", [True, False], ids=["unix-socket", "flight"])
def test_a_trainer_rank_with_a_full_buffer_does_not_hold_up_the_others_rows(same_node: bool) -> None:
    """Rank 0's buffer is full: rank 1 still gets its part at once; rank 0's lands when it makes room.

    Before the router sent its parts at the same time, rank 1 waited behind rank 0's blocked put.
    """
    import threading

    intakes = [TrainerIntake("127.0.0.1", TOKEN, capacity=1) for _ in range(2)]
    local = [i.local_location for i in intakes] if same_node else None
    router = RolloutRouter([i.location for i in intakes], TOKEN, "rollout0", local)
    try:
        router.put(_batch(1, 2, step=0), np.array([0, 0]))  # fills rank 0's buffer (capacity 1)
        batch = _batch(2, 2, step=1)
        done = threading.Event()
        worker = threading.Thread(target=lambda: (router.put(batch, np.array([0, 0, 1, 1])), done.set()))
        worker.start()
        got = intakes[1].server.get(timeout=20)  # rank 1's rows, while rank 0's put is still blocked
        assert positions(got, 2).tolist() == [2, 3] and not done.is_set()
        assert intakes[0].server.stats()["waiting_puts"] == 1
        assert int(intakes[0].server.get(timeout=20).column("step")[0].as_py()) == 0  # rank 0 makes room
        worker.join(timeout=20)
        assert done.is_set()
        last = intakes[0].server.get(timeout=20)
        assert int(last.column("step")[0].as_py()) == 1 and positions(last, 2).tolist() == [0, 1]
        assert intakes[0].server.stats()["duplicates"] == 0
    finally:
        router.close()
        for intake in intakes:
            intake.shutdown()


def test_a_refused_part_is_raised_after_the_other_parts_have_landed() -> None:
    """Rank 0 refuses its part (a wrong token there): the put raises, and rank 1's part still landed."""
    import pyarrow.flight as flight

    intakes = [TrainerIntake("127.0.0.1", "another-secret"), TrainerIntake("127.0.0.1", TOKEN)]
    router = RolloutRouter([i.location for i in intakes], TOKEN, "rollout0", [i.local_location for i in intakes])
    try:
        with pytest.raises(flight.FlightUnauthenticatedError):
            router.put(_batch(2, 2, step=3), np.array([0, 0, 1, 1]))
        assert positions(intakes[1].server.get(timeout=20), 2).tolist() == [2, 3]
        assert intakes[0].server.stats()["queued"] == 0
    finally:
        router.close()
        for intake in intakes:
            intake.shutdown()
