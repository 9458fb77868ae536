"""The run's time budget: how long a step and a save take, and what to do at a step boundary.

Why: a fixed signal lead (`--signal=B:USR1@N`) assumes that the step in progress plus a
checkpoint fit into N seconds. On a busy node, a slow file system or with a big model they
do not, and the time limit kills the job mid-step: no requeue (TIMEOUT). Knowing the end
time (endtime.py) and how long this run's steps and saves take, the run stops where they
still fit, before any signal.

The rule, with L the seconds left, T the next step's estimate, S a save's, M the margin
(`slurm.requeue_margin_seconds`), applied by every trainer rank to the same numbers (the
slowest estimates and the least time left over the trainer ranks, one all-reduce):

- a stop signal (TERM, INT; a USR1/USR2 that is not the time-limit notice): save, stop;
- L < T + S + M: save and requeue now — the deadline;
- either, when even a save no longer fits (L < S + M; S includes the rest of a save still
  writing): stop without a new save, at the newest checkpoint once the one in flight commits;
- L < 2T + S + M: save ahead (asynchronously) and go on: the next boundary will most likely
  stop, and if the step overruns, the run resumes from this boundary;
- otherwise go on.

Between boundaries the trainer leader's watchdog abandons what is in progress when its
checkpoint could no longer be written M seconds before the end — a step once L < S + M,
start-up or a save once L < M — lets a save still writing commit (while L > M) and requeues.
An abandoned step or save leaves nothing resume would load (checkpoints are committed
atomically with their manifest), so the run resumes from the newest committed checkpoint:
the save-ahead's, usually.

A USR1 that comes within the time-limit notice window of a known end time (at most
`signal_grace + 30` s before it: slurmctld looks twice a minute) is the backstop's notice
that this rule already covers, so the run goes on until the rule stops it; an earlier one is
a preemption notice (or a USR1 sent by hand) and stops the run at the next boundary; without
a known end time every USR1 stops it, as before.
"""

from __future__ import annotations

import enum
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from verl_hpc.runtime.process.endtime import EndTime

WINDOW = 8              # estimates are the slowest of the last WINDOW samples
SLURM_CHECK_S = 30.0    # slurmctld's period for time limits and their signals
NOTICE_SLACK_S = 5.0    # a notice this much earlier than the window still counts as the time-limit notice
TERMINATING = (signal.SIGTERM, signal.SIGINT)
NOTICES = (signal.SIGUSR1, signal.SIGUSR2)


class RunningEstimate:
    """The slowest of the last `WINDOW` durations (seconds); a prior counts as one sample.

    Why a window maximum and not a mean: the estimate must not be beaten by the next sample,
    and on a busy machine durations come in bursts (a neighbour starts); the window forgets
    a start-up step or a burst after WINDOW samples.
    """

    def __init__(self, prior: float | None = None, window: int = WINDOW):
        self.samples: deque[float] = deque(maxlen=window)
        self.count = 0
        if prior is not None and prior > 0:
            self.samples.append(float(prior))

    def add(self, seconds: float) -> None:
        self.samples.append(max(0.0, float(seconds)))
        self.count += 1

    @property
    def value(self) -> float | None:
        return max(self.samples) if self.samples else None


@dataclass(frozen=True)
class TimeBudget:
    """What one rank knows at a step boundary, or the agreed (slowest, least) values of all."""

    step_s: float = 0.0              # the next step, validation and logging included
    save_s: float = 0.0              # one synchronous checkpoint (after the one still writing, if any)
    left_s: float = float("inf")     # until the end time (inf: none known)

    @property
    def known(self) -> bool:
        return self.left_s != float("inf")


@dataclass(frozen=True)
class Agreement:
    """What every trainer rank acts on at a boundary: the same values on each."""

    signum: int | None = None        # the stop signal (TERM/INT, or a notice that is not the time limit's)
    budget: TimeBudget = field(default_factory=TimeBudget)
    abandoned: bool = False          # the leader's watchdog gave up on this step and requeued
    resizing: bool = False


def agree_max(signum: int | None, budget: TimeBudget, abandoned: bool,
              reduce_max: Callable[[torch.Tensor], torch.Tensor] | None) -> Agreement:
    """One MAX all-reduce (`reduce_max`; None in one process) over this rank's proposal."""
    values = torch.tensor([float(signum or 0), budget.step_s, budget.save_s, -budget.left_s, float(abandoned)],
                          dtype=torch.float64)
    if reduce_max is not None:
        values = reduce_max(values)
    sig, step_s, save_s, neg_left, gave_up = values.tolist()
    return Agreement(int(sig) or None, TimeBudget(step_s, save_s, -neg_left), bool(gave_up))


class Action(enum.Enum):
    CONTINUE = "continue"
    SAVE_AHEAD = "save ahead"     # an asynchronous checkpoint now; the next boundary will likely stop
    STOP = "stop"                 # a synchronous checkpoint, then requeue
    STOP_UNSAVED = "stop unsaved"  # requeue once the save in flight commits: a new one would not fit
    ABANDONED = "abandoned"       # the watchdog requeued already: no checkpoint of this step


def boundary_action(agreed: Agreement, margin_s: float, last: bool = False) -> Action:
    """The rule of the module docstring; at the last step only an abandoned step stops."""
    if agreed.abandoned:
        return Action.ABANDONED
    if last:
        return Action.CONTINUE
    b = agreed.budget
    if agreed.signum or b.left_s < b.step_s + b.save_s + margin_s:
        return Action.STOP_UNSAVED if b.left_s < b.save_s + margin_s else Action.STOP
    if b.left_s < 2 * b.step_s + b.save_s + margin_s:
        return Action.SAVE_AHEAD
    return Action.CONTINUE


def notice_window_s(grace_s: float) -> float:
    """The earliest a time-limit notice can come, in seconds before the end time."""
    return grace_s + SLURM_CHECK_S + NOTICE_SLACK_S


def stopping_signal(received: Mapping[int, float], end_at: float | None, grace_s: float) -> int | None:
    """The signal this rank stops for, of those received (signal -> unix time it came).

    TERM and INT always stop. A USR1/USR2 stops unless it came inside the time-limit notice
    window of a known end time (the deadline rule covers that one).
    """
    for sig in TERMINATING:
        if sig in received:
            return int(sig)
    for sig in NOTICES:
        if sig in received and (end_at is None or end_at - received[sig] > notice_window_s(grace_s)):
            return int(sig)
    return None


def stop_path(signum: int | None, received: Mapping[int, float], end_at: float | None, grace_s: float) -> str:
    """Which path stopped the attempt: deadline (no signal), preemption (an early notice), signal."""
    if not signum:
        return "deadline"
    if signum in NOTICES and end_at is not None and signum in received \
            and end_at - received[signum] > notice_window_s(grace_s):
        return "preemption"
    return "signal"


# What the watchdog reserves after each phase, before the margin: a step must still be followed
# by its save; start-up and a save in progress add nothing new to save.
PHASE_RESERVES_SAVE = {"start": False, "step": True, "boundary": True, "save": False}


def overdue(phase: str, left_s: float, save_s: float, margin_s: float) -> bool:
    """Whether the phase in progress must be abandoned now (see the module docstring)."""
    if phase not in PHASE_RESERVES_SAVE:  # stopping, or done: nothing left to abandon
        return False
    reserve = save_s if PHASE_RESERVES_SAVE[phase] else 0.0
    return left_s < reserve + margin_s


class DeadlineClock:
    """This process's end time, estimates and phase; thread-safe for the watchdog.

    Step samples run from the end of one boundary's checkpoint to the next boundary, so the
    validation and logging a step brings are in them; save samples are whole writes, commit
    included, as the checkpoint manager measures them (async ones too, when they commit).
    """

    def __init__(self, end: EndTime, margin_s: float, grace_s: float, step_prior: float | None = None,
                 save_prior: float | None = None):
        self.end, self.margin_s, self.grace_s = end, float(margin_s), float(grace_s)
        self.steps, self.saves = RunningEstimate(step_prior), RunningEstimate(save_prior)
        self.phase, self.since = "start", time.monotonic()
        self.save_in_flight_since: float | None = None  # monotonic start of an async write not yet committed
        self.abandoned = False                  # the leader's watchdog gave up on what was in progress
        self.abandoned_in: str | None = None    # ... which was this phase
        self.lock = threading.Lock()

    def enter(self, phase: str) -> None:
        with self.lock:
            self.phase, self.since = phase, time.monotonic()

    def step_done(self) -> None:
        """At a boundary: the step since the last `enter("step")` is a sample."""
        with self.lock:
            if self.phase == "step":
                self.steps.add(time.monotonic() - self.since)
            self.phase, self.since = "boundary", time.monotonic()

    def add_saves(self, seconds: Iterable[float]) -> None:
        for value in seconds:
            self.saves.add(value)

    def save_estimate(self) -> float:
        """What a save started now costs: the slowest recent save (at least as long as the one
        still writing), plus what that one has left, since a new save waits for it; 0 before any."""
        known = self.saves.value or 0.0
        if self.save_in_flight_since is None:
            return known
        elapsed = time.monotonic() - self.save_in_flight_since
        return max(known, elapsed) + max(0.0, known - elapsed)

    def budget(self) -> TimeBudget:
        return TimeBudget(self.steps.value or 0.0, self.save_estimate(), self.end.left())

    def overdue(self) -> bool:
        with self.lock:
            phase = self.phase
        return not self.abandoned and overdue(phase, self.end.left(), self.save_estimate(), self.margin_s)


class DeadlineWatchdog:
    """A thread on the trainer leader: abandons what is in progress once it is overdue.

    `on_overdue(phase, left_s)` runs once, in this thread (requeue, or end the job step).
    """

    def __init__(self, clock: DeadlineClock, on_overdue: Callable[[str, float], None], poll_s: float = 0.5):
        self.clock, self.on_overdue, self.poll_s = clock, on_overdue, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deadline-watchdog", daemon=True)

    def start(self) -> DeadlineWatchdog:
        if self.clock.end.known:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.clock.overdue():
                with self.clock.lock:
                    phase = self.clock.phase
                self.clock.abandoned_in, self.clock.abandoned = phase, True
                self.on_overdue(phase, self.clock.end.left())
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

