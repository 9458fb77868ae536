"""A rollout engine that serves recorded responses: sampling noise out, everything else real.

Why: "a placement must never change the numbers" can only be tested if every placement
trains on the same responses. A run with `data.record_rollouts` writes the rows each
trainer rank trained on; a run with `data.replay_rollouts` pointing there generates
nothing and returns, for each row, the recorded response of the same (step, prompt group,
sample). The wrapped engine still takes every weight sync, so the sync paths run as usual.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_hpc.data.rollout_batch import TRAJECTORY_COLUMNS, RolloutBatch
from verl_hpc.roles.rollout.base import Generation

RECORD_DIR = "rollouts"


def record_file(run_dir: Path, step: int, rank: int) -> Path:
    return run_dir / RECORD_DIR / f"step_{step:08d}_rank{rank:04d}.arrow"


def write_record(run_dir: Path, step: int, rank: int, batch: RolloutBatch) -> Path:
    """This rank's rows of `step`, as an Arrow IPC stream (written then renamed: never half a file)."""
    path = record_file(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(batch.to_ipc())
    tmp.replace(path)
    return path


class ReplayError(RuntimeError):
    pass


class ReplayRolloutEngine:
    """Wraps a real engine; `replay(step, keys)` answers instead of sampling."""

    def __init__(self, inner: Any, record_dir: Path):
        self.inner = inner
        self.record_dir = Path(record_dir)
        self._step: int | None = None
        self._rows: dict[tuple[int, int], tuple[list[int], list[float], int]] = {}
        self._episodes: dict[tuple[int, int], dict[str, Any]] = {}  # agent rows: their trajectory columns

    def __getattr__(self, name: str) -> Any:  # load_weights, weight_specs, sleep, model, ...
        return getattr(self.inner, name)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.inner.policy_version = value

    def _load(self, step: int) -> None:
        files = sorted(self.record_dir.glob(f"step_{step:08d}_rank*.arrow"))
        if not files:
            raise ReplayError(f"data.replay_rollouts: no recorded rollouts for step {step} in {self.record_dir} "
                              "(hint: record them with data.record_rollouts: true and as many steps)")
        self._rows, self._episodes = {}, {}
        for path in files:
            table = RolloutBatch.from_ipc(path.read_bytes()).record_batch
            cols = {name: table.column(name).to_pylist() for name in
                    ("group_id", "sample_index", "prompt_index", "response_ids", "rollout_logprobs")}
            for g, s, p, r, lp in zip(cols["group_id"], cols["sample_index"], cols["prompt_index"],
                                      cols["response_ids"], cols["rollout_logprobs"], strict=True):
                self._rows[(g, s)] = (r, lp if lp is not None else [0.0] * len(r), p)
            if TRAJECTORY_COLUMNS[0] in table.schema.names:  # agent episodes: the whole trajectory replays
                episodes = {name: table.column(name).to_pylist() for name in ("prompt_ids", *TRAJECTORY_COLUMNS)}
                for i, key in enumerate(zip(cols["group_id"], cols["sample_index"], strict=True)):
                    self._episodes[key] = {name: column[i] for name, column in episodes.items()}
        self._step = step

    def replay(self, step: int, keys: list[tuple[int, int, int]]) -> Generation:
        """Recorded responses for (group_id, sample_index, prompt_index) rows of `step`."""
        if self._step != step:
            self._load(step)
        responses, logprobs = [], []
        for group, sample, prompt in keys:
            found = self._rows.get((group, sample))
            if found is None or found[2] != prompt:
                raise ReplayError(f"data.replay_rollouts: step {step} has no recorded row for prompt group "
                                  f"{group} sample {sample} (prompt {prompt}); record with the same "
                                  "trainer.batch_size, sampling.n, seed and data")
            responses.append(list(found[0]))
            logprobs.append(list(found[1]))
        if not self._episodes:
            return Generation(responses, logprobs)
        rows = [self._episodes[(g, s)] for g, s, _ in keys]  # every id the trainer scores, as sampled
        return Generation(responses, logprobs, {name: [r[name] for r in rows] for name in TRAJECTORY_COLUMNS},
                          [r["prompt_ids"] for r in rows])


def is_replay(engine: Any) -> bool:
    return isinstance(engine, ReplayRolloutEngine)


__all__ = ["RECORD_DIR", "ReplayError", "ReplayRolloutEngine", "is_replay", "record_file", "write_record"]
