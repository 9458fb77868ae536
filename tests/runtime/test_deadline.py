"""The time budget without a cluster: end times, estimates, the boundary rule, the watchdog.

Everything here is pure or in-process: the Slurm side (a real time limit on a loaded machine)
is tests/slurm/test_requeue.py.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from verl_hpc.runtime.process.deadline import (
    Action,
    Agreement,
    DeadlineClock,
    DeadlineWatchdog,
    RunningEstimate,
    TimeBudget,
    agree_max,
    boundary_action,
    notice_window_s,
    overdue,
    stop_path,
    stopping_signal,
)
from verl_hpc.runtime.process.endtime import (
    EndTime,
    end_time_from_scontrol,
    job_end_time,
    parse_end_time,
    parse_time_limit,
)

HETJOB = """JobId=2 HetJobId=2 HetJobOffset=0 JobName=verl-hpc-local
   JobState=RUNNING Reason=None Dependency=(null)
   RunTime=00:00:31 TimeLimit=00:02:00 TimeMin=N/A
   StartTime=2026-12-04T23:19:14 EndTime=2026-12-04T23:21:14 Deadline=N/A

JobId=3 HetJobId=2 HetJobOffset=1 JobName=verl-hpc-local
   StartTime=2026-12-04T23:19:14 EndTime=2026-12-04T23:21:10 Deadline=N/A
"""


def local(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()


# --- end times ---------------------------------------------------------------------------------

def test_scontrol_end_time_is_local_time_and_the_earliest_component_wins() -> None:
    assert parse_end_time("2026-12-04T23:21:14") == local("2026-12-04T23:21:14")
    assert end_time_from_scontrol(HETJOB) == local("2026-12-04T23:21:10")
    for none in ("Unknown", "None", "N/A", ""):
        assert parse_end_time(none) is None
    assert end_time_from_scontrol("JobId=5 EndTime=Unknown Deadline=N/A") is None
    with pytest.raises(ValueError, match="cannot read the end time"):
        parse_end_time("tomorrow")


def fake_scontrol(stdout: str, code: int = 0):
    calls: list[list[str]] = []

    def run(args, **_kw):  # type: ignore[no-untyped-def]
        calls.append(list(args))
        return subprocess.CompletedProcess(args, code, stdout, "")

    return run, calls


def test_job_end_time_prefers_our_variable_then_slurms_then_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    run, calls = fake_scontrol(HETJOB)
    assert job_end_time({"VERL_HPC_END_TIME": "1700000000.5", "SLURM_JOB_ID": "2"}, run) == \
        EndTime(1700000000.5, "VERL_HPC_END_TIME")
    assert job_end_time({"SLURM_JOB_END_TIME": "1700000100", "SLURM_JOB_ID": "2"}, run) == \
        EndTime(1700000100.0, "SLURM_JOB_END_TIME")
    assert calls == []
    assert job_end_time({"SLURM_JOB_ID": "2"}, run) == EndTime(local("2026-12-04T23:21:10"), "scontrol")
    assert calls == [["/usr/bin/scontrol", "show", "job", "2"]]
    assert job_end_time({}, run) == EndTime()  # not a job: no deadline, no scontrol call
    failing, _ = fake_scontrol("", code=1)
    assert not job_end_time({"SLURM_JOB_ID": "2"}, failing).known  # the signal stays the only notice
    with pytest.raises(ValueError, match="VERL_HPC_END_TIME"):
        job_end_time({"VERL_HPC_END_TIME": "soon"}, run)


def test_end_time_left() -> None:
    assert EndTime(100.0, "x").left(now=40.0) == 60.0
    assert EndTime().left() == float("inf") and not EndTime().known


@pytest.mark.parametrize(("text", "seconds"), [("30", 1800), ("0:45", 45), ("01:02:03", 3723), ("1-0", 86400),
                                               ("1-02:03", 93780), ("1-02:03:04", 93784), ("00:02:00", 120)])
def test_time_limits_in_slurms_formats(text: str, seconds: int) -> None:
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["", "ten", "1:2:3:4", "0", "-5", "1h"])
def test_bad_time_limits_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_time_limit(text)


# --- estimates and the rule --------------------------------------------------------------------

def test_the_estimate_is_the_slowest_recent_sample_and_forgets_old_ones() -> None:
    est = RunningEstimate()
    assert est.value is None
    for seconds in (10.0, 4.0, 5.0):  # a slow first step (start-up) ...
        est.add(seconds)
    assert est.value == 10.0
    for _ in range(8):  # ... is forgotten after a window of normal ones
        est.add(4.0)
    assert est.value == 4.0
    est.add(9.0)  # a burst of load shows at once
    assert est.value == 9.0
    assert RunningEstimate(prior=7.0).value == 7.0 and RunningEstimate(prior=0).value is None


def test_agreement_takes_the_slowest_estimates_and_the_least_time_left() -> None:
    ranks = [(None, TimeBudget(3.0, 1.0, float("inf")), False),  # a rank that does not know the end time
             (int(signal.SIGTERM), TimeBudget(5.0, 0.5, 80.0), False),
             (None, TimeBudget(4.0, 2.0, 90.0), True)]
    rows = [torch.tensor([float(s or 0), b.step_s, b.save_s, -b.left_s, float(a)], dtype=torch.float64)
            for s, b, a in ranks]
    reduced = torch.stack(rows).max(dim=0).values  # what the MAX all-reduce computes
    agreed = agree_max(*ranks[0], reduce_max=lambda _mine: reduced)
    assert agreed == Agreement(int(signal.SIGTERM), TimeBudget(5.0, 2.0, 80.0), True)
    assert agree_max(None, TimeBudget(), False, None) == Agreement()  # one process: its own view


def decide(left: float, step: float = 5.0, save: float = 2.0, margin: float = 15.0, **kw) -> Action:
    return boundary_action(Agreement(budget=TimeBudget(step, save, left), **kw), margin)


def test_the_boundary_rule() -> None:
    assert decide(float("inf")) is Action.CONTINUE                 # no end time: only signals stop
    assert decide(100.0) is Action.CONTINUE
    assert decide(2 * 5 + 2 + 15 - 0.1) is Action.SAVE_AHEAD       # the next boundary will likely stop
    assert decide(5 + 2 + 15 - 0.1) is Action.STOP                 # the next step would not fit: the deadline
    assert decide(2 + 15 + 0.1) is Action.STOP                     # late, but a save still fits
    assert decide(2 + 15 - 0.1) is Action.STOP_UNSAVED             # a save would not: stop at the newest one
    assert decide(100.0, save=90.0) is Action.STOP_UNSAVED         # the save in flight has most of it left
    assert decide(100.0, signum=int(signal.SIGTERM)) is Action.STOP
    assert decide(100.0, abandoned=True) is Action.ABANDONED
    last = Agreement(budget=TimeBudget(5.0, 2.0, 10.0))
    assert boundary_action(last, 15.0, last=True) is Action.CONTINUE  # the last step finishes the run
    assert boundary_action(Agreement(abandoned=True), 15.0, last=True) is Action.ABANDONED


def test_a_notice_inside_the_time_limit_window_is_left_to_the_deadline_rule() -> None:
    end, grace = 1000.0, 60.0
    window = notice_window_s(grace)  # 60 + 30 (slurmctld's period) + 5
    usr1 = int(signal.SIGUSR1)
    notice = {usr1: end - 87.0}  # measured: @60 came 87 s before the end
    assert stopping_signal(notice, end, grace) is None
    assert stopping_signal(notice, None, grace) == usr1  # no end time known: the notice stops the run
    early = {usr1: end - window - 1}  # long before any time-limit notice: a preemption
    assert stopping_signal(early, end, grace) == usr1
    assert stop_path(usr1, early, end, grace) == "preemption"
    both = {usr1: end - 87.0, int(signal.SIGTERM): end - 20.0}  # a TERM always stops, whatever came first
    assert stopping_signal(both, end, grace) == int(signal.SIGTERM)
    assert stop_path(int(signal.SIGTERM), both, end, grace) == "signal"
    assert stop_path(usr1, notice, None, grace) == "signal"
    assert stop_path(None, {}, end, grace) == "deadline"


def test_what_the_watchdog_reserves_in_each_phase() -> None:
    margin, save = 15.0, 6.0
    assert overdue("step", 20.0, save, margin) and not overdue("step", 22.0, save, margin)  # its save must fit
    assert not overdue("start", 20.0, save, margin) and overdue("start", 14.0, save, margin)
    assert not overdue("save", 16.0, save, margin) and overdue("save", 14.0, save, margin)
    assert not overdue("stopping", 1.0, save, margin)  # the stop is under way: nothing to abandon


def test_clock_samples_steps_between_boundaries_and_counts_a_save_in_flight() -> None:
    clock = DeadlineClock(EndTime(time.time() + 3600, "test"), 15.0, 60.0)
    clock.enter("step")
    time.sleep(0.05)
    clock.step_done()
    assert 0.04 < clock.budget().step_s < 1.0 and clock.phase == "boundary"
    clock.step_done()  # a boundary without a step in between adds no sample
    assert clock.steps.count == 1
    clock.add_saves([0.2])
    clock.save_in_flight_since = time.monotonic() - 3.0  # an async save writing for 3 s already
    assert 3.0 <= clock.save_estimate() < 3.5  # at least that long, and it has nothing left by the estimate
    clock.add_saves([5.0])
    assert 6.5 < clock.save_estimate() <= 7.0  # 2 s left of it (by the slowest save), then 5 s of a new one
    clock.save_in_flight_since = None
    assert clock.save_estimate() == 5.0 and 3500 < clock.budget().left_s <= 3600


def test_the_watchdog_abandons_once_when_the_phase_is_overdue() -> None:
    clock = DeadlineClock(EndTime(time.time() + 1.5, "test"), margin_s=1.0, grace_s=60.0)
    clock.enter("step")
    clock.add_saves([0.2])
    fired: list[tuple[str, float]] = []
    done = threading.Event()

    def on_overdue(phase: str, left: float) -> None:
        fired.append((phase, left))
        done.set()

    dog = DeadlineWatchdog(clock, on_overdue, poll_s=0.05).start()
    assert done.wait(5)
    dog.close()
    [(phase, left)] = fired
    assert phase == "step" and 0.5 < left <= 1.2  # at most one poll after left < save + margin
    assert clock.abandoned and clock.abandoned_in == "step"


def test_no_end_time_no_watchdog() -> None:
    dog = DeadlineWatchdog(DeadlineClock(EndTime(), 15.0, 60.0), lambda *_: None).start()
    assert not dog._thread.is_alive()
    dog.close()


def test_the_commit_delay_hook_makes_a_save_slow_and_every_save_is_timed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_hpc.checkpoint.manager import COMMIT_DELAY_ENV, CheckpointManager

    manager = CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(1, {"w": torch.zeros(4)}, {})
    monkeypatch.setenv(COMMIT_DELAY_ENV, "0.4")
    manager.save(2, {"w": torch.ones(4)}, {})
    fast, slow = manager.write_seconds
    assert slow >= 0.4 > fast
    assert manager.latest().name == "step_00000002"


def test_settled_waits_for_an_async_save_from_another_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the watchdog does before it requeues: the save in flight commits first (its result stays for wait())."""
    from verl_hpc.checkpoint.manager import COMMIT_DELAY_ENV, CheckpointManager

    monkeypatch.setenv(COMMIT_DELAY_ENV, "1.0")
    manager = CheckpointManager(tmp_path / "ckpt", async_save=True)
    manager.save(1, {"w": torch.zeros(4)}, {})
    assert manager.pending_since is not None and not manager.settled(timeout=0.01)
    assert manager.settled(timeout=60)
    assert manager.wait().name == "step_00000001" and manager.settled(timeout=0)



def test_a_write_that_ends_at_once_still_commits_off_the_trainers_thread(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A write done before save() returns must not commit (hash, fsync, rename) on the caller's thread."""
    import threading

    from verl_hpc.checkpoint import manager as manager_module
    from verl_hpc.checkpoint.manager import COMMIT_DELAY_ENV, CheckpointManager

    real_async_save = manager_module.dcp.async_save

    def write_then_return(*args, **kwargs):  # the race seen in CI: the upload is done before we look
        response = real_async_save(*args, **kwargs)
        getattr(response, "upload_completion", response).result()
        return response

    monkeypatch.setattr(manager_module.dcp, "async_save", write_then_return)
    monkeypatch.setenv(COMMIT_DELAY_ENV, "1.0")
    committed_on: list[str] = []
    manager = CheckpointManager(tmp_path / "ckpt", async_save=True)
    real_commit = manager._commit
    monkeypatch.setattr(manager, "_commit", lambda *a: (committed_on.append(threading.current_thread().name),
                                                        real_commit(*a)))
    manager.save(1, {"w": torch.zeros(4)}, {})
    assert manager.pending_since is not None
    assert manager.wait().name == "step_00000001"
    assert committed_on and committed_on[0] != threading.current_thread().name


def test_the_commit_thread_exists_from_the_start_so_saves_add_no_thread(tmp_path: Path) -> None:
    """A leak check compares a run's thread count early and late: the first save must not raise it."""
    import threading

    from verl_hpc.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(tmp_path / "ckpt", async_save=True)
    before = {t.name for t in threading.enumerate() if t.name.startswith("checkpoint-commit")}
    for step in (1, 2):
        manager.save(step, {"w": torch.zeros(4)}, {})
        manager.wait()
    after = {t.name for t in threading.enumerate() if t.name.startswith("checkpoint-commit")}
    assert before and after == before

# --- the attempt's record and `verl-hpc status` ------------------------------------------------

def test_an_abandoned_step_is_recorded_at_once_and_merged_with_the_attempt(tmp_path: Path) -> None:
    from verl_hpc.config import load_config
    from verl_hpc.metrics.history import StopRecord, read_history, record_end, record_start, time_budget_lines
    from verl_hpc.runtime.process.env import JobEnvironment
    from verl_hpc.runtime.state.time_limit import TimeLimit

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
    env = JobEnvironment(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                         master_port=29500, job_id=None, restart_count=0, scheduler="local", hostname="here")
    attempt = record_start(tmp_path, 0, "local", 0, 0.0, end_time=time.time() + 0.5)
    limit = TimeLimit.start(cfg, tmp_path, env, leader=True, end_time=time.time() + 0.5)  # margin 15 s: overdue now
    limit.clock.enter("step")
    assert wait_for(lambda: limit.clock.abandoned, 5)
    limit.close()
    [seen] = read_history(tmp_path)
    assert seen.stop == StopRecord("deadline", None, seen.stop.time_left_s, 0.0, 0.0, 15.0, abandoned=True,
                                   phase="step")
    assert limit.requeue_once(None) == (False, "not under Slurm: not requeuing; run the same command again to "
                                                "resume")
    record_end(tmp_path, attempt, 3, "deadline", StopRecord("deadline", None, 1.0, 5.0, 2.0, 15.0, True, "step"))
    [ended] = read_history(tmp_path)
    assert ended.reason == "deadline" and ended.stop.time_left_s == 1.0 and ended.end_time is not None
    lines = time_budget_lines([ended], {"step": 3, "perf/step_estimate_s": 5.0, "perf/save_estimate_s": 2.0})
    assert lines == ["estimates:   step ~5.0 s, save ~2.0 s (slowest recent, over the trainer ranks, at step 3)",
                     "last stop:   attempt 1 after step 3: deadline, step abandoned, 1 s left (next step ~5.0 s "
                     "+ save ~2.0 s + margin 15 s)"]


def test_status_shows_the_running_attempts_end_time() -> None:
    from verl_hpc.metrics.history import Attempt, time_budget_lines

    running = Attempt(2, 1000.0, 11, "7", 1, 0.0, end_time=1100.0)
    [line] = time_budget_lines([running], None, now=1040.0)
    assert line.startswith("time limit:  attempt 2 ends ") and line.endswith("(60 s from now)")


def wait_for(condition, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(condition())


def test_the_deadline_requeues_and_a_step_that_cannot_be_requeued_is_ended_on_every_component(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from verl_hpc.runtime.process.env import JobEnvironment
    from verl_hpc.runtime.process.signals import end_job_step, job_step_ids, requeue

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("scontrol", "scancel"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {tmp_path / "called"}\n')
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env = JobEnvironment(rank=0, world_size=4, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                         master_port=29500, job_id="20", restart_count=0, scheduler="slurm", hostname="node1")
    assert requeue(env, max_requeues=3, signum=None)[0]  # the deadline: no signal, still a requeue
    assert not requeue(env, max_requeues=0, signum=None)[0]
    het = {"SLURM_JOB_ID": "20", "SLURM_STEP_ID": "0", "SLURM_HET_SIZE": "3", "SLURM_JOB_ID_HET_GROUP_0": "20",
           "SLURM_JOB_ID_HET_GROUP_1": "21", "SLURM_JOB_ID_HET_GROUP_2": "22"}
    assert job_step_ids(het) == ["21.0", "22.0", "20.0"]  # this task's own component last: it ends us
    assert job_step_ids({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}) == ["7.0"]
    assert job_step_ids({"SLURM_JOB_ID": "7"}) == []  # the batch shell: no step to end
    assert end_job_step(het)
    assert (tmp_path / "called").read_text().splitlines() == [
        "scontrol requeue 20", "scancel --signal=KILL 21.0 22.0 20.0"]
