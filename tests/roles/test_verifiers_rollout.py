"""verifiers episodes as trajectories: the trace's tokens become the row, and a driver that fails costs episodes.

The driver here is a stand-in speaking the driver's wire (JSON lines) from plain Python, so the
rollout's side - answers to futures, a crash or a hang failing exactly the episodes held, a restart,
the re-run - is checked without verifiers; tests/e2e/test_verifiers_train.py runs the real one.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from verl_hpc.config.errors import FieldError
from verl_hpc.roles.agent.verifiers import VerifiersRollout, episode_trace, task_of
from verl_hpc.roles.agent.verifiers_trace import failed_episode, trace_episode, turn_bounds
from verl_hpc.roles.env.base import EnvFailure
from verl_hpc.roles.env.verifiers_process import DRIVER, VerifiersDriver, VerifiersOptions, driver_argv


def node(ids: list[int], mask: list[int], role: str, parent: int | None, logprobs: list[float] | None = None,
         **message: Any) -> dict[str, Any]:
    return {"parent": parent, "token_ids": ids, "mask": mask, "logprobs": logprobs or [],
            "message": {"role": role, **message}}


def a_trace(task: int = 0) -> dict[str, Any]:
    """A worked call in the prompt, then a sampled tool call, the tool's reply and a sampled answer."""
    call = {"id": "c1", "name": "calc_multiply", "arguments": '{"a": 3, "b": 7}'}
    nodes = [node([1, 2, 3], [0, 0, 0], "user", None, content=f"task {task}"),
             node([20, 21], [0, 0], "assistant", 0, content="a worked answer"),
             node([4, 5, 6, 7], [0, 1, 1, 1], "assistant", 1, [-0.1, -0.2, -0.3], content=None, tool_calls=[call]),
             node([8, 9], [0, 0], "tool", 2, content="21"),
             node([10, 11, 12], [0, 1, 1], "assistant", 3, [-0.4, -0.5], content="3 times 7 is 21.")]
    return {"nodes": nodes, "calls": [{"node": 2, "finish_reason": "tool_calls"}, {"node": 4, "finish_reason": "stop"}],
            "rewards": {"correct": {"score": 1.0, "weight": 0.5}, "style": None},
            "timing": {"agent": {"harness": {"duration": 1.5}}}}


def test_a_trace_becomes_the_row_the_engine_sampled() -> None:
    episode = trace_episode((3, 1, 0), a_trace(), version=7)
    assert episode.prompt_ids == [1, 2, 3, 20, 21, 4]  # everything before the first sampled token
    assert episode.response_ids == [5, 6, 7, 8, 9, 10, 11, 12]
    assert episode.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1]
    assert episode.logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5]
    assert episode.turn_bounds == [0, 3, 6, 8] and episode.turn_versions == [7, 7]
    assert episode.assistant_turns == 2 and episode.tool_turns == 1 and episode.model_tokens == 5
    assert episode.env_reward == 0.5 and episode.env_seconds == 1.5  # score x weight; unscored counts 0
    assert episode.finished and not episode.truncated and episode.final_answer == "3 times 7 is 21."
    assert [c["name"] for c in episode.tool_log] == ["calc_multiply"] and episode.tool_log[0]["response"] == "21"
    assert episode.messages[2]["tool_calls"][0]["function"]["name"] == "calc_multiply"


def test_broken_traces_fail_their_episode_only() -> None:
    trace = a_trace()
    with pytest.raises(EnvFailure, match="no model call"):
        trace_episode((0, 0, 0), {**trace, "calls": []}, 0)
    bad = json.loads(json.dumps(trace))
    bad["nodes"][2]["logprobs"] = [-0.1]
    with pytest.raises(EnvFailure, match="logprobs"):
        trace_episode((0, 0, 0), bad, 0)
    loop = json.loads(json.dumps(trace))
    loop["nodes"][0]["parent"] = 4
    with pytest.raises(EnvFailure, match="broken"):
        trace_episode((0, 0, 0), loop, 0)
    with pytest.raises(EnvFailure, match="failed"):
        episode_trace({"ok": False, "errors": ["harness crashed"], "traces": []})
    failed = failed_episode((0, 0, 1), "no answer", fill_id=2)
    assert failed.env_failed and failed.loss_mask == [0] and failed.response_ids == [2]


def test_turn_bounds_and_task_of_rows() -> None:
    assert turn_bounds([1, 1, 0, 0, 1]) == [0, 2, 4, 5] and turn_bounds([0, 0]) == []
    assert task_of(json.dumps({"env_seed": 5}), 2) == 5 and task_of(None, 2) == 2


def test_options_refuse_unknown_keys_and_a_missing_interpreter(tmp_path: Path) -> None:
    with pytest.raises(FieldError, match="kwargs.*harness: not a verifiers option"):
        VerifiersOptions.of({"harness": "null"})
    with pytest.raises(FieldError, match="kwargs.args"):
        VerifiersOptions.of({"args": "--env.agent.harness.id null"})
    with pytest.raises(FieldError, match="kwargs.python.*verifiers_ref.sh"):
        VerifiersOptions.of({"python": str(tmp_path / "nope")}).interpreter()
    with pytest.raises(FieldError, match="cannot import verifiers"):
        VerifiersOptions.of({"python": sys.executable}).interpreter()
    argv = driver_argv(Path("/py"), "vf-calc", VerifiersOptions.of({"args": ["--x", 1]}), "m", "http://h:1")
    assert argv[:5] == ["/py", str(DRIVER), "vf-calc", "--x", "1"] and "http://h:1/v1" in argv


FAKE = textwrap.dedent('''
    import json, os, signal, sys, time
    mode = sys.argv[1]
    sys.path.insert(0, sys.argv[2])
    from test_verifiers_rollout import a_trace
    if mode == "broken" and os.path.exists(sys.argv[3]):
        sys.exit("the environment no longer loads")   # its restart fails
    print(json.dumps({"ready": True, "tasks": 4}), flush=True)
    for n, line in enumerate(sys.stdin):
        request = json.loads(line)
        if "cancel" in request:
            continue
        task = request["task"]
        if mode in ("crash", "broken") and n == 1 and not os.path.exists(sys.argv[3]):
            open(sys.argv[3], "w").close()         # once: the restarted driver answers
            os.kill(os.getpid(), signal.SIGKILL)   # kill -9 mid-step: the episodes it held are lost
        if mode == "hang" and task == 1:
            continue                               # never answers this one
        if mode == "error" and task == 2:
            print(json.dumps({"id": request["id"], "error": "RuntimeError: the harness broke"}), flush=True)
            continue
        if mode == "garbage" and task == 2:
            print(json.dumps({"id": request["id"], "episode": {"ok": True, "traces": [{"nodes": 3}]}}), flush=True)
            continue
        if request["sampling"] != {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "top_k": 5}:
            sys.exit(f"unexpected sampling {request['sampling']}")
        print(json.dumps({"id": request["id"], "episode": {"ok": True, "traces": [a_trace(task)]}}), flush=True)
''')


def fake_driver(tmp_path: Path, mode: str) -> VerifiersDriver:
    script = tmp_path / "fake_driver.py"
    script.write_text(FAKE)
    return VerifiersDriver([sys.executable, str(script), mode, str(Path(__file__).parent), str(tmp_path / "crashed")],
                           "t0k",
                           tmp_path / "logs" / "driver.log", startup_seconds=60)


def rollout_over(driver: VerifiersDriver, timeout: float = 30.0, retries: int = 1) -> VerifiersRollout:
    rollout = object.__new__(VerifiersRollout)  # its driver without a server or verifiers
    rollout.cfg = SimpleNamespace(max_tokens_per_turn=16)
    rollout.env = SimpleNamespace(timeout_seconds=timeout, max_retries=retries)
    rollout.driver, rollout.fill_id, rollout.traces_path, rollout.last_episodes = driver, 2, None, []
    return rollout


def dataset(rows: int) -> SimpleNamespace:
    return SimpleNamespace(answers=[""] * rows, data_sources=["vf"] * rows,
                           extra_infos=[json.dumps({"env_seed": i}) for i in range(rows)])


SAMPLING = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=5, max_new_tokens=32)


def test_rows_are_the_traces_in_order(tmp_path: Path) -> None:
    driver = fake_driver(tmp_path, "ok")
    driver.start()
    try:
        batch = rollout_over(driver).rows(1, [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1, 1], dataset(2), SAMPLING, 3)
    finally:
        driver.stop()
    assert batch.column("response_ids").to_pylist() == [[5, 6, 7, 8, 9, 10, 11, 12]] * 4
    assert batch.column("loss_mask").to_pylist()[0] == [1, 1, 1, 0, 0, 0, 1, 1]
    assert batch.column("turn_versions").to_pylist()[0] == [3, 3]
    records = [json.loads(t) for t in batch.column("trajectory").to_pylist()]
    assert [r["messages"][0]["content"] for r in records] == ["task 0", "task 0", "task 1", "task 1"]
    assert all(r["env_reward"] == 0.5 and not r["env_failed"] for r in records)


def three_rows(tmp_path: Path, mode: str, **rollout: Any) -> tuple[VerifiersRollout, Any, list[dict], float]:
    """(the rollout, its batch, the rows' records, seconds taken) of three rows through a fake driver in `mode`."""
    driver = fake_driver(tmp_path, mode)
    driver.start()
    over = rollout_over(driver, **rollout)
    started = time.monotonic()
    try:
        batch = over.rows(1, [0, 1, 2], [0, 0, 0], [0, 1, 2], dataset(3), SAMPLING, 0)
    finally:
        driver.stop()
    records = [json.loads(t) for t in batch.column("trajectory").to_pylist()]
    return over, batch, records, time.monotonic() - started


def test_a_killed_driver_costs_the_episodes_it_held_and_is_started_again(tmp_path: Path) -> None:
    rollout, batch, records, _ = three_rows(tmp_path, "crash")
    assert rollout.driver.starts >= 2  # restarted for the re-run
    assert all(not r["env_failed"] for r in records)  # each re-run answered (the new driver's first request)
    # the first answer came before the kill; every episode held by the killed driver counted once as a failure
    assert sum(r["env_retries"] for r in records) == 2 and rollout.metrics()["env/failures"] == 2
    assert batch.column("response_ids").to_pylist()[0] == [5, 6, 7, 8, 9, 10, 11, 12]


def test_a_hung_episode_an_error_and_garbage_fail_alone(tmp_path: Path) -> None:
    for mode, task in (("hang", 1), ("error", 2), ("garbage", 2)):
        rollout, batch, records, seconds = three_rows(tmp_path, mode, timeout=2.0, retries=0)
        assert [r["env_failed"] for r in records] == [i == task for i in range(3)], mode
        assert rollout.metrics()["env/failures"] == 1
        assert seconds < 30
        assert batch.column("loss_mask").to_pylist()[task] == [0]  # nothing of it is trained


def test_a_driver_that_cannot_load_is_refused_naming_the_field(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import sys; print('taskset nope not found', file=sys.stderr); sys.exit(1)\n")
    driver = VerifiersDriver([sys.executable, str(script)], "t", tmp_path / "d.log", startup_seconds=30)
    with pytest.raises(FieldError, match=r"environment\.id.*taskset nope not found"):
        driver.start()


@pytest.mark.parametrize(("override", "match"), [
    ("rollout.multi_turn.tools=[examples/gsm8k/calculator.py:calculator]", r"multi_turn\.tools: .*its own tools"),
    ("rollout.multi_turn.environment.num_workers=2", r"environment\.num_workers: .*a process of its own"),
    ("rollout.multi_turn.partial_rollouts=true", r"partial_rollouts: .*one step's weights"),
])
def test_the_config_refuses_what_a_verifiers_environment_brings_itself(override: str, match: str,
                                                                        tiny_model_dir: Path) -> None:
    from tests.conftest import REPO
    from verl_hpc.config import ConfigError, load_config

    model = f"model.path={tiny_model_dir}"
    cfg = load_config(REPO / "configs" / "verifiers_calc.yaml", [model])
    assert cfg.rollout.multi_turn.environment.source == "verifiers"
    extra = ["algorithm.max_staleness=1", "resources.placement=split", "resources.rollout.device_ids=[1]"] \
        if "partial" in override else []
    with pytest.raises(ConfigError, match=match):
        load_config(REPO / "configs" / "verifiers_calc.yaml", [model, override, *extra])


def test_a_driver_that_cannot_start_again_fails_episodes_not_the_run(tmp_path: Path) -> None:
    rollout, _, records, seconds = three_rows(tmp_path, "broken")
    assert [r["env_failed"] for r in records] == [False, True, True]  # the first answered before the crash
    assert rollout.driver.starts == 2 and seconds < 30  # one failed restart, then failing at once
    assert "could not start again" in records[1]["messages"][0]["content"]
