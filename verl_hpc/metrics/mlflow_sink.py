"""MLflow: one MLflow run per emitting process, in a file store under the run directory by default.

Why `MlflowClient` and not `mlflow.start_run`/`mlflow.log_metric`: the fluent API keeps one
active run per process in a global, and several emitters can share a process (tests,
the embedded runtime's trainer and a serving group). The client names its run on every call.

Why a file store by default: it needs no server and no network, sits next to the run's
other outputs, and `mlflow ui --backend-store-uri file:<run_dir>/mlruns` reads it. Give
`logging.mlflow.tracking_uri` (sqlite:///path.db, http://server:5000) for anything shared.

Resume: the run is found again by its `verl_hpc.run_key` tag (a hash of the resolved run
directory and the emitter's tag) and continued. MLflow keeps every value it is sent, so the
steps between the checkpoint and the crash hold two points each, the later attempt's with
the later timestamp; MLflow has no call to delete a metric's points.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # metrics is the lowest layer: it reads the config's objects, never imports them
    from verl_hpc.config.observability import MlflowConfig
    from verl_hpc.metrics.sink import Emitter

RUN_KEY_TAG = "verl_hpc.run_key"
BATCH = 1000        # MLflow's MAX_METRICS_PER_BATCH
KEY_LENGTH = 250    # MLflow's MAX_ENTITY_KEY_LENGTH
_REFUSED = re.compile(r"[^\w./\- ]")


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts, unchanged when it already is (verl's `actor/pg_loss` is).

    MLflow takes alphanumerics, `_ - . /` and spaces (and `:` except on Windows: dropped here
    too, so a file store written on Linux reads anywhere), and refuses names that normalize
    to another path (`a//b`, `/a`, `a/`, `./a`, `..`). Refused characters become `_`, empty
    or dot-only path parts are dropped, and the name is cut to MLflow's 250 characters.
    """
    parts = [p for p in _REFUSED.sub("_", name).split("/") if p.strip(".")]
    return ("/".join(parts) or "_")[:KEY_LENGTH].rstrip("/")


def default_tracking_uri(emitter: Emitter) -> str:
    return (Path(emitter.run_dir) / "mlruns").resolve().as_uri()


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri


class MlflowSink:
    """`log_batch` of one step's metrics per call; the run is marked FINISHED when the sink closes."""

    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, emitter: Emitter):
        uri = cfg.tracking_uri or default_tracking_uri(emitter)
        if _is_file_store(uri) and "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
            # MLflow 3 refuses the file store (in "maintenance mode") unless this is set. It is
            # our default and the user chose nothing else; a user's own setting is left as is.
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        # Imported here: mlflow's import costs a second and most runs never open this sink.
        from mlflow.tracking import MlflowClient

        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment_id = self._experiment(cfg.experiment)
        self.run_id = self._run(emitter)

    def _experiment(self, name: str) -> str:
        """The experiment by name, created when missing (another process may create it first)."""
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _run(self, emitter: Emitter) -> str:
        """This emitter's run: the one an earlier attempt started, else a new one."""
        key = emitter.key
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'",
                                       max_results=1, order_by=["attributes.start_time DESC"])
        if runs:
            run_id = runs[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        tags = {RUN_KEY_TAG: key, "verl_hpc.emitter": emitter.tag,
                "verl_hpc.run_dir": str(Path(emitter.run_dir).resolve()),
                "role": emitter.role, "rank": str(emitter.rank), "job_id": emitter.job_id}
        name = f"{emitter.run_name}-{emitter.tag}"
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=name)
        return run.info.run_id

    def log_scalars(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch: list[Any] = [Metric(mlflow_key(k), float(v), stamp, step) for k, v in metrics.items()]
        for start in range(0, len(batch), BATCH):
            self.client.log_batch(self.run_id, metrics=batch[start:start + BATCH])

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Each sample dump as an artifact, `<tag>/step_<N>.txt`: MLflow has no text metric."""
        self.client.log_text(self.run_id, text, f"{mlflow_key(tag)}/step_{step:07d}.txt")

    def flush(self) -> None:
        """Nothing to do: every call above is written (or sent) before it returns."""

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
