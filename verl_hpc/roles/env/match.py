"""Self-play: the policy plays every seat of a two-player TextArena game, one episode per seat.

Why one episode per seat, not one per game: each player's turns are what its own trajectory
trains on, with its own reward (+1 a win, -1 a loss), and GRPO's group baseline then compares
the seats of the same position, as SPIRAL and TextArena's own self-play training do. The samples
of a prompt pair up: sample 2k plays seat 0 and 2k+1 seat 1 of a match seeded by the row.

Why futures that wait on a move instead of blocking calls: a seat's next observation exists only
once the other seat has moved, and that move needs a generation round of the same loop. A step
that blocked a thread until then would hold the round open (deadlock with `deterministic_rounds`)
and, with many matches, every thread of the pool. So a step applies the move at once and answers
"wait for the other player" with a `ParkedFuture`, which the other seat's next move resolves; the
loop generates for the seats that can move and never waits on a parked one.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from verl_hpc.roles.env.base import EnvFailure, EnvReply
from verl_hpc.roles.env.runner import EnvOutcome, ParkedFuture, call_within
from verl_hpc.roles.env.sources import TEXTARENA_LOCK, textarena_game

PLAYERS = 2
LEFT = "The other player left the game before it ended."


def seat_of(episode: str) -> tuple[str, int]:
    """`episode-STEP-GROUP-SAMPLE` -> (its match's name, its seat): samples 2k and 2k+1 share a match."""
    found = re.fullmatch(r"(.*)-(\d+)", episode)
    if found is None:
        raise ValueError(f"{episode!r} does not end in its sample number")
    sample = int(found.group(2))
    return f"{found.group(1)}-match{sample // PLAYERS}", sample % PLAYERS


@dataclass
class Match:
    """One game and what its seats wait for."""

    game: Any
    mover: Any  # what a move goes through: the game, inside the run's TextArena action wrappers
    waiting: dict[int, ParkedFuture] = field(default_factory=dict)  # seat -> its next observation
    over: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class MatchRunner:
    """`EnvCalls` for self-play (`environment.players: 2`): matches in threads of this process."""

    def __init__(self, game_id: str, kwargs: dict[str, Any], workers: int, timeout: float,
                 action_wrappers: list[str] | tuple[str, ...] = ()):
        self.game_id, self.kwargs, self.timeout = game_id, dict(kwargs), timeout
        self.action_wrappers = tuple(action_wrappers)
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verl-hpc-match")
        self.matches: dict[str, Match] = {}
        self.where: dict[str, tuple[str, int]] = {}  # episode -> (match, seat)
        self._lock = threading.Lock()

    def _new_game(self, seed: int | None, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        game, mover = textarena_game(self.game_id, self.kwargs, self.action_wrappers)
        with TEXTARENA_LOCK:
            game.reset(num_players=PLAYERS, seed=seed, **kwargs)
        return game, mover

    def reset_all(self, starts: list[tuple[str, int | None, dict[str, Any]]]) -> list[EnvOutcome]:
        """Every match started (seed of its seat-0 sample's row); the seat to move gets its first
        observation, the other a `ParkedFuture` (`EnvOutcome.later`)."""
        by_match: dict[str, list[tuple[int, str, int | None, dict[str, Any]]]] = {}
        for episode, seed, kwargs in starts:
            name, seat = seat_of(episode)
            by_match.setdefault(name, []).append((seat, episode, seed, kwargs))
        started = {name: self.pool.submit(self._start, name, seats) for name, seats in by_match.items()}
        outcomes: dict[str, EnvOutcome] = {}
        for future in started.values():
            outcomes.update(future.result())
        return [outcomes[episode] for episode, _, _ in starts]

    def _start(self, name: str, seats: list[tuple[int, str, int | None, dict[str, Any]]]) -> dict[str, EnvOutcome]:
        began = time.perf_counter()
        if sorted(seat for seat, *_ in seats) != list(range(PLAYERS)):
            why = f"a match needs samples for seats 0 and 1, got {sorted(s for s, *_ in seats)}"
            return {episode: EnvOutcome(None, why) for _, episode, _, _ in seats}
        seat0 = next(s for s in seats if s[0] == 0)
        try:
            game, mover = call_within(lambda: self._new_game(seat0[2], seat0[3]), self.timeout)
            match = Match(game, mover)
            mover, text = call_within(lambda: self._observe(match), self.timeout)
        except EnvFailure as err:
            return {episode: EnvOutcome(None, str(err), time.perf_counter() - began) for _, episode, _, _ in seats}
        with self._lock:
            self.matches[name] = match
            self.where.update({episode: (name, seat) for seat, episode, _, _ in seats})
        seconds = time.perf_counter() - began
        out = {}
        for seat, episode, _, _ in seats:
            if seat == mover:
                out[episode] = EnvOutcome(EnvReply.checked(text), None, seconds)
            else:
                match.waiting[seat] = ParkedFuture()
                out[episode] = EnvOutcome(None, None, seconds, later=match.waiting[seat])
        return out

    @staticmethod
    def _news(messages: list[Any], seat: int) -> str:
        return "\n".join(text for sender, text, *_ in messages if sender != seat).strip()

    def _unread(self, match: Match, seat: int) -> str:
        """What `seat` has not seen yet, without taking it (the game's end, a seat that is not to move)."""
        with TEXTARENA_LOCK:
            messages = list(match.game.state.observations.get(seat, []))
        return self._news(messages, seat)

    def _observe(self, match: Match) -> tuple[int, str]:
        """The seat to move now and what it has not seen yet."""
        with TEXTARENA_LOCK:
            seat, messages = match.game.get_observation()
        return int(seat), self._news(messages, int(seat))

    def submit(self, episode: str, action: str) -> cf.Future:
        """Apply the seat's move on the pool: the answer is its next observation (another try after
        an invalid move, or the game's end) or a `ParkedFuture` until the other seat has moved."""
        with self._lock:
            place = self.where.get(episode)
            match = None if place is None else self.matches.get(place[0])
        if place is None or match is None or match.over:
            done: cf.Future = cf.Future()
            done.set_result(EnvOutcome(None, "the episode has no match (its start failed or the game is over)"))
            return done
        return self.pool.submit(self._move, match, place[1], action)

    def _move(self, match: Match, seat: int, action: str) -> EnvOutcome:
        began = time.perf_counter()
        with match.lock:
            try:
                game_over = call_within(lambda: self._step(match, action), self.timeout)
                if game_over:
                    return self._end(match, seat, began)
                mover, text = call_within(lambda: self._observe(match), self.timeout)
            except EnvFailure as err:
                self._fail(match, seat, f"the match failed: {err}")
                return EnvOutcome(None, str(err), time.perf_counter() - began)
            seconds = time.perf_counter() - began
            if mover == seat:  # an invalid move: the same seat tries again
                return EnvOutcome(EnvReply.checked(text), None, seconds)
            match.waiting[seat] = later = ParkedFuture()
            self._resolve(match, mover, EnvOutcome(EnvReply.checked(text), None, 0.0))
            return EnvOutcome(None, None, seconds, later=later)

    @staticmethod
    def _step(match: Match, action: str) -> bool:
        with TEXTARENA_LOCK:
            done, _ = match.mover.step(action)
        return bool(done)

    def _end(self, match: Match, seat: int, began: float) -> EnvOutcome:
        """The game is over: every seat gets its last news and its reward (TextArena's close)."""
        with TEXTARENA_LOCK:
            rewards, _ = match.game.close()
        match.over = True
        rewards = rewards or {}
        replies = {s: EnvReply.checked(self._unread(match, s), rewards.get(s, 0.0), True) for s in range(PLAYERS)}
        for other in range(PLAYERS):
            if other != seat:
                self._resolve(match, other, EnvOutcome(replies[other], None, 0.0))
        return EnvOutcome(replies[seat], None, time.perf_counter() - began)

    def _fail(self, match: Match, seat: int, why: str) -> None:
        """A failed game fails its every seat (the re-run restarts the match as a whole)."""
        match.over = True
        for other in range(PLAYERS):
            if other != seat:
                self._resolve(match, other, EnvOutcome(None, why))

    @staticmethod
    def _resolve(match: Match, seat: int, outcome: EnvOutcome) -> None:
        future = match.waiting.pop(seat, None)
        if future is not None and not future.done():
            future.set_result(outcome)

    def left(self, episode: str) -> None:
        """An episode ended before its game (a budget ran out): its opponent ends too, unrewarded."""
        with self._lock:
            place = self.where.get(episode)
            match = None if place is None else self.matches.get(place[0])
        if match is None or match.over:
            return
        with match.lock:
            match.over = True
            for other in range(PLAYERS):
                if other != place[1]:  # type: ignore[index]
                    news = self._unread(match, other)  # a seat that never moved still learns the rules
                    self._resolve(match, other, EnvOutcome(EnvReply(f"{news}\n{LEFT}".strip(), 0.0, True)))

    def finish(self, episode: str) -> None:
        """The episode's seat is released; the match goes once both are."""
        self.left(episode)
        with self._lock:
            place = self.where.pop(episode, None)
            if place is not None and not any(p[0] == place[0] for p in self.where.values()):
                self.matches.pop(place[0], None)

    def close(self) -> None:
        for episode in list(self.where):
            self.finish(episode)
        self.pool.shutdown(wait=False, cancel_futures=True)


def wire_answer(outcome: EnvOutcome) -> tuple[str, Any]:
    """An outcome as the environment wire carries it (`wire.py`): ok, error, or parked."""
    if outcome.later is not None:
        return "parked", None
    if outcome.reply is None:
        return "error", outcome.error or "no observation"
    return "ok", (outcome.reply.text, outcome.reply.reward, outcome.reply.done)


class MatchHost:
    """Self-play matches in an environment worker process (`num_workers`, `resources.env`).

    The rollout places both seats of a match on one worker and starts them in one `reset_all`
    request; a seat that must wait is answered `parked`, and its observation follows as a
    `resolve` message once the other seat's move (or the game's end, or its failure) produces it.
    """

    def __init__(self, spec: dict[str, Any]):
        self.runner = MatchRunner(spec["id"], spec.get("kwargs") or {}, int(spec.get("threads", 16)),
                                  float(spec.get("timeout", 60.0)), spec.get("action_wrappers", ()))

    def handle(self, op: str, episode: str, payload: Any, notify: Any) -> tuple[str, Any]:
        """One request; `notify(episode, status, payload)` sends a parked seat's observation later."""
        if op == "reset_all":
            starts = [(name, seed, dict(kwargs)) for name, seed, kwargs in payload]
            outcomes = self.runner.reset_all(starts)
            return "ok", [self._answer(name, outcome, notify) for (name, _, _), outcome in zip(starts, outcomes, strict=True)]
        if op == "step":
            return self._answer(episode, self.runner.submit(episode, payload).result(), notify)
        if op == "left":
            self.runner.left(episode)
            return "ok", None
        if op == "close":
            self.runner.finish(episode)
            return "ok", None
        return "error", f"self-play has no {op!r} request"

    @staticmethod
    def _answer(episode: str, outcome: EnvOutcome, notify: Any) -> tuple[str, Any]:
        if outcome.later is not None:
            outcome.later.add_done_callback(lambda done: notify(episode, *wire_answer(done.result())))
        return wire_answer(outcome)

    def close(self) -> None:
        self.runner.close()
