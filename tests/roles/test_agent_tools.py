"""Tools: schemas from functions, refusals naming the entry, verl's tool config, and a runner that survives."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.conftest import REPO
from verl_hpc.config import ConfigError
from verl_hpc.config.multi_turn import MultiTurnConfig
from verl_hpc.roles.agent import ToolCall, ToolRunner, get_parser, load_tools
from verl_hpc.roles.agent.tool_runner import truncate
from verl_hpc.roles.agent.tool_schema import check_arguments, function_schema

PLUGIN = REPO / "tests" / "plugins" / "agent_tools.py"


def spec(name: str) -> str:
    return f"{PLUGIN}:{name}"


def test_schema_from_type_hints_and_docstring() -> None:
    tools = load_tools(MultiTurnConfig(tools=[spec("add"), spec("slow_echo")]))
    add = tools.schemas[0]["function"]
    assert add["name"] == "add" and add["description"] == "Add two integers."
    props = add["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "the first number"}
    assert props["b"]["description"] == "the second number, which may continue on the next line"
    assert props["mode"]["enum"] == ["plain", "loud"] and props["mode"]["type"] == "string"
    assert add["parameters"]["required"] == ["a"]
    assert list(tools.tools) == ["add", "slow_echo"]
    assert check_arguments(tools.schemas[0], {"b": 1}) == "missing required argument(s) a"
    assert "unknown argument(s) c" in check_arguments(tools.schemas[0], {"a": 1, "c": 2})


def test_optional_and_container_types() -> None:
    def f(xs: list[int], table: dict[str, float], note: str | None = None) -> str:
        """F.

        Args:
            xs: numbers
            table: weights
            note: maybe
        """
        return ""

    props = function_schema(f, "f")["function"]["parameters"]["properties"]
    assert props["xs"]["type"] == "array" and props["xs"]["items"] == {"type": "integer"}
    assert props["table"]["additionalProperties"] == {"type": "number"}
    assert props["note"]["type"] == ["string", "null"]


@pytest.mark.parametrize("entry, words", [
    ("no_hints", "has no type hint"),
    ("no_doc", "has no docstring"),
    ("undocumented", "'secret' of undocumented is not described"),
    ("missing_function", "has no function 'missing_function'"),
])
def test_bad_tools_are_refused_naming_the_entry(entry: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_tools(MultiTurnConfig(tools=[spec("add"), spec(entry)]))
    assert err.value.path == "rollout.multi_turn.tools[1]" and words in str(err.value)
    assert "\n" not in str(err.value)


def test_unimportable_module_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.tools\[0\]: module 'no_such_pkg_xyz.tools' cannot be found"):
        load_tools(MultiTurnConfig(tools=["no_such_pkg_xyz.tools:f"]))


def write_tool_config(tmp_path, schema: dict, class_name: str = "tests.plugins.agent_tools.Counter") -> str:
    import yaml

    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": class_name, "config": {"type": "native", "scale": 2},
                                               "tool_schema": schema}]}))
    return str(path)


COUNTER_SCHEMA = {"type": "function", "function": {"name": "count", "description": "Count.", "parameters": {
    "type": "object", "properties": {"step": {"type": "integer", "description": "by how much"}}, "required": []}}}


def test_verl_tool_config_loads_and_runs_its_lifecycle(tmp_path) -> None:
    tools = load_tools(MultiTurnConfig(tool_config_path=write_tool_config(tmp_path, COUNTER_SCHEMA)))
    counter = tools.tools["count"]
    assert counter.name == "count" and counter.config["scale"] == 2
    runner = ToolRunner(tools, workers=2, timeout=5, max_chars=100, truncate_side="middle")
    kwargs = {"count": {"create_kwargs": {"start": 10}}}
    first = runner.submit("e1", [ToolCall("count", {"step": 1})], kwargs).result()
    second = runner.submit("e1", [ToolCall("count", {"step": 3})], kwargs).result()
    assert [first[0].text, second[0].text] == ["12", "18"] and first[0].reward == 0.5
    assert runner.finish("e1", kwargs) == 18.0 and len(counter.released) == 1
    runner.close()


@pytest.mark.parametrize("schema, words", [
    ({"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}}, "identifier"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "text"}}}}}, "'text', not a JSON-schema type"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                   "required": ["y"]}}}, "not among its properties"),
    ({"function": {"name": "f"}}, "a tool schema is"),
])
def test_invalid_verl_schemas_are_refused(tmp_path, schema: dict, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_tools(MultiTurnConfig(tool_config_path=write_tool_config(tmp_path, schema)))
    assert err.value.path == "rollout.multi_turn.tool_config_path: tools[0]" and words in str(err.value)


def test_verl_class_that_cannot_be_imported(tmp_path) -> None:
    path = write_tool_config(tmp_path, COUNTER_SCHEMA, class_name="verl.tools.gsm8k_tool.Gsm8kTool")
    with pytest.raises(ConfigError, match="class_name 'verl.tools.gsm8k_tool.Gsm8kTool' cannot be imported"):
        load_tools(MultiTurnConfig(tool_config_path=path))


def test_raising_hanging_and_flooding_tools_become_error_messages() -> None:
    tools = load_tools(MultiTurnConfig(tools=[spec("peek"), spec("slow_echo")]))
    runner = ToolRunner(tools, workers=4, timeout=0.5, max_chars=200, truncate_side="middle", max_parallel_calls=2)
    started = time.monotonic()
    futures = {mode: runner.submit(mode, [ToolCall("peek", {})], {"peek": {"create_kwargs": {"mode": mode}}})
               for mode in ("raise", "hang", "flood", "ok")}
    out = {mode: f.result()[0] for mode, f in futures.items()}
    assert time.monotonic() - started < 10  # the hang cost its timeout, side by side with the others
    assert out["raise"].text == "Error: tool 'peek' raised RuntimeError: the box is stuck"
    assert out["hang"].error == "tool 'peek' timed out after 0.5 s"
    assert len(out["flood"].text) <= 200 and out["flood"].truncated_chars == 1_000_000 - 200
    assert out["flood"].error is None and out["ok"].text == "0"
    late = runner.submit("a", [ToolCall("slow_echo", {"text": "hi", "delay": 5})], {}).result()[0]
    assert late.error == "tool 'slow_echo' timed out after 0.5 s"  # an async tool is cancelled
    three = runner.submit("b", [ToolCall("slow_echo", {"text": "1"}), ToolCall("nope", {}),
                                ToolCall("slow_echo", {"text": "3"})], {}).result()
    assert three[0].text == "1" and "there is no tool 'nope'" in three[1].text
    assert "at most 2 tool call(s) per turn" in three[2].text
    runner.close()


def test_truncation_sides() -> None:
    text = "a" * 50 + "b" * 50
    assert truncate(text, 200, "middle") == (text, 0)
    left, cut = truncate(text, 60, "left")
    assert cut == 40 and left.endswith("b" * 10) and len(left) == 60
    assert truncate(text, 60, "right")[0].startswith("a" * 10)
    assert truncate(text, 10, "middle")[0] == "a" * 5 + "b" * 5  # no room for a note


def test_hermes_parser() -> None:
    parser = get_parser("hermes")
    turn = parser.parse('Let me look.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert turn.content == "Let me look." and [c.arguments for c in turn.calls] == [{"a": 1}, {"a": 2}]
    assert parser.parse("just text").calls == []
    broken = parser.parse('<tool_call>{"name": add}</tool_call>')
    assert broken.calls[0].error.startswith("the tool call is not valid JSON")
    assert "never closed" in parser.parse('<tool_call>{"name": "add"').calls[-1].error
    with pytest.raises(ConfigError, match="rollout.multi_turn.format: no tool-call parser 'pythonic'"):
        get_parser("pythonic")


def test_multi_turn_config_checks(tmp_path, tiny_model_dir) -> None:
    from verl_hpc.config.loader import load_config

    base = {"model": {"path": str(tiny_model_dir)}, "data": {"task": {"name": "arithmetic"}},
            "reward": {"function": "verl_hpc.data.tasks.arithmetic:score"}}
    with pytest.raises(ConfigError, match="rollout.multi_turn.tools: multi-turn rollouts are enabled but no tool"):
        load_config(data={**base, "rollout": {"multi_turn": {"enable": True}}})
    with pytest.raises(ConfigError, match="rollout.multi_turn.tool_config_path: .* does not exist"):
        load_config(data={**base, "rollout": {"multi_turn": {"enable": True, "tool_config_path": "/nope.yaml"}}})
    with pytest.raises(ConfigError, match="rollout.multi_turn.max_assistant_turns"):
        load_config(data={**base, "rollout": {"multi_turn": {"max_assistant_turns": 0}}})
    cfg = load_config(data={**base, "rollout": {"multi_turn": {"enable": True, "tools": [spec("add")]}}})
    assert cfg.rollout.multi_turn.user_turns == 5 and SimpleNamespace  # verl's default: as many as assistant turns


def test_the_calculator_example_tool_computes_and_refuses_code() -> None:
    """examples/gsm8k/calculator.py: a valid tool; arithmetic answers, anything else raises (an error reply)."""
    tools = load_tools(MultiTurnConfig(tools=[f"{REPO / 'examples' / 'gsm8k' / 'calculator.py'}:calculator"]))
    schema = tools.schemas[0]["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    calculator = tools.tools["calculator"].fn
    assert calculator(expression="(3 + 4) * 2") == "14" and calculator(expression="7 / 2") == "3.5"
    for bad in ("__import__('os').system('id')", "2 ** 10 ** 10", "x + 1", "1" * 201):
        with pytest.raises(ValueError):
            calculator(expression=bad)
