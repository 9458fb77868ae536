"""The memory plan under a real limit: a process whose address space is capped (RLIMIT_AS, as
`ulimit -v` or a batch system sets it) dies with today's switches and trains under
`model.memory_plan: auto`, running exactly the switches its plan printed."""

from __future__ import annotations

import json
import os
import random
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

GIB = 1 << 30
# A tiny model with long prompts (worked examples before the question) and the whole batch in one
# forward: its update keeps ~1 GiB of activations, and fewer rows per forward (or recomputed
# layers) is what brings it down. Long prompts, not long responses: a prompt costs one forward,
# a response one forward per token, so the step is seconds.
PROMPT_TOKENS, ROWS = 200, 256
SHAPE = [f"data.max_prompt_length={PROMPT_TOKENS}", "algorithm.sampling.max_new_tokens=8",
         f"trainer.batch_size={ROWS}", "algorithm.sampling.n=4", "trainer.total_steps=1", "trainer.torch_threads=2", "trainer.save_hf_model=false",
         "checkpoint.interval_steps=100", "logging.progress=off"]


def _long_prompts(path: Path, count: int = ROWS // 4) -> Path:
    """Addition questions, each after 30 worked examples (~185 tokens of the tiny tokenizer)."""
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        shown = " ".join(f"{a}+{b}={a + b}" for a, b in ((rng.randint(0, 4), rng.randint(0, 4)) for _ in range(30)))
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        rows.append({"prompt": f"{shown} {a}+{b}=", "ground_truth": str(a + b)})
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)  # Parquet, as the built-in task writes its prompts
    return path


def _baseline_vms() -> int:
    """The address space of a process that has imported what a trainer imports (torch, transformers)."""
    code = ("import psutil, verl_hpc.runtime.embedded, verl_hpc.launch.train; "
            "print(psutil.Process().memory_info().vms)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), text=True, capture_output=True,
                         check=True, timeout=600)
    return int(out.stdout.strip())


def _env() -> dict[str, str]:
    # Address space is what RLIMIT_AS counts, and two allocators reserve it far ahead of use: glibc
    # keeps one 64 MB arena per thread, and pyarrow's default pool (jemalloc) maps 1 GiB once a
    # Parquet file is read. A job under `ulimit -v` caps both, as here.
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2",
            "ARROW_DEFAULT_MEMORY_POOL": "system"}


def _train(run_dir: Path, model: Path, data: Path, limit: int, *overrides: str) -> subprocess.CompletedProcess:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-m", "verl_hpc", "train", str(REPO / "configs" / "quickstart.yaml"),
                           "--run-dir", str(run_dir), f"model.path={model}", f"data.train_files=[{data}]",
                           "data.task=null", *SHAPE, *overrides],
                          cwd=REPO, env=_env(), text=True, capture_output=True, timeout=1800, preexec_fn=cap)


@pytest.mark.slow
def test_a_run_that_dies_under_a_memory_limit_trains_under_the_plan(tmp_path: Path) -> None:
    from verl_hpc.models.tiny import init_model

    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    data = _long_prompts(tmp_path / "prompts.parquet")
    limit = _baseline_vms() + int(1.1 * GIB)
    off = _train(tmp_path / "off", model, data, limit, "model.memory_plan=off")
    assert off.returncode != 0, "without the plan this config must run out of memory under the limit"
    assert "can't allocate memory" in off.stderr or "MemoryError" in off.stderr, off.stderr[-2000:]

    auto = _train(tmp_path / "auto", model, data, limit)
    assert auto.returncode == 0, auto.stderr[-3000:]
    log = [json.loads(line)["msg"] for line in (tmp_path / "auto" / "logs" / "trainer_rank0.log").read_text()
           .splitlines()]
    header = next(m for m in log if m.startswith("memory plan"))
    assert "RLIMIT_AS" in header and "fits" in header
    actor = next(m for m in log if m.startswith("  actor:"))
    printed = dict(re.findall(r"(\w+)=(\w+) \(auto", actor))  # what the plan says it switched on
    assert printed, actor
    rows = [json.loads(line) for line in (tmp_path / "auto" / "tensorboard" / "metrics.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 1
    ran = {"gradient_checkpointing": rows[-1]["memory/switch/gradient_checkpointing"] == 1.0,
           "remove_padding": rows[-1]["memory/switch/remove_padding"] == 1.0,
           "micro_batch_size": int(rows[-1]["memory/switch/micro_batch_size"]),
           "use_dynamic_bsz": rows[-1]["memory/switch/token_budget"] > 0,
           "logprob_chunk_tokens": int(rows[-1]["memory/switch/logprob_chunk_tokens"])}
    for name, value in printed.items():
        expected = int(value) if value.isdigit() else value == "true"
        assert ran[name] == expected, (name, printed, ran)
    assert rows[-1]["memory/step_peak_gb"] * GIB < limit
