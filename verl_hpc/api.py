"""The `HybridTrainer` facade: `HybridTrainer(actor_model=..., reward_model=..., config=...).train()`.

Why a facade apart from the loop: an executor (`verl_hpc.launch.executor`) runs whatever
placement a config asks for: `LocalExecutor` in this process when the plan has one process
and in worker processes otherwise, `SlurmExecutor` as one Slurm job. Workers are fresh
interpreters that read only the run's config, so this class turns what a user hands it
into config first: a `ResourceConfig` or a dict becomes a full `RunConfig` (the quickstart
fills the sections it lacks), a model object is saved under `<run_dir>/init_model`, and a
reward function becomes a `reward.function` the workers can import. In one process the
objects pass through as they are (the trained module is the user's own object).
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_hpc.api_objects import actor_fields, launch_config, reward_fields, worker_pythonpath
from verl_hpc.config import ConfigError, ResourceConfig, RunConfig, load_config, read_yaml
from verl_hpc.config.defaults import quickstart

if TYPE_CHECKING:
    from verl_hpc.launch.executor import Executor
    from verl_hpc.launch.handle import RunHandle
    from verl_hpc.runtime.lifecycle import TrainResult

ConfigLike = str | Path | RunConfig | ResourceConfig | dict[str, Any] | None

__all__ = ["HybridTrainer", "build_config"]


class HybridTrainer:
    """Train a policy with RL on the resources a config gives each role.

    `config` is a path to a YAML run config (or to a standalone `resource_config.yaml`),
    a `RunConfig`, a dict of either, a `ResourceConfig`, or None (the quickstart).
    `actor_model` is a Hugging Face directory or model object (its tokenizer comes from
    `model.path`, or from the object's own `name_or_path` when the config names no
    model); `reward_model` is a function `fn(prompt=, response=, ground_truth=) -> float`,
    a `module:function` string or a reward-model directory. `overrides` are applied last
    (`["resources.device_type=cpu", "trainer.total_steps=50"]`).
    """

    def __init__(self, config: ConfigLike = None, actor_model: Any = None, reward_model: Any = None,
                 run_dir: str | Path | None = None, overrides: list[str] | None = None):
        self._actor_model, self._reward_model = actor_model, reward_model
        self.config: RunConfig = build_config(config, actor_model, reward_model, overrides)
        self.run_dir = _run_dir_path(run_dir, self.config, config if isinstance(config, str | Path) else None)
        self._started = threading.Event()
        self._check()

    def train(self) -> TrainResult:
        """Run the config's placement to the end (or to a stop signal) on this machine; as `verl-hpc train` does."""
        return self.submit().result()

    def submit(self, executor: Executor | None = None) -> RunHandle:
        """Start the run with `executor` (default: `LocalExecutor()`, this machine, in the foreground).

        A one-process run in the foreground gets the model and reward objects as they are;
        everywhere else (worker processes, a background run, a Slurm job) they are written
        down first: the model under `<run_dir>/init_model`, the reward as an import spec.
        Example: `trainer.submit(SlurmExecutor()).wait()`.
        """
        from verl_hpc.launch.executor import LocalExecutor
        from verl_hpc.runtime.state.run_dir import prepare_run_dir

        self._check()
        executor = executor if executor is not None else LocalExecutor()
        here = isinstance(executor, LocalExecutor) and not executor.background
        cfg, actor, reward, paths = launch_config(self.config, self._actor_model, self._reward_model,
                                                  self.run_dir, save=False, elsewhere=not here)
        if cfg is not self.config:  # worker processes: the objects must be written down first
            prepare_run_dir(self.run_dir, cfg)
            cfg, actor, reward, paths = launch_config(self.config, self._actor_model, self._reward_model,
                                                      self.run_dir, save=True, elsewhere=not here)
        self._started.set()  # from here on, update_resource asks the run (docs/elastic.md)
        with worker_pythonpath(paths):
            if isinstance(executor, LocalExecutor):
                return executor.submit(cfg, self.run_dir, actor_model=actor, reward_model=reward)
            return executor.submit(cfg, self.run_dir)

    def update_resource(self, component: str, device_ids: list[int] | None = None, strategy: str | None = None,
                        **fields: Any) -> Path | None:
        """Move `component` (a role) to new resources, as `RunHandle.update_resource` does.

        Before `train()` this trainer's own config changes (validated again, so a bad value
        fails here, naming the field); returns None. Once `train()` has started (from
        another thread) or finished, it asks the run in `run_dir` to resize at its next step
        boundary and returns the request file (docs/elastic.md).
        Example: `trainer.update_resource(component="reward", device_ids=[2, 3], strategy="data_parallel")`.
        """
        if self._started.is_set():
            from verl_hpc.launch.handle import RunHandle

            return RunHandle.attach(self.run_dir).update_resource(component, device_ids, strategy, **fields)
        from verl_hpc.runtime.state.resize import overrides_for

        overrides = overrides_for(component, device_ids=device_ids, strategy=strategy, **fields)
        self.config = load_config(data=self.config.model_dump(mode="json", by_alias=True), overrides=overrides)
        self._check()
        return None

    def _check(self) -> None:
        """Fail before any work when an object cannot reach the worker processes the config starts."""
        launch_config(self.config, self._actor_model, self._reward_model, self.run_dir, save=False)


def build_config(config: ConfigLike, actor_model: Any = None, reward_model: Any = None,
                 overrides: list[str] | None = None) -> RunConfig:
    """The validated run config that `config`, the two objects and `overrides` describe together.

    Objects are only described here (a directory as `model.path`, an importable function
    as `reward.function`); nothing is saved. Raises ConfigError naming the field.
    """
    raw, source, defaults = _base(config)
    raw.update(actor_fields(raw, actor_model, from_defaults=defaults))
    raw.update(reward_fields(raw, reward_model))
    try:
        return load_config(data=raw, overrides=overrides)
    except ConfigError as err:
        raise ConfigError(err.path, err.message, err.hint, source) from None


def _base(config: ConfigLike) -> tuple[dict[str, Any], str | None, bool]:
    """(raw config, the file it came from, whether the model section is the quickstart's)."""
    if config is None:
        return quickstart(), None, True
    if isinstance(config, ResourceConfig):
        return _with_resources(config.model_dump(mode="json", by_alias=True)), None, True
    if isinstance(config, RunConfig):
        return config.model_dump(mode="json", by_alias=True), None, False
    if isinstance(config, dict):
        data, source = copy.deepcopy(config), None
    elif isinstance(config, str | Path):
        data, source = read_yaml(config), str(config)
    else:
        raise ConfigError("config", f"a {type(config).__name__} is not a config",
                          "pass a YAML path, a RunConfig, a dict, or load_resource_config(...)")
    if _is_resources(data):  # a standalone resource_config.yaml (as a file or a dict)
        return _with_resources(data), source, True
    return data, source, False


def _is_resources(data: dict[str, Any]) -> bool:
    keys = set(data)
    return bool(keys) and keys <= set(ResourceConfig.model_fields) and not keys <= set(RunConfig.model_fields)


def _with_resources(resources: dict[str, Any]) -> dict[str, Any]:
    data = quickstart()
    data["resources"] = resources
    return data


def _run_dir_path(run_dir: str | Path | None, cfg: RunConfig, config_path: str | Path | None) -> Path:
    """`run_dir`, else the one `verl-hpc train` would pick for this config (known before the run)."""
    from verl_hpc.runtime.state import run_dir as run_dirs
    from verl_hpc.utils.fs import expand_path

    if run_dir:
        return expand_path(str(run_dir))
    named = getattr(run_dirs, "named_run_dir", None)  # runs/<trainer.run_name or file stem>
    if named is not None:
        return named(cfg, config_path)
    return expand_path(cfg.run_dir) if cfg.run_dir else run_dirs.default_run_dir()
