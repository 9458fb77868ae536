"""The design card, checked: data flows one way, no import circles, small files and functions.

Why a test: "lower layers never import higher ones" and "no file over 400 lines" held only
as long as someone remembered them. The layer table lives in one place, docs/architecture.md
("Layers"), and this test reads it from there. Every import counts — module level, inside a
function (lazy) and under `TYPE_CHECKING` — because each is a dependency a reader must follow
and a circle a refactoring can close.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "verl_hpc"
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def layer_table(doc: Path = ARCHITECTURE) -> dict[str, int]:
    """Module prefix -> layer, from the "Layers" table: `| 9 | `verl_hpc.runtime.step` | ... |`."""
    section = doc.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    table: dict[str, int] = {}
    for row in re.finditer(r"^\| (\d+) \| ([^|]+) \|", section, flags=re.M):
        for name in re.findall(r"`([\w.]+)`", row.group(2)):
            table[name] = int(row.group(1))
    return table


def modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in (root / package).rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def module_imports(path: Path, known: dict[str, Path], package: str) -> set[str]:
    """Every package module `path` imports, anywhere in the file.

    `from pkg import sub` depends on the submodule `pkg.sub`, not on `pkg/__init__.py`: a
    package that re-exports its submodules would otherwise be in a circle with each of them.
    """
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
            subs = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
            out |= subs
            if len(subs) < len(node.names):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == package)
    return {m for m in out if m in known}


def import_graph(root: Path = REPO, package: str = "verl_hpc") -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: module_imports(path, known, package) - {name} for name, path in known.items()}


def layer_of(module: str, table: dict[str, int]) -> int | None:
    """The layer of the longest table prefix that names `module` (None: the table misses it)."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in table:
            return table[".".join(parts[:end])]
    return None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                found.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def upward_imports(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    return [f"{m} (layer {layer_of(m, table)}) -> {d} (layer {layer_of(d, table)})"
            for m, deps in sorted(graph.items()) for d in sorted(deps)
            if layer_of(d, table) > layer_of(m, table)]  # type: ignore[operator]


def test_the_table_places_every_module() -> None:
    table = layer_table()
    assert "verl_hpc.runtime.step" in table and "verl_hpc.utils" in table
    unplaced = [m for m in import_graph() if layer_of(m, table) is None]
    assert not unplaced, unplaced


def test_no_import_circles() -> None:
    assert not circles(import_graph())


def test_lower_layers_never_import_higher_ones() -> None:
    assert not upward_imports(import_graph(), layer_table())


def _write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_a_lazy_circle_and_a_typing_upward_import(tmp_path: Path) -> None:
    """A test of the test: imports hidden in a function or under TYPE_CHECKING still count."""
    _write_package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg.low import b\n",
        "low/b.py": "from pkg.low.a import f\n",
        "high/__init__.py": "",
        "high/c.py": "import pkg.low.a\n",
        "low/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high.c import x\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert ["pkg.low.a", "pkg.low.b", "pkg.low.a"] in circles(graph)
    table = {"pkg.low": 0, "pkg.high": 1, "pkg": 2}
    assert upward_imports(graph, table) == ["pkg.low.d (layer 0) -> pkg.high.c (layer 1)"]
    doc = tmp_path / "arch.md"
    doc.write_text("## Layers\n\n| layer | modules |\n|---|---|\n| 1 | `pkg.high` |\n| 0 | `pkg.low`, `x.y` |\n"
                   "\n## Next\n| 5 | `not.read` |\n")
    assert layer_table(doc) == {"pkg.high": 1, "pkg.low": 0, "x.y": 0}


def test_files_and_functions_stay_small() -> None:
    long_files = [f"{p.relative_to(REPO)}: {n}" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long_functions = [f"{p.relative_to(REPO)}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1}"
                      for p in PACKAGE.rglob("*.py") for f in ast.walk(ast.parse(p.read_text()))
                      if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                      and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long_files and not long_functions, long_files + long_functions


def test_the_loop_exists_once_and_talks_to_its_interfaces() -> None:
    """One train_step in the package; the loop reaches no role behind the stages' backs."""
    steps = [p for p in PACKAGE.rglob("*.py") if "def train_step(" in p.read_text()]
    assert [p.relative_to(REPO).as_posix() for p in steps] == ["verl_hpc/runtime/step/loop.py"]
    loop = (PACKAGE / "runtime" / "step" / "loop.py").read_text()
    assert "roles.actor" not in loop and "type: ignore" not in loop
    for gone in ("trainer", "components", "dist_trainer", "dist_roles", "dist_lifecycle", "dist_intake"):
        assert not (PACKAGE / "runtime" / f"{gone}.py").exists(), gone


@pytest.mark.parametrize("words", [r"session \d+", r"issue \d+", r"\bsittings?\b", r"\bseeds'|the seeds\b"])
def test_code_and_docs_speak_of_the_product_only(words: str) -> None:
    """No tracker or session numbers and no "seeds": a reader of the repository cannot look them up."""
    places = [*PACKAGE.rglob("*.py"), *(REPO / "docs").glob("*.md"), REPO / "README.md", *(REPO / "configs").glob("*")]
    found = [f"{p.relative_to(REPO)}" for p in places if re.search(words, p.read_text(), flags=re.I)]
    assert not found, found
