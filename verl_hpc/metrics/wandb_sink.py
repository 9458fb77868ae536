"""Weights & Biases: one wandb run per emitting process, offline unless the config says online.

Why offline by default: compute nodes often have no route out, and a tracker that waits
on the network inside the training loop costs step time. Offline, wandb writes a local
`<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb` file; `wandb sync <dir>/wandb/offline-run-*`
uploads it later, from a login node.

Why a stable run id: a requeued or resumed job is the same run. The id is a short hash of
the resolved run directory and the emitter's tag, so every attempt of one process finds
the same wandb run (`resume="allow"`), and two processes of one job never share one.

Resume: wandb cannot rewind a run's history from the SDK (the "rewind" feature is a server
preview). Each attempt writes its own offline directory with the same id, and the steps
between the checkpoint and the crash are logged again with the same step numbers, so the
local files hold both attempts' values (checked by tests/metrics/test_metric_sinks.py). Online,
the SDK resumes at the server's last step and drops any step at or below it with a
warning: there the first attempt's values are the ones kept. metrics.jsonl and TensorBoard
(purged at the checkpoint) hold the later attempt's values.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # metrics is the lowest layer: it reads the config's objects, never imports them
    from verl_hpc.config.observability import WandbConfig
    from verl_hpc.metrics.sink import Emitter

log = logging.getLogger("verl_hpc.metrics")


class WandbSink:
    """`run.log(metrics, step=step)` per step; the run finishes when the sink closes."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, emitter: Emitter, purge_step: int | None = None):
        # Imported here: wandb's import costs about a second and most runs never open this sink.
        os.environ.setdefault("WANDB_SILENT", "true")  # wandb's own banner and sync hints
        import wandb

        root = Path(cfg.dir) if cfg.dir else Path(emitter.run_dir)
        root.mkdir(parents=True, exist_ok=True)  # wandb would create it too, with a less plain error
        self.run_id = emitter.key
        self.purge_step = purge_step
        self._run: Any = wandb.init(
            project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(root), id=self.run_id,
            resume="allow", name=f"{emitter.run_name}-{emitter.tag}", reinit="create_new",
            config={"role": emitter.role, "rank": emitter.rank, "job_id": emitter.job_id,
                    "run_dir": str(Path(emitter.run_dir).resolve())},
            settings=self._settings(wandb))
        self._table_rows: list[list[Any]] = []

    @staticmethod
    def _settings(wandb: Any) -> Any:
        """Quiet and self-contained: the trainer's console is the run's own.

        `console="off"`: wandb would otherwise wrap stdout/stderr of the whole process.
        System stats and machine info are off: the runtime reports memory itself, and the
        probes start threads and read GPUs on every node (x_ names are wandb's own).
        """
        return wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True,
                              save_code=False)

    def log_scalars(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Samples go to one table, logged again whole (all rows so far) into the step's row.

        Why one growing table: a logged wandb.Table is immutable and the UI shows a key's
        latest version, so re-logging every row keeps all samples visible in one place;
        samples come every `sample_every` steps, so it stays small. `step=step` merges it
        into the row the step's scalars opened (the runtime logs text after them).
        """
        import wandb

        self._table_rows.append([step, tag, text])
        table = wandb.Table(columns=["step", "tag", "text"], data=[list(r) for r in self._table_rows])
        self._run.log({f"{tag}_table": table}, step=step)

    def flush(self) -> None:
        """Nothing to do: wandb's service writes the offline file as records arrive."""

    def close(self) -> None:
        """Finish the run, then make its offline file whole before returning.

        Why the teardown: `finish()` returns once wandb's service has the exit record, but
        the service may still hold the run file's last records in its write buffer (CI
        read a file of only its 7-byte header right after `finish()`). Shutting the
        service down flushes and closes every file. It is done only when no other wandb
        run is active in this process, since teardown would also finish a user's own run;
        then the next sink's `wandb.init` starts a fresh service (about a second).
        """
        import wandb

        self._run.finish()
        if wandb.run is None:
            wandb.teardown()
