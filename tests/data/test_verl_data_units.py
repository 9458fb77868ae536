"""verl's data layout in one process: dataset shapes, truncation, the reward pool."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from verl_hpc.data.prompts import PromptDataset
from verl_hpc.data.records import RowError, fit_lengths
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.reward import RuleReward


def test_hf_datasets_directory_is_read_without_datasets(tmp_path: Path) -> None:
    """`save_to_disk` layout: Arrow IPC streams listed in state.json, a DatasetDict per split."""
    split = tmp_path / "ds" / "train"
    split.mkdir(parents=True)
    for k, rows in enumerate([[{"prompt": "1+1=", "ground_truth": "2"}], [{"prompt": "2+2=", "ground_truth": "4"}]]):
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(str(split / f"data-0000{k}-of-00002.arrow"), table.schema) as writer:
            writer.write_table(table)
    (split / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"},
                                                                  {"filename": "data-00001-of-00002.arrow"}]}))
    (tmp_path / "ds" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    ds = PromptDataset([tmp_path / "ds"])
    assert ds.prompts == ["1+1=", "2+2="] and ds.answers == ["2", "4"]


def test_chat_jsonl_with_messages_takes_the_last_reply_as_answer(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"},
                          {"role": "assistant", "content": "2"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PromptDataset([path])
    assert ds.prompts == [rows[0]["messages"][:2]] and ds.answers == ["2"]
    assert ds.data_sources == [None] and ds.extra_infos == [None]


def test_nested_answer_and_extra_info_by_default(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "prompt": [{"role": "user", "content": "q"}],
                                          "reward_model": {"ground_truth": "7"}, "extra_info": {"index": 3}}]), path)
    ds = PromptDataset([path], require_answer=True)
    assert ds.answers == ["7"] and ds.data_sources == ["x"] and json.loads(ds.extra_infos[0]) == {"index": 3}


def test_earlier_tool_calls_in_a_prompt_survive_parquet_and_render(tmp_path: Path) -> None:
    """A prompt that shows worked calculator calls keeps them (Parquet fills missing keys with
    nulls, which are dropped), and the hermes template renders each call as written."""
    from transformers import AutoTokenizer

    from tests.conftest import REPO, load_module
    from verl_hpc.models.tiny import init_model

    path = load_module(REPO / "examples" / "gsm8k" / "make_data.py").write(tmp_path / "g", count=2, tool_shots=2)
    prompt = PromptDataset([path]).prompts[0]
    assert [m["role"] for m in prompt] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    call = prompt[1]["tool_calls"][0]["function"]
    assert call["name"] == "calculator" and set(call["arguments"]) == {"expression"}
    assert all(set(m) == {"role", "content"} for m in prompt if "tool_calls" not in m)  # no null keys added
    assert all(m["role"] == "assistant" and m["content"] == "" for m in prompt if "tool_calls" in m)
    tokenizer = AutoTokenizer.from_pretrained(init_model(tmp_path / "m", preset="tiny-agent"))
    text = tokenizer.apply_chat_template(prompt, chat_template=(REPO / "configs" / "hermes_chatml.jinja").read_text(),
                                         tokenize=False, add_generation_prompt=True)
    assert text.count('{"name": "calculator", "arguments": {"expression": ') == 2


def test_worked_calculator_calls_are_one_step_problems_and_two_steps_are_refused(tmp_path: Path) -> None:
    """The worked examples are one calculator call each: `--tool-shots` writes one-step problems
    and refuses `--steps 2` by name instead of quietly writing one-step ones."""
    import subprocess
    import sys

    from tests.conftest import REPO, load_module

    script = REPO / "examples" / "gsm8k" / "make_data.py"
    rows = load_module(script).rows(2, tool_shots=1)
    assert all(row["extra_info"]["answer"].count("=") == 1 for row in rows)  # one step: `a + b = c. #### c`
    with pytest.raises(ValueError, match="--tool-shots writes one-step problems"):
        load_module(script).rows(2, steps=2, tool_shots=1)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), "--tool-shots", "2", "--steps", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "use --steps 1 or leave --steps out" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_a_message_without_content_needs_tool_calls(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+3?"},
                                           {"role": "assistant", "content": None}], "ground_truth": "5"}) + "\n")
    with pytest.raises(RowError, match="message 1 .* not \\{role, content\\} strings"):
        PromptDataset([path])


def test_truncation_sides() -> None:
    ids = [[1, 2, 3, 4], [5]]
    assert fit_lengths(ids, 2, "left", ["a", "b"], "f") == [[3, 4], [5]]
    assert fit_lengths(ids, 2, "right", ["a", "b"], "f") == [[1, 2], [5]]
    with pytest.raises(ValueError, match="a: 4 prompt tokens"):
        fit_lengths(ids, 2, "error", ["a", "b"], "f")


def test_old_ipc_batches_without_the_new_columns_still_load() -> None:
    batch = RolloutBatch.from_generation([[1, 2]], [[3]], None, [0], [0], ["2"], policy_version=0)
    old = batch.record_batch.drop_columns(["data_source", "extra_info"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old.schema) as writer:
        writer.write_batch(old)
    loaded = RolloutBatch.from_ipc(sink.getvalue().to_pybytes())
    assert loaded.column("data_source").null_count == 1 and loaded.column("ground_truth").to_pylist() == ["2"]


class _Tok:
    eos_token_id = 0

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def _batch(n: int) -> RolloutBatch:
    return RolloutBatch.from_generation([[1]] * n, [[i + 1] for i in range(n)], None, list(range(n)),
                                        list(range(n)), ["1"] * n, policy_version=0,
                                        data_source=["d"] * n, extra_info=[json.dumps({"i": i}) for i in range(n)])


def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "acc": 1.0}


def test_verl_signature_and_dict_return_in_process() -> None:
    reward = RuleReward(verl_dict, _Tok())
    assert reward.verl
    assert reward.score(_batch(3)).tolist() == [1.0, 0.0, 0.0]
    assert reward.metrics()["reward/extra/acc"] == 1.0


SLOW_REWARD = '''import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "2":
        time.sleep(60)
    return {"score": float(solution_str == ground_truth), "seen": float(extra_info["i"])}
'''


@pytest.mark.slow
def test_reward_pool_times_out_one_call_and_keeps_the_rest(tmp_path: Path) -> None:
    from verl_hpc.config.user_code import resolve_function

    path = tmp_path / "slow_score.py"
    path.write_text(SLOW_REWARD)
    path.chmod(0o644)
    spec = f"{path}:compute_score"
    reward = RuleReward(resolve_function(spec, "reward"), _Tok(), spec=spec, num_workers=2, timeout=3.0)
    try:
        scores = reward.score(_batch(4))
        assert scores.tolist() == [1.0, 0.0, 0.0, 0.0]  # row 1 ("2") timed out: 0
        metrics = reward.metrics()
        assert metrics["reward/timeouts"] == 1.0 and metrics["reward/errors"] == 0.0
        assert metrics["reward/extra/seen"] == pytest.approx((0 + 2 + 3) / 3)
        assert reward.score(_batch(1)).tolist() == [1.0]  # the replaced worker serves the next batch
    finally:
        reward.close()
