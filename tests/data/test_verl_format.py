"""verl's dataset layout and reward functions as is, through the CLI.

A verl user's Parquet (chat `prompt`, nested `reward_model`, `data_source`, `extra_info`) and
`compute_score(data_source, solution_str, ground_truth, extra_info=None)` train with no
conversion step; malformed rows fail in one line naming file, row and column, before any
generation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import run_cli
from verl_hpc.data.rollout_batch import RolloutBatch

QUESTIONS = [(f"{a}+{b}", str(a + b)) for a in range(3) for b in range(3)]

REWARD_FILE = '''import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    seen = dict(locals())
    with open(os.environ["VERL_FORMAT_LOG"], "a") as f:
        f.write(json.dumps(seen) + "\\n")
    right = solution_str.strip().startswith(ground_truth)
    return {RETURN}
'''


def verl_rows(questions=QUESTIONS) -> list[dict]:
    """Rows the way verl's examples/data_preprocess/gsm8k.py lays them out."""
    return [{"data_source": "test/arith", "prompt": [{"role": "user", "content": f"what is {q}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": i, "answer": a, "question": q}}
            for i, (q, a) in enumerate(questions)]


def write_config(tmp_path: Path, model_dir: Path, data: Path, reward: Path, **data_extra) -> Path:
    cfg = {"model": {"path": str(model_dir)},
           "data": {"train_files": [str(data)], "max_prompt_length": 32, **data_extra},
           "reward": {"custom_reward_function": {"path": str(reward), "name": "compute_score"}},
           "algorithm": {"name": "grpo", "sampling": {"n": 4, "max_new_tokens": 3}},
           "trainer": {"total_steps": 2, "batch_size": 8, "seed": 0},
           "resources": {"actor": {"device_type": "cpu", "device_ids": [0], "strategy": "hf"},
                         "rollout": {"device_type": "cpu", "device_ids": [0], "strategy": "hf"}},
           "logging": {"progress": "lines"}}
    cfg["data"]["record_rollouts"] = True  # the prompt ids the engine was given, kept for the test
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def reward_file(tmp_path: Path, returns: str) -> Path:
    path = tmp_path / "my_score.py"
    path.write_text(REWARD_FILE.replace("{RETURN}", returns))
    path.chmod(0o644)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("returns", ["float(right)", '{"score": float(right), "acc": float(right), "pred": "x"}'])
def test_verl_parquet_and_compute_score_train_through_the_cli(tmp_path: Path, tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch, returns: str) -> None:
    from transformers import AutoTokenizer

    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), data)
    log = tmp_path / "seen.jsonl"
    monkeypatch.setenv("VERL_FORMAT_LOG", str(log))
    run_dir = tmp_path / "run"
    proc = run_cli("train", str(write_config(tmp_path, tiny_model_dir, data, reward_file(tmp_path, returns))),
                   "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]

    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 2 * 8
    by_question = {r["extra_info"]["question"]: r for r in verl_rows()}
    for call in seen:  # exactly verl's four arguments, with the dataset's values
        assert sorted(call) == ["data_source", "extra_info", "ground_truth", "solution_str"]
        row = by_question[call["extra_info"]["question"]]
        assert call["data_source"] == "test/arith"
        assert call["ground_truth"] == row["reward_model"]["ground_truth"]
        assert call["extra_info"] == row["extra_info"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = {}
    for row in verl_rows():
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        expected[row["extra_info"]["question"]] = tokenizer(text, add_special_tokens=False)["input_ids"]
    recorded = RolloutBatch.concat([RolloutBatch.from_ipc(p.read_bytes())
                                    for p in sorted((run_dir / "rollouts").glob("*.arrow"))])
    infos = [json.loads(e) for e in recorded.column("extra_info").to_pylist()]
    for ids, info in zip(recorded.column("prompt_ids").to_pylist(), infos, strict=True):
        assert ids == expected[info["question"]]  # the ids the engine was given: the chat template's
        assert tokenizer.eos_token_id in ids  # the template's end-of-message marker, not in the content
    assert set(recorded.column("data_source").to_pylist()) == {"test/arith"}

    metrics = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    if returns.startswith("{"):
        assert all(0.0 <= m["reward/extra/acc"] <= 1.0 for m in metrics)
        assert all(m["reward/extra/acc"] == pytest.approx(m["critic/score/mean"]) for m in metrics)
        assert not any("reward/extra/pred" in m for m in metrics)  # text extras are no metric


def _set(row: int, key: str, value):
    def edit(rows: list[dict]) -> list[dict]:
        rows[row][key] = value
        return rows
    return edit


MALFORMED = {
    "missing ground truth": (_set(2, "reward_model", {"style": "rule", "ground_truth": None}), {},
                             ("row 2", "'reward_model.ground_truth'", "ground truth is missing")),
    "empty prompt": (_set(1, "prompt", [{"role": "user", "content": "  "}]), {}, ("row 1", "'prompt'", "empty")),
    "non-list messages": (_set(3, "prompt", {"role": "user", "content": "1+1"}), {},
                          ("row 3", "'prompt'", "holds dict")),
    "over-long prompt": (_set(4, "prompt", [{"role": "user", "content": "what is 1+2 " * 20}]), {},
                         ("row 4", "'prompt'", "more than data.max_prompt_length=32", "truncation")),
    "answer key names no column": (None, {"answer_key": "reward_model.answer"},
                                   ("data.answer_key:", "'reward_model.answer' names no column", "train.jsonl")),
    "prompt key names no column": (None, {"prompt_key": "question"}, ("data.prompt_key:", "'question' not in")),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_rows_fail_in_one_line_before_any_generation(tmp_path: Path, tiny_model_dir: Path,
                                                               capsys: pytest.CaptureFixture, case: str) -> None:
    from verl_hpc.cli.main import main

    edit, data_extra, expected = MALFORMED[case]
    rows = verl_rows()
    rows = edit(rows) if edit else rows
    data = tmp_path / "train.jsonl"  # JSONL: any row may differ in shape, as a user's file does
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = write_config(tmp_path, tiny_model_dir, data, reward_file(tmp_path, "1.0"), **data_extra)
    run_dir = tmp_path / "run"
    code = main(["train", str(config), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("verl-hpc: error:")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert str(data) in lines[0] and all(part in lines[0] for part in expected), lines[0]
    assert not (run_dir / "rollouts").exists()  # nothing was generated
    assert not (run_dir / "tensorboard" / "metrics.jsonl").exists()
