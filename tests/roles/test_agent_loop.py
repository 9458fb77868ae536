"""The agent loop on real engines: token fidelity (HF and vLLM), failing tools, concurrency, metrics."""

from __future__ import annotations

import importlib.util
import json
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO
from verl_hpc.config import SamplingConfig
from verl_hpc.config.multi_turn import MultiTurnConfig
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.agent import AgentRollout, get_parser
from verl_hpc.roles.rollout.base import stop_token_ids

PLUGIN = REPO / "tests" / "plugins" / "agent_tools.py"
PROMPT = [{"role": "user", "content": "what is in the box"}]


class Recording:
    """A real engine whose every (context, sampled ids, logprobs) is kept for the fidelity check."""

    def __init__(self, inner):
        self.inner, self.seen, self.calls = inner, Counter(), []

    def __getattr__(self, name):  # the engine's other parts as they are: the HF engine's episode cache
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def generate(self, prompt_ids, sampling, stop_token_ids=(), max_tokens=None):
        out = self.inner.generate(prompt_ids, sampling, stop_token_ids=stop_token_ids, max_tokens=max_tokens)
        self.calls.append(len(prompt_ids))
        for context, ids, lps in zip(prompt_ids, out.response_ids, out.logprobs, strict=True):
            self.seen[(tuple(context), tuple(ids), tuple(round(x, 5) for x in lps))] += 1
        return out


class RecordingStream(Recording):
    """`Recording` of an engine that batches continuously: each turn submitted, then polled back."""

    def __init__(self, inner):
        super().__init__(inner)
        self.contexts: dict[int, tuple[int, ...]] = {}

    def submit(self, keys, prompt_ids, seeds, sampling, stop_token_ids=(), max_tokens=None):
        self.calls.append(len(keys))
        self.contexts.update(zip(keys, (tuple(p) for p in prompt_ids), strict=True))
        return self.inner.submit(keys, prompt_ids, seeds, sampling, stop_token_ids=stop_token_ids,
                                 max_tokens=max_tokens)

    def poll(self, wait):
        out = self.inner.poll(wait)
        for key, ids, lps in out:
            self.seen[(self.contexts.pop(key), tuple(ids), tuple(round(x, 5) for x in lps))] += 1
        return out


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory):
    from verl_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("m") / "tiny-agent", preset="tiny-agent", seed=0)


def dataset(rows: int, modes: list[str] | None = None) -> SimpleNamespace:
    kwargs = [{"peek": {"create_kwargs": {"digit": i % 10, "mode": (modes or ["ok"])[i % len(modes or ["ok"])]}}}
              for i in range(rows)]
    return SimpleNamespace(prompts=[PROMPT] * rows, answers=[str(i % 10) for i in range(rows)],
                           data_sources=["hidden_digit"] * rows, extra_infos=[json.dumps({"tools_kwargs": k})
                                                                               for k in kwargs])


def run_rows(agent: AgentRollout, rows: int, ds: SimpleNamespace, max_new_tokens: int = 12) -> RolloutBatch:
    sampling = SamplingConfig(n=1, max_new_tokens=max_new_tokens)
    return agent.rows(1, list(range(rows)), [0] * rows, list(range(rows)), ds, sampling, version=3)


def check_fidelity(batch: RolloutBatch, recording: Recording, agent: AgentRollout, tokenizer) -> int:
    """Every sampled segment is an engine output at its exact context; every other id is a template delta."""
    parser, eot = get_parser("hermes"), set(agent.loop.eot_ids)
    expected: Counter = Counter()
    multi = 0
    cols = {k: batch.column(k).to_pylist() for k in ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask",
                                                    "turn_bounds", "turn_versions", "trajectory")}
    for row in range(len(batch)):
        prompt, resp, lps = cols["prompt_ids"][row], cols["response_ids"][row], cols["rollout_logprobs"][row]
        bounds, record = cols["turn_bounds"][row], json.loads(cols["trajectory"][row])
        assert cols["turn_versions"][row] == [3] * (len(bounds) // 2)
        tools = iter([m for m in record["messages"] if m["role"] == "tool"])
        for k in range(0, len(bounds), 2):
            start, end = bounds[k], bounds[k + 1]
            expected[(tuple(prompt + resp[:start]), tuple(resp[start:end]),
                      tuple(round(x, 5) for x in lps[start:end]))] += 1
            assert cols["loss_mask"][row][start:end] == [1] * (end - start)
            nxt = bounds[k + 2] if k + 2 < len(bounds) else len(resp)
            if end < nxt:  # inserted ids: exactly the template's delta for this turn's replies
                close = tokenizer.decode(resp[end - 1:end]) if resp[end - 1] in eot else ""
                replies = [next(tools)]
                assert resp[end:nxt] == agent.renderer.delta_ids(replies, close)
                assert cols["loss_mask"][row][end:nxt] == [0] * (nxt - end) and set(lps[end:nxt]) == {0.0}
        multi += len(bounds) > 2
        assert parser  # the parser that read the turns is the run's
    assert expected == recording.seen  # nothing sampled is missing, nothing scored was not sampled
    inputs = batch.model_inputs(0)
    assert torch.equal(inputs["response_mask"], batch.loss_mask())
    return multi


def make_agent(engine, tokenizer, agent_dir, **overrides) -> AgentRollout:
    cfg = MultiTurnConfig(enable=True, tools=[f"{PLUGIN}:peek"], **overrides)
    return AgentRollout(cfg, engine, tokenizer, stop_token_ids(tokenizer, str(agent_dir)), 256)


def test_hf_engine_token_fidelity_and_logprobs(agent_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.roles.rollout.hf import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(agent_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(agent_dir)
    recording = Recording(HFRolloutEngine(model, tok))
    agent = make_agent(recording, tok, agent_dir, max_assistant_turns=3)
    torch.manual_seed(0)
    batch = run_rows(agent, 48, dataset(48))
    assert check_fidelity(batch, recording, agent, tok) >= 3  # several episodes really had several turns
    multi_turn = probs_diff(model, batch, tok.pad_token_id)
    torch.manual_seed(0)  # the same prompts as single-turn rollouts, same engine and model
    single_turn = probs_diff(model, single_turn_rows(recording.inner, batch, SamplingConfig(n=1, max_new_tokens=12)),
                             tok.pad_token_id)
    assert multi_turn <= 2 * single_turn + 1e-6 and multi_turn < 1e-4, (multi_turn, single_turn)
    metrics = agent.metrics()
    assert metrics["agent/num_turns/max"] >= 2 and metrics["agent/tool_calls/mean"] > 0
    # the later turns read their episode's earlier tokens from its kept cache, not a new prefill
    assert recording.inner.prefill_counts["reused"] > 0
    agent.close()


def always_call(model, call_id: int) -> None:
    """The policy's head made to put (nearly) all mass on the tool call, every turn: a real model, forced."""
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-20.0)
        head.bias[call_id] = 20.0
    model.lm_head = head


def test_raising_hanging_and_flooding_tools_cost_one_call_each(agent_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.roles.rollout.hf import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(agent_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(agent_dir)
    always_call(model, tok.convert_tokens_to_ids('<tool_call>{"name": "peek", "arguments": {}}</tool_call>'))
    recording = Recording(HFRolloutEngine(model, tok))
    agent = make_agent(recording, tok, agent_dir, max_assistant_turns=2, tool_timeout_seconds=1.0,
                       max_tool_response_length=100)
    started = time.monotonic()
    batch = run_rows(agent, 4, dataset(4, ["raise", "hang", "flood", "ok"]))
    assert time.monotonic() - started < 30
    records = [json.loads(t) for t in batch.column("trajectory").to_pylist()]
    assert [r["num_turns"] for r in records] == [2, 2, 2, 2]  # every episode went on after its tool's reply
    replies = [r["tool_calls"][0]["response"] for r in records]
    assert replies[0] == "Error: tool 'peek' raised RuntimeError: the box is stuck"
    assert replies[1] == "Error: tool 'peek' timed out after 1 s" and replies[3] == "3"
    assert len(replies[2]) == 100 and "truncated 999900 characters" in replies[2]
    assert all(r["truncated"] for r in records)  # it still wanted a tool when its turns ran out
    metrics = agent.metrics()
    assert metrics["agent/tool_errors"] == 2 and metrics["agent/tool_calls/mean"] == 1
    assert metrics["agent/truncated_ratio"] == 1.0 and metrics["agent/tool_time_s"] >= 1.0
    check_fidelity(batch, recording, agent, tok)
    agent.close()


def test_tools_of_waiting_episodes_overlap_generation(agent_dir) -> None:
    """A slow tool holds its own episode only: the step takes about one tool latency, not one per episode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.roles.rollout.hf import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(agent_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(agent_dir)
    always_call(model, tok.convert_tokens_to_ids('<tool_call>{"name": "peek", "arguments": {}}</tool_call>'))
    recording = Recording(HFRolloutEngine(model, tok))
    agent = make_agent(recording, tok, agent_dir, max_assistant_turns=2, tool_workers=16)
    agent.tools.tools["peek"].fn = lambda **state: time.sleep(0.5) or "3"  # every call sleeps 0.5 s
    batch = run_rows(agent, 16, dataset(16))
    assert len(batch) == 16 and recording.calls[0] == 16  # the first round batched every episode
    runner_seconds = sum(json.loads(t)["tool_calls"][0]["seconds"] for t in batch.column("trajectory").to_pylist())
    assert runner_seconds >= 16 * 0.5 and len(recording.calls) <= 4  # 8 s of tool time, few engine rounds
    agent.close()


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


@needs_vllm
@pytest.mark.slow
def test_vllm_engine_token_fidelity(agent_dir, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.config.resources import VllmArgs
    from verl_hpc.roles.rollout.vllm_engine import VLLMRolloutEngine

    tok = AutoTokenizer.from_pretrained(agent_dir, padding_side="left")
    engine = VLLMRolloutEngine(str(agent_dir), tok.pad_token_id, VllmArgs(dtype="float32", enforce_eager=True),
                               timeout=600, eos_ids=stop_token_ids(tok, str(agent_dir)))
    try:
        recording = RecordingStream(engine)
        agent = make_agent(recording, tok, agent_dir, max_assistant_turns=3)
        torch.manual_seed(0)
        batch = run_rows(agent, 48, dataset(48))
        assert check_fidelity(batch, recording, agent, tok) >= 3
        assert recording.calls[0] == 48 and len(recording.calls) > 1  # turns joined the running batch later
        model = AutoModelForCausalLM.from_pretrained(agent_dir)
        multi_turn = probs_diff(model, batch, tok.pad_token_id)
        torch.manual_seed(0)  # the same prompts as single-turn rollouts, same engine and model
        single = single_turn_rows(engine, batch, SamplingConfig(n=1, max_new_tokens=12))
        single_turn = probs_diff(model, single, tok.pad_token_id)
        print(f"rollout_probs_diff max: multi-turn {multi_turn:.3g}, single-turn {single_turn:.3g}")
        assert multi_turn <= 2 * single_turn + 1e-6 and multi_turn < 1e-4
        agent.close()
    finally:
        engine.close()


def probs_diff(model, batch: RolloutBatch, pad_id: int) -> float:
    """The trainer's `training/rollout_probs_diff_max` of `batch`: over the model's own tokens only."""
    from verl_hpc.roles.forward import response_logprobs

    inputs = batch.model_inputs(pad_id)
    with torch.no_grad():
        trainer, _ = response_logprobs(model, inputs, 1.0)
    mask = inputs["response_mask"].bool()
    engine = batch.token_tensor("rollout_logprobs", mask.shape[1])
    return float((engine.exp() - trainer.exp()).abs()[mask].max())


def single_turn_rows(engine, batch: RolloutBatch, sampling: SamplingConfig) -> RolloutBatch:
    prompts = batch.column("prompt_ids").to_pylist()
    out = engine.generate(prompts, sampling)
    return RolloutBatch.from_generation(prompts, out.response_ids, out.logprobs, group_ids=list(range(len(prompts))),
                                        prompt_index=list(range(len(prompts))), ground_truth=[None] * len(prompts),
                                        policy_version=0)


def test_deterministic_rounds_sample_the_same_episodes_whatever_the_tool_latency(agent_dir) -> None:
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.roles.rollout.hf import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(agent_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(agent_dir)
    agent = make_agent(HFRolloutEngine(model, tok), tok, agent_dir, max_assistant_turns=3, deterministic_rounds=True)
    agent.tools.tools["peek"].fn = lambda **state: time.sleep(random.random() * 0.05) or str(state["digit"])
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        batch = run_rows(agent, 24, dataset(24))
        runs.append((batch.column("response_ids").to_pylist(), batch.column("loss_mask").to_pylist()))
    assert runs[0] == runs[1]
    assert agent.metrics()["agent/tool_calls/mean"] > 0
    agent.close()
