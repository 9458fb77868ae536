"""Tests for prompt datasets, the resumable sampler, the arithmetic task and the tiny model builder."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_hpc.data import PromptDataset, PromptSampler
from verl_hpc.data.prompts import read_columns
from verl_hpc.data.tasks import arithmetic, write_task_prompts
from verl_hpc.models.tiny import EOS_TOKEN, PAD_TOKEN, build_tokenizer, init_model

PROMPTS = ["1+2=", "what is 3+4=", "9+9=", "the sum of 5 and 6"]
ANSWERS = ["3", "7", "18", "11"]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- PromptDataset ---------------------------------------------------------------------------


def test_dataset_parquet_and_jsonl_agree(tmp_path):
    rows = [{"prompt": p, "ground_truth": a} for p, a in zip(PROMPTS, ANSWERS, strict=True)]
    # JSONL answers written as numbers: the dataset still hands out strings.
    json_rows = [{"prompt": p, "ground_truth": int(a)} for p, a in zip(PROMPTS, ANSWERS, strict=True)]
    from_parquet = PromptDataset([write_parquet(tmp_path / "p.parquet", rows)])
    from_jsonl = PromptDataset([write_jsonl(tmp_path / "p.jsonl", json_rows)])
    assert from_parquet.prompts == PROMPTS
    assert from_parquet.answers == ANSWERS
    assert from_jsonl.prompts == PROMPTS
    assert from_jsonl.answers == ANSWERS
    assert len(from_parquet) == len(from_jsonl) == 4
    assert read_columns(tmp_path / "p.parquet") == ["prompt", "ground_truth"]
    assert read_columns(tmp_path / "p.jsonl") == ["prompt", "ground_truth"]


def test_dataset_concatenates_files_and_custom_keys(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", [{"q": "1+1=", "ans": "2"}, {"q": "2+2=", "ans": "4"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"q": "3+3="}])  # no answer column
    ds = PromptDataset([a, b], prompt_key="q", answer_key="ans")
    assert ds.prompts == ["1+1=", "2+2=", "3+3="]
    assert ds.answers == ["2", "4", None]


def test_dataset_missing_prompt_column(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", [{"text": "1+1=", "ground_truth": "2"}])
    with pytest.raises(ValueError, match="'prompt'"):
        PromptDataset([path])
    jpath = write_jsonl(tmp_path / "x.jsonl", [{"text": "1+1="}])
    with pytest.raises(ValueError, match="'question'"):
        PromptDataset([jpath], prompt_key="question")


def test_dataset_unsupported_suffix(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("prompt\n1+1=\n")
    with pytest.raises(ValueError, match="unsupported"):
        PromptDataset([path])


# --- PromptSampler ---------------------------------------------------------------------------


def draw(sampler: PromptSampler, calls: int) -> list[int]:
    return [i for _ in range(calls) for i in sampler.next_indices()]


@pytest.mark.parametrize("size,batch", [(10, 5), (10, 4), (7, 3), (5, 8)])
def test_sampler_each_prompt_once_per_epoch(size, batch):
    sampler = PromptSampler(size, batch, seed=3)
    epochs = 3
    calls = -(-epochs * size // batch)
    drawn = draw(sampler, calls)
    assert len(drawn) == calls * batch
    for e in range(epochs):
        assert sorted(drawn[e * size:(e + 1) * size]) == list(range(size))


def test_sampler_shuffles_per_epoch_and_is_deterministic():
    first = draw(PromptSampler(20, 10, seed=1), 4)
    again = draw(PromptSampler(20, 10, seed=1), 4)
    other = draw(PromptSampler(20, 10, seed=2), 4)
    assert first == again
    assert first != other
    assert first[:20] != first[20:]  # a new order each epoch
    assert first[:20] != list(range(20))
    assert draw(PromptSampler(6, 4, seed=1, shuffle=False), 3) == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]


def test_sampler_resume_mid_epoch_across_epoch_boundary():
    original = PromptSampler(10, 4, seed=5)
    draw(original, 2)  # position 8 of epoch 0
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON checkpoint
    assert state["epoch"] == 0 and state["position"] == 8
    resumed = PromptSampler(10, 4, seed=999)  # the seed comes from the state
    resumed.load_state_dict(state)
    expected = draw(original, 5)  # crosses into epochs 1 and 2
    assert draw(resumed, 5) == expected
    assert resumed.state_dict() == original.state_dict()


def test_sampler_resume_at_epoch_start():
    original = PromptSampler(8, 4, seed=0)
    draw(original, 3)  # epoch 0 done, 4 into epoch 1
    resumed = PromptSampler(8, 4, seed=0)
    resumed.load_state_dict(original.state_dict())
    assert draw(resumed, 4) == draw(original, 4)


def test_sampler_rejects_state_of_other_dataset_size():
    state = PromptSampler(10, 4, seed=0).state_dict()
    with pytest.raises(ValueError, match="10"):
        PromptSampler(11, 4, seed=0).load_state_dict(state)


# --- arithmetic task -----------------------------------------------------------------------


def test_write_prompts_parquet_deterministic(tmp_path):
    a = arithmetic.write_prompts(tmp_path / "a" / "train.parquet", num_prompts=40, max_operand=9, seed=7)
    b = arithmetic.write_prompts(tmp_path / "b.parquet", num_prompts=40, max_operand=9, seed=7)
    c = arithmetic.write_prompts(tmp_path / "c.parquet", num_prompts=40, max_operand=9, seed=8)
    assert a == tmp_path / "a" / "train.parquet"
    ta, tb, tc = pq.read_table(a), pq.read_table(b), pq.read_table(c)
    assert ta.column_names == ["prompt", "ground_truth"]
    assert ta.num_rows == 40
    assert ta.equals(tb)
    assert not ta.equals(tc)
    assert not list(tmp_path.glob("**/*.tmp"))
    for prompt, truth in zip(ta.column("prompt").to_pylist(), ta.column("ground_truth").to_pylist(),
                             strict=True):
        left, right = prompt.removesuffix("=").split("+")
        assert 0 <= int(left) <= 9 and 0 <= int(right) <= 9
        assert truth == str(int(left) + int(right))
    # the registry path writes the same file
    d = write_task_prompts("arithmetic", tmp_path / "d.parquet", num_prompts=40, max_operand=9, seed=7)
    assert pq.read_table(d).equals(ta)
    with pytest.raises(ValueError, match="unknown task"):
        write_task_prompts("nope", tmp_path / "e.parquet", 1, 1, 0)
    ds = PromptDataset([a])
    assert ds.prompts == ta.column("prompt").to_pylist()


@pytest.mark.parametrize("response,expected", [
    ("7", 1.0), (" 7 junk", 1.0), ("7<|endoftext|>", 1.0), ("answer 7, not 8", 1.0),
    ("17", 0.0), ("", 0.0), ("x", 0.0), ("8 7", 0.0), ("70", 0.0),
])
def test_score(response, expected):
    assert arithmetic.score(prompt="3+4=", response=response, ground_truth="7") == expected


def test_score_strips_ground_truth():
    assert arithmetic.score(prompt="3+4=", response="7", ground_truth=" 7\n") == 1.0


def test_best_constant_accuracy():
    assert arithmetic.best_constant_accuracy(4) == pytest.approx(0.2)  # sum 4: 5 of 25 pairs
    assert arithmetic.best_constant_accuracy(9) == pytest.approx(0.1)  # sum 9: 10 of 100 pairs
    assert arithmetic.best_constant_accuracy(0) == 1.0


# --- tiny model builder ----------------------------------------------------------------------


def test_tokenizer_digits_never_merge():
    tok = build_tokenizer(64, seed=0)
    assert len(tok) <= 64
    assert tok.pad_token == PAD_TOKEN and tok.eos_token == EOS_TOKEN
    assert tok.pad_token_id != tok.eos_token_id
    ids = tok("12+5=")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "+", "5", "="]
    assert tok.decode(ids) == "12+5="
    long_ids = tok("98+76=174")["input_ids"]
    assert len(long_ids) == 9
    digit_ids = [tok(str(d))["input_ids"] for d in range(10)]
    assert all(len(d) == 1 for d in digit_ids)
    assert len({d[0] for d in digit_ids}) == 10
    text = "what is the sum of 45 and 54"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_tokenizer_deterministic():
    a, b = build_tokenizer(64, seed=0), build_tokenizer(64, seed=0)
    assert a.get_vocab() == b.get_vocab()


def test_init_model_byte_identical_and_reused(tmp_path):
    a = init_model(tmp_path / "a", seed=0)
    b = init_model(tmp_path / "b", seed=0)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    marker = json.loads((a / "verl_hpc_model.json").read_text())
    assert marker["preset"] == "tiny" and marker["seed"] == 0
    # only the finished directories remain (no staging leftovers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    # a finished build is reused as is; a different seed refuses to overwrite it
    before = (a / "model.safetensors").stat().st_mtime_ns
    assert init_model(a, seed=0) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(FileExistsError):
        init_model(a, seed=1)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        init_model(other)
    with pytest.raises(ValueError, match="preset"):
        init_model(tmp_path / "c", preset="huge")


def test_untied_preset_has_separate_lm_head(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    tied = init_model(tmp_path / "tied", preset="tiny", seed=0)
    untied = init_model(tmp_path / "untied", preset="tiny-untied", seed=0)
    assert AutoConfig.from_pretrained(tied).tie_word_embeddings is True
    assert AutoConfig.from_pretrained(untied).tie_word_embeddings is False
    with safe_open(str(untied / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    model = AutoModelForCausalLM.from_pretrained(untied)
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert head.data_ptr() != embed.data_ptr()
    assert head.shape == embed.shape
    assert not head.detach().equal(embed.detach())
    tied_model = AutoModelForCausalLM.from_pretrained(tied)
    assert tied_model.lm_head.weight.data_ptr() == tied_model.model.embed_tokens.weight.data_ptr()
