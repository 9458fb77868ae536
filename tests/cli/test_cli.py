"""The `verl-hpc` command line: version, `config show`, `init-model`, and usage errors.

Commands run as a user runs them (a subprocess of this interpreter, or the installed
console script next to it), so exit codes, stdout and stderr are the real ones.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

import verl_hpc
from verl_hpc.config import load_config

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SCRIPT = Path(sys.executable).parent / "verl-hpc"
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # for the in-process builds too
MODULE = [sys.executable, "-m", "verl_hpc"]
ERROR_PREFIX = "verl-hpc: error: "


def run(argv: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=ENV, text=True, capture_output=True, timeout=300)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    """Each file's bytes, modification time and inode: a rewrite changes at least one of them."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino)
            for p in sorted(directory.iterdir())}


# ---------------------------------------------------------------------------------------------
# Version and usage.
# ---------------------------------------------------------------------------------------------


def test_package_version() -> None:
    assert verl_hpc.__version__ == "0.1.0"
    assert version("verl-hpc") == "0.1.0"


@pytest.mark.parametrize("command", [[str(SCRIPT)], MODULE], ids=["console-script", "python-m"])
def test_version_flag(command: list[str]) -> None:
    assert SCRIPT.is_file(), f"console script not installed next to {sys.executable}"

    proc = run([*command, "--version"])

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "verl-hpc 0.1.0\n"
    assert proc.stderr == ""


def test_no_arguments_prints_usage_and_fails() -> None:
    proc = run(MODULE)

    assert proc.returncode != 0
    assert proc.stderr.startswith("usage: verl-hpc")
    assert "required: command" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_unknown_subcommand_fails_with_usage() -> None:
    proc = run([str(SCRIPT), "trian", "configs/quickstart.yaml"])

    assert proc.returncode == 2
    assert "usage: verl-hpc" in proc.stderr and "invalid choice: 'trian'" in proc.stderr


# ---------------------------------------------------------------------------------------------
# config show.
# ---------------------------------------------------------------------------------------------


def test_config_show_prints_the_resolved_config_with_overrides() -> None:
    proc = run([str(SCRIPT), "config", "show", "configs/quickstart.yaml", "trainer.total_steps=7"])

    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    shown = yaml.safe_load(proc.stdout)
    assert shown["trainer"]["total_steps"] == 7
    assert shown["trainer"]["batch_size"] == 128  # untouched values come through
    assert shown["checkpoint"]["async"] is True  # every default is shown, under its YAML name
    assert load_config(data=shown) == load_config(QUICKSTART, ["trainer.total_steps=7"])


def test_config_show_bad_override_is_one_line(tmp_path: Path) -> None:
    proc = run([str(SCRIPT), "config", "show", str(QUICKSTART), "trainer.total_steps=-5"], cwd=tmp_path)

    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{ERROR_PREFIX}{QUICKSTART}: trainer.total_steps: Input should be greater than or equal to 1 (got -5)"]
    assert proc.stdout == ""


# ---------------------------------------------------------------------------------------------
# init-model.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same model (tiny, seed 3) built twice into unrelated directories, at the same time:
    once by a `python -m verl_hpc` subprocess, once by `main()` in this (already busy) process."""
    from verl_hpc.cli.main import main

    root = tmp_path_factory.mktemp("init-model")
    outs = {"a": root / "first" / "nested" / "model", "b": root / "second"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run, [*MODULE, "init-model", str(outs["a"]), "--preset", "tiny", "--seed", "3"], root)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(["init-model", str(outs["b"]), "--seed", "3"])
        proc = future.result()
    assert code == 0
    assert f"(tiny, seed 3) in {outs['b']}" in printed.getvalue()
    assert proc.returncode == 0, proc.stderr
    assert f"(tiny, seed 3) in {outs['a']}" in proc.stdout
    return outs


def test_init_model_is_loadable_with_transformers(built: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = built["a"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["1+2="], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits

    assert logits.shape == (1, batch["input_ids"].shape[1], len(tokenizer))
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.decode(batch["input_ids"][0]) == "1+2="
    marker = json.loads((out / "verl_hpc_model.json").read_text())
    assert (marker["preset"], marker["seed"]) == ("tiny", 3)


def test_init_model_twice_is_a_noop(built: dict[str, Path]) -> None:
    out = built["a"]
    before = snapshot(out)

    proc = run([str(SCRIPT), "init-model", str(out), "--preset", "tiny", "--seed", "3"])

    assert proc.returncode == 0, proc.stderr
    assert snapshot(out) == before
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no staging directory left behind


def test_init_model_other_seed_needs_overwrite(built: dict[str, Path]) -> None:
    out = built["a"]
    before = snapshot(out)

    proc = run([*MODULE, "init-model", str(out), "--seed", "4"])

    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{ERROR_PREFIX}out_dir: {out} holds a model built with")
    assert "'seed': 3" in lines[0] and "--overwrite" in lines[0]
    assert "Traceback" not in proc.stderr
    assert snapshot(out) == before


def test_init_model_is_deterministic(built: dict[str, Path]) -> None:
    first, second = built["a"], built["b"]

    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())


def test_init_model_overwrite_rebuilds_with_the_new_seed(built: dict[str, Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from verl_hpc.cli.main import main

    out = tmp_path / "model"
    shutil.copytree(built["a"], out)
    old = (out / "model.safetensors").read_bytes()
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")

    code = main(["init-model", str(out), "--seed", "4", "--overwrite"])

    assert code == 0, capsys.readouterr().err
    assert json.loads((out / "verl_hpc_model.json").read_text())["seed"] == 4
    assert (out / "model.safetensors").read_bytes() != old
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_init_model_refuses_a_foreign_directory(tmp_path: Path) -> None:
    foreign = tmp_path / "thesis"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("do not delete\n")

    proc = run([str(SCRIPT), "init-model", str(foreign), "--preset", "tiny"], cwd=tmp_path)

    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"{ERROR_PREFIX}out_dir: {foreign} exists and is not a model built by "
                                        "verl-hpc; choose an empty directory"]
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert (foreign / "notes.txt").read_text() == "do not delete\n"
    assert [p.name for p in tmp_path.iterdir()] == ["thesis"]  # no staging directory either


def test_init_model_rejects_an_unknown_preset(tmp_path: Path) -> None:
    proc = run([*MODULE, "init-model", str(tmp_path / "m"), "--preset", "huge"], cwd=tmp_path)

    assert proc.returncode == 2
    assert "invalid choice: 'huge'" in proc.stderr
    assert list(tmp_path.iterdir()) == []
