"""Every fenced shell command in README.md and docs/ runs as written.

Why: the docs drifted (an export of a checkpoint its own `keep_last` had deleted). Each
```bash / ```sh block runs, command by command in order, in a scratch directory that
links the repository's `configs/`, `examples/`, `tools/` and `.venv/`, and must exit 0;
each ```console block's `$ command` must print the lines shown under it.

Not run, and why it is allowed: a command naming Slurm or a GPU (`NEEDS`: no cluster or
GPU here; tests/slurm and tests/gpu run those), and a block marked on the line before its
fence with `<!-- doc-test: skip REASON -->` (REASON says which test covers it instead).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEEDS = ("slurm", "sbatch", "submit", "squeue", "scontrol", "srun", "salloc", "sacct", "gpu_check", "nvidia",
         "cuda", "JOB_ID", "JOB", "tools/test.sh", "munge")
LINKED = ("configs", "examples", "tools", ".venv", "verl_hpc", "pyproject.toml")
_FENCE = re.compile(r"^```(\w*)\s*$")
_SKIP = re.compile(r"<!--\s*doc-test:\s*skip\b(.*?)-->")


@dataclass
class Block:
    source: str
    line: int
    lang: str
    text: str
    skip: str | None  # why it is not run

    @property
    def name(self) -> str:
        return f"{self.source}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            match = _FENCE.match(lines[i])
            if not match:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            lang = match.group(1)
            if lang in ("bash", "sh", "console"):
                marker = _SKIP.search(lines[i - 1]) if i else None
                text = "\n".join(lines[i + 1:end])
                needs = [w for w in NEEDS if re.search(rf"\b{re.escape(w)}\b", text)]
                skip = f"marked: {marker.group(1).strip()}" if marker else (f"needs {needs[0]}" if needs else None)
                found.append(Block(str(doc.relative_to(REPO)), i + 1, lang, text, skip))
            i = end + 1
    return found


def commands(text: str) -> list[str]:
    """Commands of a bash block: comments dropped, backslash continuations joined."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def console(text: str) -> list[tuple[str, list[str]]]:
    """`$ command` lines with the output lines shown after each."""
    pairs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        elif pairs:
            pairs[-1][1].append(line)
    return pairs


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    return root


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, text=True, capture_output=True, timeout=1200)


def test_every_block_is_run_or_says_why_not() -> None:
    found = blocks()
    assert len(found) > 10
    for block in found:
        if block.skip and block.skip.startswith("marked"):
            assert len(block.skip) > len("marked: ") + 5, f"{block.name}: a skip marker must give its reason"
    assert any(b.skip is None for b in found if b.source == "README.md")


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in blocks() if b.skip is None], ids=lambda b: b.name)
def test_doc_block_runs(block: Block, sandbox: Path) -> None:
    if block.lang == "console":
        for command, shown in console(block.text):
            proc = _run(command, sandbox)
            printed = (proc.stdout + proc.stderr).splitlines()
            for line in shown:
                assert line in printed, f"{block.name}: `{command}` no longer prints\n{line}\n---\n{proc.stderr}"
        return
    for command in commands(block.text):
        proc = _run(command, sandbox)
        assert proc.returncode == 0, f"{block.name}: `{command}` exited {proc.returncode}\n{proc.stderr[-3000:]}"
