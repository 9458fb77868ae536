"""The agent loop: every episode of a step in flight, the engine generating for those that are ready.

Why rounds over the ready episodes (the HF engine, which batches only what one call gives it):
an episode waits for its tools while the others go on. Each round hands every episode that is
ready for its next turn to the engine in one call, then starts the tool calls of the turns that
asked for some on the bounded pool and goes straight to the next round with whoever is ready —
a slow tool holds its own episode only. When nobody is ready it waits for the first tool reply.
An engine that takes requests one at a time (vLLM's `submit`/`poll`) gets each turn the moment
its episode is ready instead (continuous.py).

The engine-facing call is the engine's own `generate(context_ids, sampling, stop_token_ids=,
max_tokens=)`: token ids in, sampled ids and their logprobs out, stopping at the end-of-turn id
or the parser's tool-call end tag, each episode with its remaining budget of model tokens.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from verl_hpc.roles.agent.continuous import run_continuous, takes_requests
from verl_hpc.roles.agent.episode import Episode
from verl_hpc.roles.agent.parsers import ToolCallParser
from verl_hpc.roles.agent.render import ChatRenderer
from verl_hpc.roles.agent.tool_runner import ToolOutcome, ToolRunner
from verl_hpc.roles.allocator import generate_guarded
from verl_hpc.roles.env.runner import EnvCalls, EnvOutcome, parked

log = logging.getLogger(__name__)


def end_tag_ids(tokenizer: Any, tags: Sequence[str]) -> list[int]:
    """Ids whose text closes a tool call: the tag when it is one token, and added tokens ending with it."""
    ids: list[int] = []
    for tag in tags:
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) == 1:
            ids.append(int(encoded[0]))
        for token, token_id in tokenizer.get_added_vocab().items():
            if token.endswith(tag) and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def _kept_between_turns(engine: Any) -> contextlib.AbstractContextManager:
    """The engine's per-episode KV cache for the rounds of one step (HF: `episode_cache()`), if it has one.

    Why: a turn's context is its episode's last context plus the turn and the inserted reply;
    with the cache kept, a round prefills only those instead of every episode's whole context.
    """
    keep = getattr(engine, "episode_cache", None)
    return keep() if callable(keep) else contextlib.nullcontext()


class AgentLoop:
    """Runs episodes to the end. `run(...)` -> the finished `Episode`s, in the order given."""

    def __init__(self, engine: Any, tokenizer: Any, renderer: ChatRenderer, parser: ToolCallParser,
                 runner: ToolRunner, multi_turn: Any, eot_ids: Sequence[int], max_context: int | None = None,
                 allocator: Any = None, envs: EnvCalls | None = None):
        self.engine, self.tokenizer, self.renderer, self.parser, self.runner = \
            engine, tokenizer, renderer, parser, runner
        self.envs = envs  # an environment answers each final turn (roles/env), or None
        self.allocator = allocator  # generation's OOM retries: a round is cut into smaller chunks
        self.cfg = multi_turn
        self.eot_ids = set(int(i) for i in eot_ids)
        self.tag_ids = set(end_tag_ids(tokenizer, parser.end_tags))
        self.stop_ids = sorted(self.eot_ids | self.tag_ids)
        self.max_context = max_context
        self.max_new_tokens = 0  # the model's token budget of the episodes in flight (sampling.max_new_tokens)
        self.round_seconds = 0.0  # the latest round's generation time: how long replies are gathered
        # Partial rollouts: called before each round with the version in hand, returns the version the
        # engine holds then (a split rollout rank takes newer weights here, if the trainer sent them).
        self.refresh_weights: Callable[[int], int] | None = None

    def start(self, key: tuple[int, int, int], prompt: Any, tools_kwargs: dict[str, Any] | None,
              first: EnvOutcome | None = None) -> Episode:
        """A new episode; with an environment, its reset's observation (`first`) is the last user turn
        (unless `environment.first_observation` is off)."""
        from verl_hpc.roles.agent.render import as_messages

        messages = as_messages(prompt)
        shown = self.cfg.environment is None or self.cfg.environment.first_observation
        if first is not None and first.reply is not None and shown:
            messages.append({"role": "user", "content": first.reply.text})
        episode = Episode(key, self.renderer.prompt_ids(messages), messages, dict(tools_kwargs or {}))
        if first is not None:
            episode.has_env = True
            episode.env_seconds += first.seconds
            if first.later is not None:  # self-play's second seat: its first observation is the other's move
                episode.pending = first.later
            elif first.reply is None:  # its reset failed: one turn on the row's own prompt, then it ends
                episode.env_failed = True
        return episode

    def budget(self, episode: Episode, max_new_tokens: int) -> int:
        """Tokens the episode's next turn may sample: the model's budget left, within the length caps."""
        left = max_new_tokens - episode.model_tokens
        if self.cfg.max_tokens_per_turn is not None:
            left = min(left, self.cfg.max_tokens_per_turn)
        if self.cfg.max_response_tokens is not None:
            left = min(left, self.cfg.max_response_tokens - len(episode.response_ids))
        if self.max_context is not None:
            left = min(left, self.max_context - len(episode.prompt_ids) - len(episode.response_ids))
        return left

    def run(self, episodes: list[Episode], sampling: Any, version: int) -> list[Episode]:
        """Every episode to its end; tool calls overlap generation of the other episodes."""
        self.max_new_tokens = sampling.max_new_tokens
        if takes_requests(self.engine):  # vLLM: each turn joins the running batch when its episode is ready
            run_continuous(self, episodes, sampling, version)
        else:
            with _kept_between_turns(self.engine):
                self.run_rounds(episodes, sampling, version)
        for episode in episodes:
            self.finish(episode)
        return episodes

    def run_rounds(self, episodes: list[Episode], sampling: Any, version: int) -> None:
        """Rounds: every episode ready for its next turn goes to the engine in one call."""
        waiting = [e for e in episodes if e.pending is not None]
        ready = [e for e in episodes if e.pending is None and not self.ended_by_budget(e, sampling)]
        while ready or waiting:
            self.release_ended(episodes)
            if ready:
                if self.refresh_weights is not None:
                    version = self.refresh_weights(version)
                self.generate_round(ready, sampling, version)
                waiting += [e for e in ready if e.pending is not None]
                ready = []
                self.release_ended(episodes)
                if self.cfg.deterministic_rounds and waiting:  # every reply in before the next round
                    cf.wait([e.pending for e in waiting if not parked(e.pending)])  # type: ignore[misc]
            elif waiting:
                self.wait_for_replies([e.pending for e in waiting])  # type: ignore[misc]
            for episode in [e for e in waiting if e.pending is not None and e.pending.done()]:
                waiting.remove(episode)
                self.take_replies(episode, episode.pending.result())  # type: ignore[union-attr]
                if episode.pending is not None:  # its move is made; the other seat's comes first
                    waiting.append(episode)
                elif not self.ended_by_budget(episode, sampling):
                    ready.append(episode)

    def release_ended(self, episodes: list[Episode]) -> None:
        """Episodes that ended leave their environment now, not at the step's end: a self-play
        opponent waiting on their next move is told the game is over (`MatchRunner.left`)."""
        leave = getattr(self.envs, "left", None)
        if leave is None:
            return
        for episode in episodes:
            if episode.done and episode.has_env and episode.pending is None:
                leave(episode.name)

    def wait_for_replies(self, pending: list[cf.Future]) -> None:
        """The first reply, then the others that come within one round's generation time.

        Why gather: an HF round costs about the same for one episode as for all of them, and
        replies of one round come close together; going on with the first alone would spend a
        whole round on it and another on each straggler. A reply later than that window (a slow
        call) does not hold the others: they go on without it.
        """
        cf.wait(pending, return_when=cf.FIRST_COMPLETED)
        cf.wait(pending, timeout=self.round_seconds)

    def ended_by_budget(self, episode: Episode, sampling: Any) -> bool:
        if episode.done:
            return True
        if self.budget(episode, sampling.max_new_tokens) <= 0:
            episode.end(finished=False, truncated=True)
            return True
        return False

    def generate_round(self, ready: list[Episode], sampling: Any, version: int) -> None:
        """One engine call for every ready episode; each turn is then parsed and its calls started."""
        limits = [self.budget(e, sampling.max_new_tokens) for e in ready]
        started = time.perf_counter()
        out = generate_guarded(self.engine, [e.context() for e in ready], sampling, self.allocator,
                               stop_token_ids=self.stop_ids, max_tokens=limits)
        self.round_seconds = time.perf_counter() - started
        for episode, ids, logprobs in zip(ready, out.response_ids, out.logprobs, strict=True):
            episode.add_sampled(list(ids), list(logprobs), version)
            self.after_turn(episode, list(ids))

    def after_turn(self, episode: Episode, ids: list[int]) -> None:
        """Parse the turn just sampled: a final answer ends the episode, tool calls start on the pool."""
        closed = bool(ids) and ids[-1] in self.eot_ids
        episode.last_close = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if closed else ""
        text = self.tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=False)
        per_turn = self.cfg.max_tokens_per_turn
        # A turn cut at the per-turn cap is a whole turn: the template writes its close (untrained).
        ended = closed or (per_turn is not None and len(ids) >= per_turn)
        parsed = self.parser.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        valid = [c.message_form() for c in parsed.calls if c.error is None]
        if valid:
            message["tool_calls"] = valid
        episode.messages.append(message)
        if not parsed.calls:
            episode.final_answer = self._clean(parsed.content)
            if self.envs is not None and ended and not episode.env_failed and not episode.env_done:
                self.step_environment(episode)
                return
            episode.end(finished=ended, truncated=not ended)
            return
        if self.out_of_turns(episode):
            episode.end(finished=False, truncated=True)  # it asked for a tool it has no turn left to use
            return
        episode.pending = self.runner.submit(episode.name, parsed.calls, episode.tools_kwargs)

    def step_environment(self, episode: Episode) -> None:
        """The final turn goes to the episode's environment, its last turn too: a move the model made is
        played and its reward and `done` count, even when no turn is left to read the answer (as
        TRL's and OpenEnv's rollout loops step every action; dropping it would make the last guess
        of a game worthless to learn)."""
        episode.pending = self.envs.submit(episode.name, episode.final_answer)  # type: ignore[union-attr]

    def out_of_turns(self, episode: Episode) -> bool:
        """No model turn left to answer an observation: the turns, the user turns or the tokens ran out."""
        return episode.assistant_turns >= self.cfg.max_assistant_turns or \
            episode.tool_turns >= self.cfg.user_turns or self.budget(episode, self.max_new_tokens) <= 0

    def take_env_reply(self, episode: Episode, outcome: EnvOutcome, moved: bool = False) -> None:
        """The environment's observation becomes the next user turn; `done` or a failure ends the episode.
        `moved`: the observation answers a move counted already, when it was made (self-play)."""
        episode.env_seconds += outcome.seconds
        if outcome.later is not None:  # the move is made; the next observation follows the other seat's
            episode.env_steps += 1
            if self.out_of_turns(episode):  # its last move: the game goes on, the episode's budget does not
                episode.end(finished=True, truncated=True)
                return
            episode.pending = outcome.later
            return
        if outcome.reply is None and episode.assistant_turns == 0:  # a second seat's game failed unplayed:
            episode.env_failed = True  # as a failed reset, one turn on the row's own prompt, then it ends
            return
        if outcome.reply is not None and episode.assistant_turns == 0:  # a second seat's first observation
            episode.messages.append({"role": "user", "content": outcome.reply.text})
            episode.prompt_ids = self.renderer.prompt_ids(episode.messages)
            episode.env_reward += outcome.reply.reward
            episode.env_done = outcome.reply.done  # the game ended unplayed: one turn, not sent to it
            return
        if outcome.reply is None:
            log.warning("environment failed in %s: %s", episode.name, outcome.error)
            episode.env_failed = True
            episode.end(finished=True, truncated=False)
            return
        if not moved:
            episode.env_steps += 1
        episode.env_reward += outcome.reply.reward
        if outcome.reply.done:
            episode.env_done = True
            episode.end(finished=True, truncated=False)
            return
        if self.out_of_turns(episode):  # its last move was played; the answer has no turn to go to
            episode.end(finished=True, truncated=True)
            return
        self.insert(episode, [{"role": "user", "content": outcome.reply.text}])

    def take_replies(self, episode: Episode, outcomes: list[ToolOutcome] | EnvOutcome) -> None:
        """The tool replies become tool messages; their template text is appended as inserted ids."""
        waited, episode.pending = parked(episode.pending), None
        if isinstance(outcomes, EnvOutcome):
            self.take_env_reply(episode, outcomes, moved=waited and episode.assistant_turns > 0)
            return
        turn = episode.assistant_turns
        replies = []
        for outcome in outcomes:
            episode.tool_log.append({"turn": turn, **outcome.log_entry()})
            episode.tool_rewards += outcome.reward
            replies.append({"role": "tool", "content": outcome.text})
        self.insert(episode, replies)

    def insert(self, episode: Episode, replies: list[dict[str, Any]]) -> None:
        """Messages the model did not write, appended as the template's delta ids (loss mask 0)."""
        episode.tool_turns += 1
        episode.messages.extend(replies)
        delta = self.renderer.delta_ids(replies, episode.last_close)
        cap = None if self.cfg.max_response_tokens is None else self.cfg.max_response_tokens - len(episode.response_ids)
        if self.max_context is not None:
            room = self.max_context - len(episode.prompt_ids) - len(episode.response_ids)
            cap = room if cap is None else min(cap, room)
        if cap is not None and len(delta) >= cap:  # no room left for the model to answer
            episode.add_inserted(delta[:max(cap, 0)])
            episode.end(finished=False, truncated=True)
            return
        episode.add_inserted(delta)

    def _clean(self, text: str) -> str:
        for special in self.tokenizer.all_special_tokens:
            text = text.replace(special, "")
        return text.strip()

    def finish(self, episode: Episode) -> None:
        """Tool instances released (their rewards kept); the template's own rendering compared."""
        episode.tool_rewards += self.runner.finish(episode.name, episode.tools_kwargs)
        if self.envs is not None:
            self.envs.finish(episode.name)
        if episode.finished:
            ours = [*episode.prompt_ids, *episode.response_ids, *self.renderer.closing_ids(episode.last_close)]
            try:
                episode.template_mismatch = self.renderer.rendered_ids(episode.messages) != ours
            except Exception:  # noqa: BLE001 - a template that cannot re-render counts as a mismatch
                episode.template_mismatch = True
