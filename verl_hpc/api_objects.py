"""Turning the facade's Python objects into config that worker processes can read.

Why its own module: a worker is a fresh interpreter started from the run's config.yaml,
so a model object or a reward function handed to `HybridTrainer` must become a
directory (`model.path`) or an import spec (`reward.function`) before any worker starts,
or fail then in one line that names `actor_model`/`reward_model` and the fix. The same
rule as multiprocessing's spawn: only what can be imported by name crosses.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from verl_hpc.config import ConfigError, RunConfig, load_config
from verl_hpc.config.defaults import quickstart
from verl_hpc.utils.fs import expand_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_SOURCE_KEYS = ("path", "init_preset", "init_seed")  # what an actor_model replaces in `model`


def is_module(obj: Any) -> bool:
    """A torch module (torch is never imported for this: an object of it implies it is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def is_reward_object(obj: Any) -> bool:
    return obj is not None and not isinstance(obj, str | Path) and callable(obj)


def actor_fields(raw: dict[str, Any], actor_model: Any, from_defaults: bool) -> dict[str, Any]:
    """The `model` section that `actor_model` implies ({} when the config's stays)."""
    if actor_model is None:
        return {}
    kept = {k: v for k, v in (raw.get("model") or {}).items() if k not in MODEL_SOURCE_KEYS}
    if isinstance(actor_model, str | Path):
        if not (expand_path(str(actor_model)) / "config.json").is_file():
            raise ConfigError("actor_model", f"{actor_model} is not a Hugging Face model directory (no config.json)",
                              "pass a directory written by save_pretrained, or the model object")
        return {"model": {**kept, "path": str(actor_model)}}
    if not is_module(actor_model):
        raise ConfigError("actor_model", f"a {type(actor_model).__name__} is neither a model directory nor a "
                          "torch module", "pass a Hugging Face model (from_pretrained) or its directory")
    if raw.get("model") and not from_defaults:
        return {}  # the config's model.path holds the tokenizer (and the object holds the weights)
    source = str(getattr(actor_model, "name_or_path", "") or "")
    if not source or not any((expand_path(source) / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError("actor_model", "the model object does not say where its tokenizer is (its name_or_path "
                          f"{source!r} is not a local directory with one)", "load it with from_pretrained(DIR), "
                          "pass DIR as actor_model, or give a config whose model.path holds the tokenizer")
    return {"model": {**kept, "path": source}}


def reward_fields(raw: dict[str, Any], reward_model: Any) -> dict[str, Any]:
    """The `reward` section that `reward_model` implies ({} when the config's stays)."""
    if reward_model is None:
        return {}
    kept = {k: v for k, v in (raw.get("reward") or {}).items()
            if k not in ("function", "model_path", "custom_reward_function")}  # the object replaces them
    if isinstance(reward_model, str | Path):
        text = str(reward_model)
        if expand_path(text).is_dir():
            return {"reward": {**kept, "model_path": text}}
        if ":" in text:
            return {"reward": {**kept, "function": text}}
        raise ConfigError("reward_model", f"{text!r} is neither a reward-model directory nor module:function",
                          "e.g. my_rewards:score, or a directory written by save_pretrained")
    if is_module(reward_model):
        raise ConfigError("reward_model", f"a {type(reward_model).__name__} object cannot be given to the reward "
                          "role", "save it with save_pretrained(DIR) and pass DIR as reward_model")
    if not callable(reward_model):
        raise ConfigError("reward_model", f"a {type(reward_model).__name__} is not callable",
                          "pass fn(prompt, response, ground_truth, **kwargs) -> float")
    spec = importable_spec(reward_model)
    if spec is not None:
        return {"reward": {**kept, "function": spec}}
    # Runs in this process only (checked at launch); the section just has to be valid.
    return {} if raw.get("reward") else {"reward": quickstart()["reward"]}


def importable_spec(fn: Callable[..., Any]) -> str | None:
    """`module:name` for a function defined at the top level of an imported module."""
    module_name, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module_name or not name or module_name == "__main__" or "." in name or "<" in name:
        return None
    module = sys.modules.get(module_name)
    return f"{module_name}:{name}" if module is not None and getattr(module, name, None) is fn else None


def script_spec(fn: Callable[..., Any]) -> str | None:
    """`path/script.py:name` for a top-level function of the script being run, if it is guarded.

    Why the guard: a worker loads the script to find the function, which runs its top
    level; without `if __name__ == "__main__":` around the training call, every worker
    would start training again (multiprocessing's spawn has the same rule).
    """
    main, name = sys.modules.get("__main__"), getattr(fn, "__qualname__", "")
    file = getattr(main, "__file__", None)
    if getattr(fn, "__module__", None) != "__main__" or not file or "." in name or "<" in name \
            or getattr(main, name, None) is not fn or not _guarded(Path(file)):
        return None
    return f"{Path(file).resolve()}:{name}"


def _guarded(script: Path) -> bool:
    try:
        tree = ast.parse(script.read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__" for node in tree.body)


def module_root(fn: Callable[..., Any]) -> str | None:
    """The sys.path entry `fn`'s module was imported from, unless it is site-packages."""
    module_name = getattr(fn, "__module__", "") or ""
    file = getattr(sys.modules.get(module_name), "__file__", None)
    if not file or module_name == "__main__":
        return None
    path = Path(file).resolve()
    depth = module_name.count(".") + (1 if path.name == "__init__.py" else 0)
    root = path.parents[depth]
    site = {str(Path(p).resolve()) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    return None if str(root) in site else str(root)


def multi_process(cfg: RunConfig) -> bool:
    from verl_hpc.config.placement import plan_for_config

    return plan_for_config(cfg).world_size > 1


def launch_config(cfg: RunConfig, actor_model: Any, reward_model: Any, run_dir: Path,
                  save: bool, elsewhere: bool = False) -> tuple[RunConfig, Any, Any, list[str]]:
    """(config, actor object, reward object, PYTHONPATH entries) to hand an executor's `submit`.

    One process here: the objects pass through. Several, or `elsewhere` (a background run,
    a Slurm job): they become config (`cfg` is then a new object): the actor saved to
    `<run_dir>/init_model` when `save` (else the config only names it, unvalidated, for the
    run-dir check), the reward as an import spec.
    """
    if not elsewhere and not multi_process(cfg):
        return cfg, actor_model if is_module(actor_model) else None, \
            reward_model if is_reward_object(reward_model) else None, []
    updates: dict[str, Any] = {}
    paths: list[str] = []
    if is_reward_object(reward_model):
        spec = importable_spec(reward_model) or script_spec(reward_model)
        if spec is None:
            raise ConfigError("reward_model", f"{getattr(reward_model, '__qualname__', reward_model)!r} cannot be "
                              "imported by name, so the worker processes this config starts cannot call it",
                              "define it at the top level of a module (or of a script whose training call is under "
                              "if __name__ == '__main__':), or set reward.function: module:function")
        updates["reward"] = cfg.reward.model_copy(update={"function": spec, "model_path": None,
                                                          "custom_reward_function": None})
        paths.extend(p for p in [module_root(reward_model)] if p)
    if is_module(actor_model):
        init_dir = run_dir.absolute() / "init_model"
        if save:
            save_actor(actor_model, cfg, init_dir)
        updates["model"] = cfg.model.model_copy(update={"path": str(init_dir), "init_preset": None})
    if not updates:
        return cfg, None, None, paths
    new = cfg.model_copy(update=updates)
    if save:
        new = load_config(data=new.model_dump(mode="json", by_alias=True))
    return new, None, None, paths


def save_actor(model: Any, cfg: RunConfig, out: Path) -> None:
    """The actor object and model.path's tokenizer as a Hugging Face directory, atomically.

    An existing one is kept: a resumed run starts from its checkpoint, and the directory
    it started from is the record of where it began.
    """
    if (out / "config.json").is_file():
        return
    if not hasattr(model, "save_pretrained"):
        raise ConfigError("actor_model", f"a {type(model).__name__} has no save_pretrained, so it cannot reach the "
                          "worker processes", "pass a Hugging Face model or its directory, or use a one-process config")
    from transformers import AutoTokenizer

    tokenizer_dir = expand_path(cfg.model.path)
    if cfg.model.init_preset is not None:
        from verl_hpc.models.tiny import init_model

        init_model(tokenizer_dir, preset=cfg.model.init_preset, seed=cfg.model.init_seed)
    if not any((tokenizer_dir / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError("model.path", f"{tokenizer_dir} holds no tokenizer for the actor_model object",
                          "point model.path at the directory of the model's tokenizer")
    staging = out.with_name(f".{out.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(staging)
    os.replace(staging, out)


@contextlib.contextmanager
def worker_pythonpath(paths: list[str]) -> Iterator[None]:
    """PYTHONPATH with `paths` in front while the launcher starts workers (they inherit it)."""
    before = os.environ.get("PYTHONPATH")
    current = before.split(os.pathsep) if before else []
    added = [p for p in dict.fromkeys(paths) if p not in current]
    if added:
        os.environ["PYTHONPATH"] = os.pathsep.join([*added, *current])
    try:
        yield
    finally:
        if added and before is None:
            os.environ.pop("PYTHONPATH", None)
        elif added:
            os.environ["PYTHONPATH"] = before or ""
