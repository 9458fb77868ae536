"""The design card, checked: data flows one way, no import circles, small files and functions.

Why a test: "lower layers never import higher ones" and "no file over 400 lines" held only
as long as someone remembered them; the one-loop rewrite removed a circle
(dist_trainer -> dist_lifecycle -> dist_roles -> dist_trainer) that nobody had noticed.
Only module-level imports count: an import inside a function is how a lower layer asks
for an optional heavy dependency, and runs after every module has loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "verl_hpc"
# Higher numbers may import lower ones, never the reverse (DEVELOPERS.md's layer order).
LAYER = {"metrics": 0, "utils": 0, "checkpoint": 1, "data": 2, "algo": 2, "models": 2, "config": 3, "roles": 4,
         "runtime": 5, "launch": 6, "cli": 7, "api": 7, "api_objects": 7}
FACADES = {"verl_hpc.utils.resource"}  # the seeds import the trainer from here: it re-exports upwards, lazily
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def module_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """verl_hpc modules imported at module level (TYPE_CHECKING blocks excluded)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verl_hpc"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("verl_hpc"))
    return {m for m in out if m in known}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: module_imports(path, known) - {name} for name, path in known.items()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def test_no_import_circles() -> None:
    graph = import_graph()
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, circles


def test_lower_layers_never_import_higher_ones() -> None:
    upward = [f"{m} -> {d}" for m, deps in import_graph().items() if m not in FACADES for d in deps
              if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]
    assert not upward, upward


def test_files_and_functions_stay_small() -> None:
    long_files = [f"{p.relative_to(REPO)}: {n}" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long_functions = [f"{p.relative_to(REPO)}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1}"
                      for p in PACKAGE.rglob("*.py") for f in ast.walk(ast.parse(p.read_text()))
                      if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                      and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long_files and not long_functions, long_files + long_functions


def test_the_loop_exists_once() -> None:
    """One train_step in the package, and none of the removed second loop's modules."""
    steps = [p for p in PACKAGE.rglob("*.py") if "def train_step(" in p.read_text()]
    assert [p.relative_to(REPO).as_posix() for p in steps] == ["verl_hpc/runtime/step/loop.py"]
    for gone in ("trainer", "components", "dist_trainer", "dist_roles", "dist_lifecycle", "dist_intake"):
        assert not (PACKAGE / "runtime" / f"{gone}.py").exists(), gone
