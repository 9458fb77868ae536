"""Bad input, generated: every bad config or override is one line naming the field, exit 2,
never a traceback and never a started job; malformed Arrow batches and data files are refused
with the column named.

Why in-process: `main()` is the CLI; calling it here spares a torch import per example, so
hundreds of generated inputs cost seconds. tests/config/test_config.py runs hand-written cases through
real subprocesses, and the last test here sends a few generated ones through one too.
"""

from __future__ import annotations

import contextlib
import io
import json
import string
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO
from verl_hpc.cli.main import main
from verl_hpc.config import dump_config, load_config
from verl_hpc.data.rollout_batch import SCHEMA, TOKEN_FLOAT_COLUMNS, RolloutBatch, SchemaError, validate

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
FULL = yaml.safe_load(dump_config(load_config(QUICKSTART)))
SETTINGS = settings(max_examples=70, deadline=None, suppress_health_check=list(HealthCheck))
TRIED = {"configs": 0, "batches": 0}


def _sections(node: Any, prefix: str = "") -> list[tuple[str, dict]]:
    found = []
    for key, value in node.items():
        if isinstance(value, dict):
            found += [(f"{prefix}{key}", value), *_sections(value, f"{prefix}{key}.")]
    return found


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    found = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        found += _leaves(value, path + ".") if isinstance(value, dict) else [(path, value)]
    return found


# Variables the user names freely (`resources.comm_env`, `slurm.container.env`) are maps, not sections.
FREE_MAPS = ("resources.comm_env", "slurm.container.env")
SECTIONS = [(path, node) for path, node in _sections(FULL) if path not in FREE_MAPS]
INT_LEAVES = [p for p, v in _leaves(FULL) if isinstance(v, int) and not isinstance(v, bool)]
POSITIVE = ["trainer.total_steps", "trainer.batch_size", "algorithm.sampling.n", "algorithm.sampling.max_new_tokens",
            "checkpoint.keep_last", "resources.timeout_seconds"]
NAME = st.text(string.ascii_lowercase + "_", min_size=3, max_size=12)
WORD = st.text(string.ascii_letters, min_size=1, max_size=10).map(lambda s: "x_" + s)  # never a number or YAML bool


def run_main(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    """The CLI in this process: (exit code, stderr); a started job fails the test."""
    err = io.StringIO()
    run_dir = tmp_path / "never"
    started = AssertionError("a job was started for bad input")
    with mock.patch("verl_hpc.launch.train.train", side_effect=started), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["train", QUICKSTART, *overrides, "--run-dir", str(run_dir)])
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    assert not run_dir.exists()
    TRIED["configs"] += 1
    return code, err.getvalue()


def assert_one_line_error(code: int, stderr: str, field: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("verl-hpc: error: "), lines[0]
    assert field in lines[0], (field, lines[0])


@SETTINGS
@given(section=st.sampled_from(SECTIONS), key=NAME, value=st.one_of(st.integers(), WORD))
def test_unknown_keys_are_named(tmp_path_factory: pytest.TempPathFactory, section: tuple[str, dict], key: str,
                                value: Any) -> None:
    path, node = section
    if key in node:
        key += "_typo"
    code, stderr = run_main(tmp_path_factory.mktemp("k"), f"{path}.{key}={value}")
    assert_one_line_error(code, stderr, f"{path}.{key}")


@SETTINGS
@given(leaf=st.sampled_from(INT_LEAVES), value=st.one_of(WORD, st.lists(st.integers(), min_size=1, max_size=3)))
def test_wrong_types_are_named(tmp_path_factory: pytest.TempPathFactory, leaf: str, value: Any) -> None:
    code, stderr = run_main(tmp_path_factory.mktemp("t"), f"{leaf}={json.dumps(value) if isinstance(value, list) else value}")
    assert_one_line_error(code, stderr, leaf)


@SETTINGS
@given(leaf=st.sampled_from(POSITIVE), value=st.integers(max_value=0))
def test_out_of_range_counts_are_named(tmp_path_factory: pytest.TempPathFactory, leaf: str, value: int) -> None:
    code, stderr = run_main(tmp_path_factory.mktemp("r"), f"{leaf}={value}")
    assert_one_line_error(code, stderr, leaf)


# Override syntax itself: no '=', empty paths, unbalanced YAML, a value used as a section. (No leading '-': that is an option.)
BROKEN = st.one_of(
    NAME.map(lambda s: f"trainer.{s}"),                                  # no '='
    NAME.map(lambda s: f"={s}"),                                         # empty key
    NAME.map(lambda s: f"trainer..{s}=1"),                               # empty path segment
    WORD.map(lambda s: f"trainer.total_steps=[{s}"),                     # unbalanced YAML flow
    WORD.map(lambda s: f"trainer.total_steps.{s}=1"),                    # a value is not a section
)


@SETTINGS
@given(override=BROKEN)
def test_malformed_overrides_are_one_line(tmp_path_factory: pytest.TempPathFactory, override: str) -> None:
    code, stderr = run_main(tmp_path_factory.mktemp("o"), override)
    assert_one_line_error(code, stderr, "")


def _valid_columns(rows: int = 3) -> dict[str, pa.Array]:
    batch = RolloutBatch.from_generation(
        prompt_ids=[[1, 2]] * rows, response_ids=[[3, 4, 5]] * rows, rollout_logprobs=[[-0.5] * 3] * rows,
        group_ids=[0] * rows, prompt_index=list(range(rows)), ground_truth=["7"] * rows, policy_version=1)
    return {name: batch.record_batch.column(name) for name in batch.record_batch.schema.names}


WRONG_TYPES = {"int64": pa.int32(), "list<item: int32>": pa.list_(pa.int64()), "float": pa.float64(),
               "string": pa.large_string(), "list<item: float>": pa.list_(pa.float64())}


@settings(max_examples=60, deadline=None)
@given(column=st.sampled_from([f.name for f in SCHEMA]), how=st.sampled_from(["drop", "retype", "nulls", "lengths"]))
def test_malformed_arrow_batches_name_the_column(column: str, how: str) -> None:
    columns = _valid_columns()
    field = SCHEMA.field(column)
    if how == "drop":
        del columns[column]
    elif how == "retype":
        columns[column] = pa.nulls(3, WRONG_TYPES[str(field.type)])
    elif how == "nulls" and not field.nullable:
        columns[column] = pa.array([columns[column][0].as_py(), None, columns[column][2].as_py()], field.type)
    elif how == "lengths" and column in TOKEN_FLOAT_COLUMNS:
        columns[column] = pa.array([[0.5], [0.5], [0.5]], field.type)
    else:
        return  # that damage does not apply to this column (nullable, or not per-token)
    TRIED["batches"] += 1
    with pytest.raises(SchemaError, match=repr(column)):
        validate(pa.RecordBatch.from_pydict(columns))


@pytest.mark.parametrize("kind", ["missing", "wrong type", "not a parquet file"])
def test_wrong_schema_data_files_name_the_column(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "prompts.parquet"
    if kind == "missing":
        pq.write_table(pa.table({"question": ["1+1="], "ground_truth": ["2"]}), path)
        expected = "data.prompt_key: column 'prompt' not in"
    elif kind == "wrong type":
        pq.write_table(pa.table({"prompt": [[1, 2]], "ground_truth": ["2"]}), path)
        expected = "data.prompt_key: column 'prompt' of"
    else:
        path.write_bytes(b"PAR1 this is not parquet")
        expected = "data.train_files[0]: "
    code, stderr = run_main(tmp_path, f"data.train_files=[{path}]", "~data.task")
    assert_one_line_error(code, stderr, expected)


def test_a_few_generated_inputs_through_the_real_cli(tmp_path: Path) -> None:
    """The same promise from a shell: a separate process, exit 2, one line, nothing created."""
    bad = ["trainer.total_stepz=5", "algorithm.sampling.n=x_many", "trainer.batch_size=-8", "trainer..seed=1"]
    procs = [subprocess.Popen([sys.executable, "-m", "verl_hpc", "train", QUICKSTART, override, "--run-dir",
                               str(tmp_path / f"run{i}")], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for i, override in enumerate(bad)]
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert_one_line_error(proc.returncode, stderr, "")
    assert not any(tmp_path.iterdir())


def test_at_least_200_bad_inputs_were_tried() -> None:
    """The module's generated inputs, counted (meaningful when the whole module runs)."""
    if TRIED["configs"] == 0:
        pytest.skip("run the whole module to count")
    print(f"bad inputs tried: {TRIED['configs']} configs/overrides, {TRIED['batches']} Arrow batches")
    assert TRIED["configs"] >= 200, TRIED
    assert TRIED["batches"] >= 20, TRIED
