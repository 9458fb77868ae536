"""Rewards: a rule-based `module:function`, or a sequence-classification reward model.

Why both produce one score per sequence: GRPO and PPO both start from a sequence score
(token-level rewards are derived from it in `algo`), so the trainer never needs to know
which kind of reward it is talking to.

Why every score is checked here: one NaN poisons the advantages of its whole group and,
through the update, the weights; a run then "trains" to exit 0 with a final score of nan.
A score that is not a finite number (or a function that raises) is handled by
`reward.on_error`: `fail` (the default) stops the run with one line naming the prompt and
the value; `zero` scores the sequence 0; `skip` gives it its group's mean of the valid
scores, so its GRPO advantage is 0 and it adds no gradient. Either way the sequences are
counted (`errors`, `metrics()` -> `reward/errors`).
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import time
from collections.abc import Callable
from typing import Any

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.data.trajectory import episode_records

ON_ERROR = ("fail", "zero", "skip")


class RewardError(ConfigError):
    """A reward gave no usable score; one line naming the prompt index and the value."""


def score_problem(value: Any) -> str | None:
    """Why `value` is not a usable score (None when it is a finite real number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return None if math.isfinite(float(value)) else f"returned {float(value)}"
    return f"returned {type(value).__name__} {value!r:.60}, not a number"


class _Checked:
    """The `on_error` policy and the error counters shared by both reward kinds."""

    field = "reward.function"
    on_error = "fail"
    errors = 0       # sequences whose score was replaced, over the whole run (this process)
    last_errors = 0  # the same, in the latest batch

    def _set_policy(self, on_error: str) -> None:
        if on_error not in ON_ERROR:
            raise ConfigError("reward.on_error", f"unknown value {on_error!r}", f"use one of {', '.join(ON_ERROR)}")
        self.on_error, self.errors, self.last_errors = on_error, 0, 0

    def metrics(self) -> dict[str, float]:
        """`reward/errors`: sequences of the latest batch whose score was replaced."""
        return {"reward/errors": float(self.last_errors)}

    def _resolve(self, batch: RolloutBatch, values: list[float], problems: dict[int, str]) -> torch.Tensor:
        scores = torch.tensor(values, dtype=torch.float32)
        self.last_errors = len(problems)
        self.errors += len(problems)
        if not problems:
            return scores
        if self.on_error == "fail":
            raise self._error(batch, problems)
        bad = torch.zeros(len(values), dtype=torch.bool)
        bad[list(problems)] = True
        if self.on_error == "zero":
            return torch.where(bad, torch.zeros_like(scores), scores)
        groups = torch.tensor(batch.column("group_id").to_numpy(), dtype=torch.long)
        for row in problems:
            peers = (groups == groups[row]) & ~bad
            scores[row] = scores[peers].mean() if peers.any() else 0.0
        return scores

    def _error(self, batch: RolloutBatch, problems: dict[int, str]) -> RewardError:
        row = min(problems)
        prompt = int(batch.column("prompt_index")[row].as_py())
        more = f" (and {len(problems) - 1} more sequences of this batch)" if len(problems) > 1 else ""
        return RewardError(self.field, f"{self.describe()} {problems[row]} for prompt index {prompt} "
                           f"(batch row {row}){more}",
                           "return a finite float for every response, or set reward.on_error: zero or skip "
                           "to count such sequences in reward/errors and go on")

    def describe(self) -> str:
        return "the reward"


VERL_ARGS = ("data_source", "solution_str", "ground_truth")  # verl's compute_score(..., extra_info=None)


def scored(batch: RolloutBatch, reward: Any) -> RolloutBatch:
    """`batch` with the reward's scores, and an LLM judge's raw verdicts beside them (the samples log)."""
    scores = reward.score(batch)
    verdicts = getattr(reward, "last_verdicts", None)
    if verdicts is not None and len(verdicts) == len(batch):
        import pyarrow as pa

        return batch.with_columns(score=scores, judge_verdict=pa.array(verdicts, pa.string()))
    return batch.with_columns(score=scores)


def ground_truths(batch: RolloutBatch, scalars_as_text: bool) -> list[Any]:
    """Each row's ground truth as the dataset holds it: text as text, a list or a dict as itself
    (verl's search-R1 layout: `{"target": [...]}`), as verl hands it to `compute_score`.

    A number reaches verl's signature as the number the file holds (as in verl); our own
    `fn(prompt, response, ground_truth)` gets numbers as text (`scalars_as_text`), as it always has.
    """
    texts = batch.column("ground_truth").to_pylist()
    encoded = batch.column("ground_truth_json").to_pylist()
    out: list[Any] = []
    for text, blob in zip(texts, encoded, strict=True):
        value = text if blob is None else json.loads(blob)
        out.append(text if scalars_as_text and not isinstance(value, (list, dict)) else value)
    return out


class RuleReward(_Checked):
    """Calls a rule function on decoded text, per sequence, in one of two signatures.

    Ours: `fn(prompt=..., response=..., ground_truth=...)`; a function that takes a
    `finished` keyword (or `**kwargs`) also gets whether the response ended with EOS,
    which the decoded text cannot show (special tokens are removed). verl's:
    `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, recognised
    by its parameter names and called with exactly those, so a verl user's function runs
    unchanged. Either may return a number or a dict with `score` (verl's form); the dict's
    other numeric entries become `reward/extra/<key>` (their mean over the batch).
    With `num_workers > 1` the calls run in a pool of processes (`RewardPool`).
    """

    def __init__(self, fn: Callable[..., Any], tokenizer, on_error: str = "fail", spec: str | None = None,
                 field: str = "reward.function", num_workers: int = 1, timeout: float = 60.0,
                 reward_kwargs: dict[str, Any] | None = None):
        self.fn, self.tokenizer, self.field = fn, tokenizer, field
        self.reward_kwargs = dict(reward_kwargs or {})
        self._set_policy(on_error)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.verl = set(VERL_ARGS) <= set(params)
        self._pass_extra = "extra_info" in params or kwargs
        self._pass_finished = not self.verl and ("finished" in params or kwargs)
        self.takes_judge = "judge" in params or kwargs  # reward.judge's verdict, when a judge scores too
        self.pool = RewardPool(spec or fn, num_workers, timeout) if num_workers > 1 else None
        self.extra: dict[str, float] = {}
        self.last_timeouts = 0

    def describe(self) -> str:
        """`module:function`, or `path/file.py:function` for a function loaded from a file."""
        module, name = getattr(self.fn, "__module__", None) or "?", getattr(self.fn, "__qualname__", repr(self.fn))
        code = getattr(self.fn, "__code__", None)
        if module.startswith("verl_hpc_user_") and code is not None:
            module = code.co_filename
        return f"{module}:{name}"

    def metrics(self) -> dict[str, float]:
        """`reward/errors`, `reward/timeouts` (with a pool) and the dict returns' `reward/extra/<key>`."""
        out = super().metrics()
        if self.pool is not None:
            out["reward/timeouts"] = float(self.last_timeouts)
        out.update({f"reward/extra/{k}": v for k, v in self.extra.items()})
        return out

    def calls(self, batch: RolloutBatch) -> list[dict[str, Any]]:
        """The keyword arguments of each row's call, in the function's own signature."""
        decode = self.tokenizer.batch_decode
        response_ids = batch.column("response_ids").to_pylist()
        episodes = episode_records(batch)
        responses = [e["final_answer"] for e in episodes] if episodes else \
            decode(response_ids, skip_special_tokens=True)
        truths = ground_truths(batch, scalars_as_text=not self.verl)
        if self.verl:
            infos = [None if e is None else json.loads(e) for e in batch.column("extra_info").to_pylist()]
            if episodes:  # the whole episode rides in extra_info: messages, tool-call log, turn rewards
                infos = [{**(info if isinstance(info, dict) else {}), **_episode_info(ep)}
                         for info, ep in zip(infos, episodes, strict=True)]
            out = [{"data_source": d, "solution_str": r, "ground_truth": t}
                   for d, r, t in zip(batch.column("data_source").to_pylist(), responses, truths, strict=True)]
            for call, info in zip(out, infos, strict=True):
                if self._pass_extra:
                    call["extra_info"] = info
        else:
            prompts = decode(batch.column("prompt_ids").to_pylist(), skip_special_tokens=True)
            out = [{"prompt": p, "response": r, "ground_truth": t or ""}
                   for p, r, t in zip(prompts, responses, truths, strict=True)]
            eos = self.tokenizer.eos_token_id
            for row, (call, ids) in enumerate(zip(out, response_ids, strict=True)):
                if self._pass_finished:
                    call["finished"] = episodes[row]["finished"] if episodes else bool(ids) and ids[-1] == eos
                if episodes and self._pass_extra:
                    call["extra_info"] = _episode_info(episodes[row])
        return [{**call, **self.reward_kwargs} for call in out]

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        values, problems = self.raw(batch)
        return self._resolve(batch, values, problems)

    def raw(self, batch: RolloutBatch, per_row: list[dict[str, Any]] | None = None,
            skip: frozenset[int] = frozenset()) -> tuple[list[float], dict[int, str]]:
        """Each row's score and each failed row's problem, before `on_error`; `per_row`: keyword
        arguments added to each row's call (a judge's verdict), `skip`: rows not called (scored 0)."""
        calls = [{**call, **(per_row[i] if per_row else {})} for i, call in enumerate(self.calls(batch))]
        wanted = [i for i in range(len(calls)) if i not in skip]
        ran = self.pool.run([calls[i] for i in wanted]) if self.pool is not None else \
            [_call(self.fn, calls[i]) for i in wanted]
        results: list[tuple[str, Any]] = [("ok", 0.0)] * len(calls)
        for i, result in zip(wanted, ran, strict=True):
            results[i] = result
        values: list[float] = []
        problems: dict[int, str] = {}
        extras: dict[str, list[float]] = {}
        self.last_timeouts = sum(status == "timeout" for status, _ in results)
        for row, (status, value) in enumerate(results):
            if status == "ok" and isinstance(value, dict):
                for key, extra in value.items():
                    if key != "score" and score_problem(extra) is None:
                        extras.setdefault(key, []).append(float(extra))
                status, value = ("ok", value["score"]) if "score" in value else \
                    ("error", "returned a dict without a 'score' key")
            problem = value if status == "error" else score_problem(value) if status == "ok" else None
            if problem is not None:
                problems[row] = problem
            values.append(float(value) if status == "ok" and problem is None else 0.0)
        self.extra = {k: sum(v) / len(v) for k, v in extras.items()}
        return values, problems

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _episode_info(episode: dict[str, Any]) -> dict[str, Any]:
    """What `compute_score` sees of an episode in `extra_info`."""
    return {key: episode.get(key) for key in ("messages", "tool_calls", "num_turns", "tool_rewards", "finished",
                                              "truncated", "env_reward", "env_done", "env_failed")}


def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """("ok", value) or ("error", why): one call of the user's function, never raising."""
    try:
        return "ok", fn(**kwargs)
    except Exception as err:  # noqa: BLE001 - the user's function: reported per on_error
        return "error", f"raised {type(err).__name__}: {err}"


def _worker_main(conn: Any, target: str | Callable[..., Any]) -> None:
    """A pool process: resolve the function once, then answer one call at a time."""
    if isinstance(target, str):
        from verl_hpc.config.user_code import resolve_function

        target = resolve_function(target, "reward")
    conn.send(("ready", None))
    while True:
        try:
            kwargs = conn.recv()
        except EOFError:
            return
        status, value = _call(target, kwargs)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        try:
            conn.send((status, value))
        except Exception as err:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("error", f"returned {type(value).__name__}, which cannot be sent back: {err}"))


class RewardPool:
    """Processes that run a slow rule reward in parallel; a call past `timeout` kills its process.

    Why processes and a kill, not threads: rule rewards are CPU-bound Python (math
    verification, running code) that a thread cannot speed up, and a hung call (an
    endless loop in generated code) can only be stopped by ending its process. A timed-out
    call scores 0 and is counted (`reward/timeouts`); its process is replaced. The
    processes are spawned (not forked from a process holding torch threads) and import
    the function by its spec, which also works for a function loaded from a file.
    """

    def __init__(self, target: str | Callable[..., Any], num_workers: int, timeout: float):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.target, self.num_workers, self.timeout = target, num_workers, timeout
        self.workers: list[tuple[Any, Any]] = []

    def _start(self) -> tuple[Any, Any]:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker_main, args=(child, self.target), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(300) or parent.recv()[0] != "ready":
            raise RuntimeError("a reward worker process did not start within 300 s")
        return proc, parent

    def _replace(self, w: int) -> None:
        proc, conn = self.workers[w]
        proc.kill()
        proc.join(5)
        conn.close()
        self.workers[w] = self._start()

    def run(self, calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        """One (status, value) per call, in order; status is ok, error or timeout."""
        from multiprocessing.connection import wait

        while len(self.workers) < self.num_workers:
            self.workers.append(self._start())
        results: list[tuple[str, Any]] = [("timeout", None)] * len(calls)
        pending, idle = list(range(len(calls)))[::-1], list(range(self.num_workers))
        busy: dict[int, tuple[int, float]] = {}  # worker -> (row, deadline)
        while pending or busy:
            while pending and idle:
                w, row = idle.pop(), pending.pop()
                self.workers[w][1].send(calls[row])
                busy[w] = (row, time.monotonic() + self.timeout)
            conns = {self.workers[w][1]: w for w in busy}
            left = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
            for conn in wait(list(conns), timeout=left):
                w = conns[conn]
                row, _ = busy.pop(w)
                try:
                    results[row] = conn.recv()
                except EOFError:
                    results[row] = ("error", "the reward worker process died")
                    self._replace(w)
                idle.append(w)
            for w, (_row, deadline) in list(busy.items()):
                if deadline <= time.monotonic():
                    busy.pop(w)
                    self._replace(w)  # results[row] stays ("timeout", None)
                    idle.append(w)
        return results

    def close(self) -> None:
        for proc, conn in self.workers:
            conn.close()
            proc.kill()
            proc.join(5)
        self.workers = []


class ModelReward(_Checked):
    """A Hugging Face sequence-classification model; the score is logit 0 at the last token."""

    field = "reward.model_path"

    def __init__(self, path: str, device: torch.device | str = "cpu", micro_batch_size: int = 64,
                 on_error: str = "fail"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path = path
        self.device = torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model.config.pad_token_id = self.pad_id
        self.micro_batch_size = micro_batch_size
        self._set_policy(on_error)

    def describe(self) -> str:
        return f"the reward model {self.path}"

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """The classifier reads the last non-pad token of each [prompt | response] row."""
        inputs = batch.model_inputs(self.pad_id)
        scores = []
        for start in range(0, len(batch), self.micro_batch_size):
            sl = slice(start, start + self.micro_batch_size)
            logits = self.model(input_ids=inputs["input_ids"][sl].to(self.device),
                                attention_mask=inputs["attention_mask"][sl].to(self.device),
                                position_ids=inputs["position_ids"][sl].to(self.device)).logits
            scores.append(logits[:, 0].float().cpu())
        values = torch.cat(scores)
        problems = {row: f"returned {v}" for row, v in enumerate(values.tolist()) if not math.isfinite(v)}
        return self._resolve(batch, [0.0 if row in problems else v for row, v in enumerate(values.tolist())],
                             problems)
