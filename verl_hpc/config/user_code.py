"""Code a config names: plugin modules and `module:function` specs, imported only when named.

Why apart from the schema: importing a user's module runs their code, so it happens once, at
validation, with errors that name the config field; a file is loaded only if no other user
could have changed it (it would run as you, in your job).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import threading
from pathlib import Path

from verl_hpc.config.errors import FieldError
from verl_hpc.utils.fs import expand_path

_FILE_LOCK = threading.RLock()  # one user file loads at a time (see _load_file_module)


def import_plugins(specs: list[str]) -> None:
    """Import `plugins` (modules or .py files) so what they register exists before validation."""
    for i, spec in enumerate(specs):
        field = f"plugins[{i}]"
        if spec.endswith(".py"):
            _load_file_module(spec, field)
        else:
            _import_module(spec, field)


def resolve_function(spec: str, field: str):  # -> Callable
    """Import the reward `module:function` or `path/to/file.py:function` and check its signature."""
    func = import_callable(spec, field)
    params = inspect.signature(func).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    verl = {"data_source", "solution_str", "ground_truth"} <= set(params)  # verl's compute_score
    if not takes_kwargs and not verl and not {"response", "ground_truth"} <= set(params):
        raise FieldError(field, f"{spec} must accept (prompt, response, ground_truth) keyword arguments, or "
                         "verl's (data_source, solution_str, ground_truth, extra_info=None)",
                         "define it as def score(prompt, response, ground_truth, **kwargs) -> float")
    return func


def import_callable(spec: str, field: str):  # -> Callable
    """Import `module:function` or `path/to/file.py:function` (only what the user named)."""
    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name:
        raise FieldError(field, f"{spec!r} is not of the form module:function",
                         "e.g. verl_hpc.data.tasks.arithmetic:score or rewards/my_reward.py:score")
    module = _load_file_module(module_name, field) if module_name.endswith(".py") else \
        _import_module(module_name, field)
    func = getattr(module, func_name, None)
    if not callable(func):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise FieldError(field, f"{module_name!r} has no function {func_name!r}",
                         f"functions there: {', '.join(sorted(names)[:8]) or 'none'}")
    return func


def _import_module(module_name: str, field: str):  # -> ModuleType
    if importlib.util.find_spec(module_name.split(".")[0]) is None:
        raise FieldError(field, f"module {module_name!r} cannot be found",
                         "check the name, add its folder to PYTHONPATH, or give a file: path/to/file.py:function")
    try:
        return importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - report the user's import failure on one line
        raise FieldError(field, f"importing {module_name!r} failed: {type(err).__name__}: {err}",
                         "fix the module so it imports") from None


def _load_file_module(file_name: str, field: str):  # -> ModuleType
    """A user's file as a module, once per process. Under a lock: the module is in sys.modules while
    it runs, and another thread (environments reset in parallel) must not take it half-loaded."""
    with _FILE_LOCK:
        return _load_file_module_locked(file_name, field)


def _load_file_module_locked(file_name: str, field: str):  # -> ModuleType
    path = expand_path(file_name).resolve()
    if not path.is_file():
        what = "reward file" if field.startswith("reward") else "file"
        raise FieldError(field, f"{what} {path} does not exist", "check the path (relative to the working dir)")
    _check_trusted_file(path, field)
    name = f"verl_hpc_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # before it runs, as `import` does: dataclasses and pickling look it up there
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as err:  # noqa: BLE001
        sys.modules.pop(name, None)
        raise FieldError(field, f"loading {path} failed: {type(err).__name__}: {err}",
                         "fix the file so it imports") from None
    return module


def _check_trusted_file(path: Path, field: str) -> None:
    """Refuse to run code that another user could have changed: it would run as you, in your job."""
    st = path.stat()
    if st.st_uid not in (os.getuid(), 0):
        raise FieldError(field, f"reward file {path} is owned by uid {st.st_uid}, not by you",
                         "copy it into a directory of your own and point reward.function there")
    if st.st_mode & 0o022:
        raise FieldError(field, f"reward file {path} is writable by group or others (mode {st.st_mode & 0o777:04o})",
                         f"chmod go-w {path}")
