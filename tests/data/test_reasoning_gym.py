"""reasoning-gym as a prompt source: generated from the config, scored by the library's own checker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.data.tasks import reasoning_gym as rg

pytest.importorskip("reasoning_gym", reason="reasoning-gym is in the test extra: tools/test.sh installs it")
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "reasoning_gym.yaml"
MIX = [("basic_arithmetic", 1.0, {}), ("leg_counting", 1.0, {})]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_same_seed_writes_the_same_prompts_and_a_mix_holds_every_task(tmp_path: Path) -> None:
    first = read(rg.write_prompts(tmp_path / "a.jsonl", MIX, 16, seed=3))
    assert first == read(rg.write_prompts(tmp_path / "b.jsonl", MIX, 16, seed=3))
    assert first != read(rg.write_prompts(tmp_path / "c.jsonl", MIX, 16, seed=4))
    assert {r["data_source"] for r in first} == {"reasoning_gym/basic_arithmetic", "reasoning_gym/leg_counting"}
    system = rg.system_prompts()["default"]
    assert first[0]["prompt"][0] == {"role": "system", "content": system}
    text = read(rg.write_prompts(tmp_path / "t.jsonl", MIX, 2, seed=3, system_prompt=None, chat=False))
    assert text[0]["prompt"] == json.loads(text[0]["extra_info"])["question"]


def test_scores_are_the_library_s_own(tmp_path: Path) -> None:
    """Tagged, bare and wrong answers score exactly as reasoning-gym's score_answer scores them."""
    import reasoning_gym

    for row in read(rg.write_prompts(tmp_path / "p.jsonl", MIX, 8, seed=0)):
        entry = json.loads(row["extra_info"])
        check = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
        batch_info = json.dumps(row["extra_info"])  # what the reward gets: the batch holds JSON of the file's text
        for response, answer in ((f"<think>hm</think><answer>{entry['answer']}</answer>", entry["answer"]),
                                 (f" {entry['answer']}\n", entry["answer"]), ("<answer>no</answer>", "no")):
            got = rg.compute_score(row["data_source"], response, row["ground_truth"], json.loads(batch_info))
            assert got == check(answer, entry), (response, entry)
        assert rg.compute_score(row["data_source"], f"<answer>{entry['answer']}</answer>", row["ground_truth"]) == 1.0


@pytest.mark.parametrize(("override", "field"), [
    ("data.reasoning_gym.tasks=[no_such_task]", "data.reasoning_gym.tasks[0]"),
    ("data.reasoning_gym.tasks=[{name: basic_arithmetic, config: {min_terms: 0, max_terms: -1}}]",
     "data.reasoning_gym.tasks[0].config"),
    ("data.reasoning_gym.system_prompt=chatty", "data.reasoning_gym.system_prompt"),
])
def test_a_bad_task_is_refused_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [override])
    assert err.value.path == field and err.value.hint


@pytest.mark.slow
def test_a_reasoning_gym_task_trains_from_the_config_alone(tmp_path: Path, tiny_model_dir: Path) -> None:
    from verl_hpc.launch.train import train
    from verl_hpc.metrics import read_jsonl_metrics

    cfg = load_config(CONFIG, [f"model.path={tiny_model_dir}", "model.init_preset=null", "trainer.total_steps=2",
                               "trainer.batch_size=16", "data.reasoning_gym.size=32", "logging.progress=off",
                               "trainer.save_hf_model=false"])
    result = train(cfg, tmp_path / "run")
    assert result.stopped_by is None and result.steps == 2
    rows = read_jsonl_metrics(tmp_path / "run" / "tensorboard" / "metrics.jsonl")
    assert len(rows) == 2 and all(0.0 <= r["critic/score/mean"] <= 1.0 for r in rows)
    prompts = read(tmp_path / "run" / "data" / "reasoning_gym_prompts.jsonl")
    assert len(prompts) == 32 and {p["data_source"] for p in prompts} == {"reasoning_gym/basic_arithmetic"}
