"""Chat-template deltas and tool-capable templates: tiny-agent, a Qwen vocabulary built offline, plain ChatML."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from verl_hpc.config import ConfigError
from verl_hpc.roles.agent import ChatRenderer, get_parser
from verl_hpc.roles.agent.loop import end_tag_ids

HERMES = (REPO / "configs" / "hermes_chatml.jinja").read_text()
ADD = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "x"}}, "required": ["a"]}}}
PEEK = {"type": "function", "function": {"name": "peek", "description": "Look.", "parameters": {
    "type": "object", "properties": {}, "required": []}}}
# SmolLM2-Instruct's template: plain ChatML with a default system prompt; it ignores tools=.
PLAIN_CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM.<|im_end|>\n' }}{% endif %}"
                "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def agent_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from verl_hpc.models.tiny import init_model

    return AutoTokenizer.from_pretrained(init_model(tmp_path_factory.mktemp("m") / "ta", preset="tiny-agent"))


def episode_ids(renderer: ChatRenderer, tokenizer, prompt: list[dict], turns: list[tuple[list[int], str]]) -> \
        tuple[list[int], list[dict]]:
    """Build a sequence as the agent loop does: sampled turns verbatim, tool replies as template deltas."""
    parser = get_parser("hermes")
    eot = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    ids, messages = renderer.prompt_ids(prompt), [dict(m) for m in prompt]
    for sampled, reply in turns:
        ids += sampled
        closed = sampled[-1] == eot
        text = tokenizer.decode(sampled[:-1] if closed else sampled, skip_special_tokens=False)
        parsed = parser.parse(text)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [c.message_form() for c in parsed.calls]
        messages.append(message)
        if reply:
            messages.append({"role": "tool", "content": reply})
            ids += renderer.delta_ids([messages[-1]], tokenizer.eos_token if closed else "")
    return ids, messages


def test_tiny_agent_template_round_trip(agent_tokenizer) -> None:
    tok = agent_tokenizer
    renderer = ChatRenderer(tok, [PEEK])
    renderer.check_tool_capable()
    call = tok.convert_tokens_to_ids('<tool_call>{"name": "peek", "arguments": {}}</tool_call>')
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert set(end_tag_ids(tok, ["</tool_call>"])) == {call, tok.convert_tokens_to_ids("</tool_call>")}
    prompt = [{"role": "user", "content": "what is in the box"}]
    seven = tok.encode("7", add_special_tokens=False)
    ids, messages = episode_ids(renderer, tok, prompt, [([call], "7"), ([*seven, eot], "")])
    assert messages[1]["tool_calls"][0]["function"] == {"name": "peek", "arguments": {}}
    assert ids == renderer.rendered_ids(messages)  # the template agrees with the kept ids, token for token
    assert tok.decode(renderer.delta_ids([{"role": "tool", "content": "7"}], ""), skip_special_tokens=False) == \
        "<|im_end|><|tool|><tool_response>7</tool_response><|im_end|><|assistant|>"


def test_a_template_that_ignores_tools_is_refused_in_one_line(agent_tokenizer) -> None:
    tok = agent_tokenizer
    plain = ChatRenderer(tok, [ADD], PLAIN_CHATML, "rollout.multi_turn.chat_template smollm2.jinja")
    with pytest.raises(ConfigError) as err:
        plain.check_tool_capable()
    assert err.value.path == "rollout.multi_turn.chat_template" and "ignores tools=" in str(err.value)
    assert "hermes_chatml.jinja" in str(err.value) and "\n" not in str(err.value)
    ChatRenderer(tok, [ADD], HERMES, "hermes").check_tool_capable()  # naming a tool-capable template works


def test_a_template_that_rewrites_history_is_refused(agent_tokenizer) -> None:
    # drops every assistant message once a tool reply follows (as some templates drop <think> blocks)
    forgetful = ("{% if tools %}tools{% endif %}{% for m in messages %}{% if m.role != 'assistant' or "
                 "messages[-1].role == 'assistant' %}{{ m.role }}:{{ m.content }};{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
    with pytest.raises(ConfigError, match="renders earlier messages differently"):
        ChatRenderer(agent_tokenizer, [ADD], forgetful, "forgetful").check_tool_capable()


@pytest.mark.slow
def test_qwen_vocabulary_renders_and_parses_a_tool_call_round_trip(tmp_path_factory) -> None:
    from verl_hpc.models.qwen_vocab import build_qwen_tokenizer

    tok = build_qwen_tokenizer(Path("~/.cache/verl-hpc/tokenizers/qwen2.5-vocab").expanduser(), HERMES)
    assert tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<|im_end|>"]) == [151657, 151658, 151645]
    renderer = ChatRenderer(tok, [ADD])
    renderer.check_tool_capable()
    prompt = [{"role": "user", "content": "what is 2+3?"}]
    eot = 151645
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    turn1 = [*tok.encode(call_text, add_special_tokens=False), eot]
    assert turn1[0] == 151657 and turn1[-2] == 151658
    turn2 = [*tok.encode("It is 5.", add_special_tokens=False), eot]
    ids, messages = episode_ids(renderer, tok, prompt, [(turn1, "5"), (turn2, "")])
    assert messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]
    assert ids == renderer.rendered_ids(messages)[:len(ids)]  # rendered again: the same ids
    assert tok.decode(renderer.delta_ids([{"role": "tool", "content": "5"}], "<|im_end|>")) == \
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # stopped at </tool_call> instead of <|im_end|>: the template's whole closing is inserted
    assert tok.decode(renderer.delta_ids([{"role": "tool", "content": "5"}], "")).startswith("<|im_end|>\n")
