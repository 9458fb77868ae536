"""Where a run's numbers go: the metric sinks and how each is reached.

Why a section of its own: the sinks are operational (a resumed run may add Prometheus or
drop wandb without the config counting as changed), each has its own few knobs, and a
cluster's monitoring stack (a Pushgateway, node_exporter's textfile collector) is
described once, next to the others, rather than in a login shell.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator, model_validator

from verl_hpc.config.base import StrictModel
from verl_hpc.config.errors import FieldError

SinkName = Literal["tensorboard", "jsonl", "prometheus", "wandb", "mlflow"]
# sink -> (module it imports, what to pip install): checked before any job is submitted
SINK_PACKAGES = {"prometheus": ("prometheus_client", "prometheus-client"), "wandb": ("wandb", "wandb"),
                 "mlflow": ("mlflow", "mlflow-skinny")}


class PrometheusConfig(StrictModel):
    """Prometheus exposition: an HTTP `/metrics` endpoint, a Pushgateway, a node_exporter textfile."""

    serve: bool = Field(True, description="serve `/metrics` over HTTP from trainer rank 0 and each role group's "
                        "rank 0; the address goes to run_dir/prometheus/<role>_rank<N>.json (a file_sd target)")
    host: str = Field("0.0.0.0", description="the interface the `/metrics` server listens on")
    port: int = Field(0, ge=0, le=65535, description="0: a free port; N: trainer rank 0 on N, the k-th other role "
                      "group's rank 0 on N + k")
    sd_dir: str | None = Field(None, description="also write the file_sd target as <dir>/<run>_<role>_rank<N>.json: "
                               "one Prometheus glob (<dir>/*.json) finds every run (file_sd globs only a file name)")
    push_url: str | None = Field(None, description="a Pushgateway (http://host:9091) to push to after every step "
                                 "(for compute nodes Prometheus cannot scrape)")
    textfile_dir: str | None = Field(None, description="write <dir>/verl_hpc_<job>_<role>_rank<N>.prom after every "
                                     "step, for node_exporter's textfile collector")


class WandbConfig(StrictModel):
    project: str = "verl-hpc"
    entity: str | None = None
    mode: Literal["offline", "online"] = Field("offline", description="offline needs no network; `wandb sync` "
                                               "uploads later")
    dir: str | None = Field(None, description="where wandb writes its files (default: the run directory)")


class MlflowConfig(StrictModel):
    tracking_uri: str | None = Field(None, description="default: a file store in run_dir/mlruns; or sqlite:///"
                                     "path.db, or http://server:5000")
    experiment: str = "verl-hpc"


class LoggingConfig(StrictModel):
    sinks: list[SinkName] = Field(["tensorboard", "jsonl"], description="where metrics go; jsonl is always written "
                                  "(resume, `verl-hpc report` and tests read it)")
    tensorboard: bool = Field(True, description="false drops `tensorboard` from `sinks` (the older switch)")
    log_every: int = Field(1, ge=1)
    sample_every: int = Field(10, ge=1)
    num_samples: int = Field(4, ge=0)
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"
    prometheus: PrometheusConfig = Field(default_factory=PrometheusConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML 1.1 reads a bare `off`/`on` as a boolean; take it as the user meant it."""
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _one_each_and_installed(self) -> LoggingConfig:
        repeated = sorted({s for s in self.sinks if self.sinks.count(s) > 1})
        if repeated:
            raise FieldError("sinks", f"names {', '.join(repeated)} twice", "list each sink once")
        for sink in self.active_sinks():
            module, install = SINK_PACKAGES.get(sink, (None, None))
            if module is not None and importlib.util.find_spec(module) is None:
                raise FieldError("sinks", f"{sink} needs the {module} package, which is not installed",
                                 f"pip install {install}, or drop {sink} from logging.sinks")
        return self

    def active_sinks(self) -> list[str]:
        """The sinks a process opens: `sinks`, less TensorBoard when switched off, plus JSONL always."""
        chosen = [s for s in self.sinks if s != "tensorboard" or self.tensorboard]
        return chosen if "jsonl" in chosen else [*chosen, "jsonl"]
