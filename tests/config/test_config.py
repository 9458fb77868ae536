"""The config layer's promises: the standalone resource_config.yaml loads verbatim, bad configs fail in one line, dumps round-trip.

The bad-config cases go through the real CLI, most in a subprocess, because the promise
is about what a user on a login node sees: exit code 2, one line naming the field, no
traceback, and nothing created. The subprocesses start together (one per CPU) in a
module fixture so the matrix costs seconds, not a minute; each case is still its own
test. A few cases call the same `main()` in this process to spare a torch import each.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from verl_hpc import load_resource_config
from verl_hpc.config import (
    ConfigError,
    RunConfig,
    dump_config,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
RESOURCE_CONFIG = REPO / "configs" / "resource_config.yaml"
CLI_ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
ERROR_PREFIX = "verl-hpc: error: "


def quickstart() -> dict[str, Any]:
    return yaml.safe_load(QUICKSTART.read_text())


# ---------------------------------------------------------------------------------------------
# 1. The standalone resource_config.yaml loads unchanged.
# ---------------------------------------------------------------------------------------------


def compare_tree(expected: Any, actual: Any, path: str) -> Iterator[str]:
    """Walk the YAML value; yield each leaf path after asserting the loaded object holds it."""
    if isinstance(expected, dict):
        assert isinstance(actual, BaseModel), f"{path}: {actual!r} is not a config section"
        for key, value in expected.items():
            sub = f"{path}.{key}" if path else key
            assert hasattr(actual, key), f"{sub} was dropped by the loader"
            yield from compare_tree(value, getattr(actual, key), sub)
    elif isinstance(expected, list):
        assert isinstance(actual, list), f"{path}: {actual!r} is not a list"
        assert len(actual) == len(expected), path
        for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
            yield from compare_tree(want, got, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: YAML has {expected!r}, loaded {actual!r}"
        same_type = type(actual) is type(expected) or (type(expected) is int and type(actual) is float)
        assert same_type, f"{path}: type changed from {type(expected).__name__} to {type(actual).__name__}"
        yield path


def test_resource_config_yaml_loads_verbatim() -> None:
    raw = yaml.safe_load(RESOURCE_CONFIG.read_text())
    cfg = load_resource_config(RESOURCE_CONFIG)

    leaves = list(compare_tree(raw, cfg, ""))

    assert len(leaves) >= 12, leaves  # the walk really reached the nested values
    assert "rollout.vllm_args.gpu_memory_utilization" in leaves
    assert cfg.actor.device_ids == [0, 1]
    assert cfg.actor.device_type == "cuda" and cfg.actor.strategy == "fsdp"
    assert cfg.reward is not None and cfg.reward.device_ids == [2] and cfg.reward.strategy == "none"
    assert cfg.rollout.strategy == "vllm" and cfg.rollout.device_ids == [3]
    assert cfg.rollout.vllm_args is not None
    assert cfg.rollout.vllm_args.gpu_memory_utilization == 0.85
    assert cfg.rollout.vllm_args.tensor_parallel_size == 1
    assert cfg.rollout.vllm_args.enforce_eager is False
    assert cfg.comm_backend == "nccl" and cfg.resolved_backend() == "nccl"
    assert cfg.timeout_seconds == 180
    assert cfg.actor.world_size == 2


# ---------------------------------------------------------------------------------------------
# 2. Bad configs through the real CLI: exit 2, one line, the field path, nothing created.
# ---------------------------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any], Path], "dict[str, Any] | str | None"]


@dataclass(frozen=True)
class BadCase:
    id: str
    mutate: Mutation  # edits the quickstart dict in place (or returns raw YAML text)
    expect: tuple[str, ...]  # substrings of the one stderr line; the first is the field path
    overrides: tuple[str, ...] = field(default=())
    # Most cases run `python -m verl_hpc` in a subprocess; a few call the same `main()` in
    # this process, because each subprocess pays ~1.5 s importing torch.
    in_subprocess: bool = True


def set_in(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def setting(**values: Any) -> Mutation:
    """A mutation setting dotted keys (spelled with `__` for `.`)."""

    def mutate(data: dict[str, Any], _: Path) -> None:
        for key, value in values.items():
            set_in(data, key.replace("__", "."), value)

    return mutate


def data_file(name: str, rows: list[dict[str, str]] | None = None, as_dir: bool = False) -> Mutation:
    """Replace the built-in task with one prompt file written (or not) into the case directory."""

    def mutate(data: dict[str, Any], where: Path) -> None:
        path = where / name
        if as_dir:
            path.mkdir()
        elif rows is not None:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data["data"] = {"train_files": [str(path)]}

    return mutate


def missing_model(data: dict[str, Any], where: Path) -> None:
    empty = where / "no-model"
    empty.mkdir()
    data["model"] = {"path": str(empty)}


def vllm_overlap(data: dict[str, Any], _: Path) -> None:
    data["resources"].update(
        placement="split",
        rollout={"device_type": "cuda", "device_ids": [0, 1], "strategy": "vllm",
                 "vllm_args": {"gpu_memory_utilization": 0.5}},
        reward={"device_type": "cuda", "device_ids": [1, 2], "strategy": "none"},
    )


def broken_yaml(data: dict[str, Any], _: Path) -> str:
    lines = yaml.safe_dump(data, sort_keys=False).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  init_preset:"))
    lines[at] += ": oops"  # `key: value: more` is a YAML syntax error on this line
    assert at + 1 == 3, "the broken line moved; update the expected line number below"
    return "\n".join(lines) + "\n"


PROMPT_ROWS = [{"prompt": "1+2=", "ground_truth": "3"}]
QUESTION_ROWS = [{"question": "1+2=", "ground_truth": "3"}]

BAD_CASES = [
    BadCase("unknown-top-level-key", setting(optimizer={"lr": 0.1}), ("optimizer:", "unknown key", "valid keys:")),
    BadCase("nested-key-typo", setting(trainer__total_step=5),
            ("trainer.total_step:", "unknown key", "did you mean 'total_steps'?")),
    BadCase("deep-key-typo", setting(algorithm__sampling__temprature=0.7),
            ("algorithm.sampling.temprature:", "did you mean 'temperature'?"), in_subprocess=False),
    BadCase("override-key-typo", setting(), ("trainer.totl_steps:", "did you mean 'total_steps'?"),
            overrides=("trainer.totl_steps=3",), in_subprocess=False),
    BadCase("string-for-int", setting(trainer__batch_size="many"), ("trainer.batch_size:", "valid integer", "'many'")),
    BadCase("zero-total-steps", setting(trainer__total_steps=0),
            ("trainer.total_steps:", "greater than or equal to 1", "(got 0)")),
    BadCase("negative-group-size", setting(algorithm__sampling__n=-1),
            ("algorithm.sampling.n:", "greater than or equal to 1", "(got -1)"), in_subprocess=False),
    BadCase("grpo-group-of-one", setting(algorithm__sampling__n=1), ("algorithm.sampling.n:", "at least 2"),
            in_subprocess=False),
    BadCase("batch-not-divisible-by-group", setting(trainer__batch_size=30),
            ("trainer.batch_size:", "not divisible", "algorithm.sampling.n=8", "multiple of 8")),
    BadCase("mini-not-divisible-by-micro", setting(algorithm__mini_batch_size=64, algorithm__micro_batch_size=24),
            ("algorithm.micro_batch_size:", "(64 sequences) is not divisible by 24"), in_subprocess=False),
    BadCase("rollout-strategy-fsdp", setting(resources__rollout__strategy="fsdp"),
            ("resources.rollout.strategy:", "'fsdp' is not valid for the rollout role", "hf, vllm")),
    BadCase("vllm-args-on-hf-role", setting(resources__actor__vllm_args={"gpu_memory_utilization": 0.5}),
            ("resources.actor.vllm_args:", "strategy: vllm", "strategy: hf"), in_subprocess=False),
    BadCase("vllm-gpu-shared-with-reward", vllm_overlap,
            ("resources.reward.device_ids:", "GPU(s) [1]", "vLLM rollout")),
    BadCase("model-dir-without-config", missing_model, ("model.path:", "no config.json", "init-model")),
    BadCase("data-file-missing", data_file("absent.parquet"),
            ("data.train_files[0]:", "absent.parquet does not exist or is not readable")),
    BadCase("data-file-unreadable", data_file("folder.jsonl", as_dir=True),
            ("data.train_files[0]:", "folder.jsonl does not exist or is not readable"), in_subprocess=False),
    BadCase("data-file-wrong-suffix", data_file("prompts.csv", rows=PROMPT_ROWS),
            ("data.train_files[0]:", "unsupported suffix", ".parquet, .jsonl, .json")),
    BadCase("data-file-no-prompt-column", data_file("questions.jsonl", rows=QUESTION_ROWS),
            ("data.prompt_key:", "column 'prompt' not in", "question")),
    BadCase("reward-module-unknown", setting(reward__function="no_such_reward_module_xyz:score"),
            ("reward.function:", "module 'no_such_reward_module_xyz' cannot be found")),
    BadCase("reward-function-missing", setting(reward__function="verl_hpc.data.tasks.arithmetic:nope"),
            ("reward.function:", "has no function 'nope'", "score"), in_subprocess=False),
    BadCase("reward-function-and-model", setting(reward__model_path="/nonexistent/rm"),
            ("reward:", "exactly one of reward.function", "reward.model_path"), in_subprocess=False),
    BadCase("bf16-on-cpu", setting(model__dtype="bfloat16"), ("model.dtype:", "float32"), in_subprocess=False),
    BadCase("invalid-yaml", broken_yaml, ("at line 3", "fix the YAML syntax")),
    BadCase("override-without-equals", setting(), ("trainer.total_steps:", "key.path=value"),
            overrides=("trainer.total_steps",)),
]


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def prepare(case: BadCase, case_dir: Path) -> tuple[list[str], Path]:
    """Write the case's config; returns the CLI arguments (after `verl-hpc`) and the run dir."""
    case_dir.mkdir(parents=True, exist_ok=True)
    data = quickstart()
    data["model"]["path"] = str(case_dir / "model")  # built only on use; init_preset: tiny stays
    data["logging"]["progress"] = "off"
    raw = case.mutate(data, case_dir)
    config = case_dir / "config.yaml"
    config.write_text(raw if isinstance(raw, str) else yaml.safe_dump(data, sort_keys=False))
    run_dir = case_dir / "run"
    # Overrides go between the config and the options, as a user types them.
    return ["train", str(config), *case.overrides, "--run-dir", str(run_dir)], run_dir


def run_module(args: list[str], cwd: Path) -> Outcome:
    proc = subprocess.run([sys.executable, "-m", "verl_hpc", *args], cwd=cwd, env=CLI_ENV, text=True,
                          capture_output=True, timeout=120)
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="module")
def subprocess_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Outcome, Path, set[Path]]]:
    """Every subprocess case, run concurrently; each keyed by id with its directory and its files."""
    root = tmp_path_factory.mktemp("bad-configs")
    cases = [c for c in BAD_CASES if c.in_subprocess]
    prepared = {c.id: prepare(c, root / c.id)[0] for c in cases}
    before = {c.id: set((root / c.id).rglob("*")) for c in cases}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {cid: pool.submit(run_module, args, root / cid) for cid, args in prepared.items()}
        return {cid: (future.result(), root / cid, before[cid]) for cid, future in futures.items()}


@pytest.mark.parametrize("case", BAD_CASES, ids=[c.id if c.in_subprocess else f"{c.id}-inprocess" for c in BAD_CASES])
def test_bad_config_fails_in_one_line(case: BadCase, request: pytest.FixtureRequest, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    if case.in_subprocess:
        outcome, case_dir, files_before = request.getfixturevalue("subprocess_outcomes")[case.id]
    else:
        from verl_hpc.cli.main import main

        case_dir = tmp_path / case.id
        args, _ = prepare(case, case_dir)
        files_before = set(case_dir.rglob("*"))
        monkeypatch.chdir(case_dir)
        code = main(args)
        captured = capsys.readouterr()
        outcome = Outcome(code, captured.out, captured.err)
    lines = outcome.stderr.splitlines()

    assert outcome.returncode == 2, f"exit {outcome.returncode}\nstdout:\n{outcome.stdout}\nstderr:\n{outcome.stderr}"
    assert "Traceback" not in outcome.stdout + outcome.stderr
    assert len(lines) == 1 and lines[0].strip(), f"expected one stderr line, got:\n{outcome.stderr}"
    line = lines[0]
    assert line.startswith(ERROR_PREFIX), line
    for text in case.expect:
        assert text in line, f"{text!r} not in {line!r}"
    assert outcome.stdout == ""
    # Nothing was created: no run directory, no model build, no prompt file, no default runs/.
    assert not (case_dir / "run").exists()
    assert set(case_dir.rglob("*")) == files_before


def test_bad_cases_are_distinct() -> None:
    assert sum(c.in_subprocess for c in BAD_CASES) >= 12
    assert len({c.id for c in BAD_CASES}) == len(BAD_CASES)


def test_missing_config_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from verl_hpc.cli.main import main

    monkeypatch.chdir(tmp_path)
    code = main(["train", str(tmp_path / "nope.yaml"), "--run-dir", str(tmp_path / "run")])

    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.splitlines() == [f"{ERROR_PREFIX}config file {tmp_path / 'nope.yaml'} does not exist "
                                         "(hint: check the path)"]
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_error_with_line_breaks_in_a_value_stays_one_line() -> None:
    data = quickstart()
    data["data"] = {"train_files": ["first\nsecond.txt"]}
    data["checkpoint"] = {"resume": "never"}

    with pytest.raises(ConfigError) as info:
        load_config(data=data)

    line = info.value.one_line()
    assert line.splitlines() == [line]
    assert line.startswith("data.train_files[0]: first\\nsecond.txt has an unsupported suffix")


# ---------------------------------------------------------------------------------------------
# 3. load_config / dump_config (overrides: tests/config/test_config_overrides.py; resources: test_config_resources.py).
# ---------------------------------------------------------------------------------------------


def test_quickstart_loads_from_data_with_whole_groups() -> None:
    cfg = load_config(data=quickstart())

    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.batch_size % cfg.algorithm.sampling.n == 0
    assert (cfg.trainer.batch_size, cfg.algorithm.sampling.n) == (128, 8)
    assert cfg.model.init_preset == "tiny"
    assert cfg.reward.function == "verl_hpc.data.tasks.arithmetic:score"
    assert cfg == load_config(QUICKSTART)


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(data=quickstart())

    text = dump_config(cfg)
    again = load_config(data=yaml.safe_load(text))
    (tmp_path / "dumped.yaml").write_text(text)
    from_file = load_config(tmp_path / "dumped.yaml")

    assert again == cfg
    assert from_file == cfg
    assert dump_config(again) == text
    assert "async:" in text and "async_save" not in text  # aliases are dumped as users write them


def leaf_paths(node: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaf_paths(value, (*prefix, key))
    else:
        yield prefix


# Every leaf of the quickstart as loaded, defaults included (dumped with the YAML aliases).
QUICKSTART_FULL = yaml.safe_load(dump_config(load_config(data=quickstart())))
LEAVES = sorted(leaf_paths(QUICKSTART_FULL))
SECTIONS = set(RunConfig.model_fields)
# No ':' in garbage text: a random `module:function` must never import a real module.
TEXT = st.text(st.characters(blacklist_characters=":", blacklist_categories=("Cs",)), max_size=12)
SCALARS = st.one_of(st.integers(), st.integers(max_value=-1), st.integers(-3, 3), TEXT, st.none(), st.booleans(),
                    st.floats(allow_nan=True, allow_infinity=True))
GARBAGE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)


def test_leaves_cover_every_section() -> None:
    assert {path[0] for path in LEAVES} == SECTIONS
    assert ("trainer", "total_steps") in LEAVES and ("algorithm", "sampling", "n") in LEAVES


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(LEAVES), GARBAGE), min_size=1, max_size=3))
def test_garbage_values_fail_as_one_line_config_errors(edits: list[tuple[tuple[str, ...], Any]]) -> None:
    data = copy.deepcopy(QUICKSTART_FULL)
    for path, value in edits:
        set_in(data, ".".join(path), value)

    try:
        cfg = load_config(data=data)
    except ConfigError as err:
        line = err.one_line()
        assert line.splitlines() == [line], line
        root = re.split(r"[.\[]", err.path)[0]
        assert root in SECTIONS, f"error path {err.path!r} does not start at a config section: {line}"
        if err.path.splitlines() == [err.path]:  # a garbage key with a line break is shown escaped
            assert line.startswith(f"{err.path}: "), line
        else:
            assert line.startswith(f"{root}."), line
    else:
        assert isinstance(cfg, RunConfig)
