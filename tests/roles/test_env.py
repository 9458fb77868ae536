"""Environments: OpenEnv-shaped classes and TextArena games answer the model's turns; failures cost an episode."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import REPO
from verl_hpc.config import SamplingConfig
from verl_hpc.config.multi_turn import EnvironmentConfig, MultiTurnConfig
from verl_hpc.data.trajectory import environment_score, environment_win
from verl_hpc.roles.env import EnvFailure, EnvReply, EnvRunner, make_environment

PLUGIN = f"{REPO / 'tests' / 'plugins' / 'agent_envs.py'}:CountdownEnv"
needs_textarena = pytest.mark.skipif(importlib.util.find_spec("textarena") is None, reason="textarena not installed")


def test_an_observation_that_is_not_one_is_refused() -> None:
    assert EnvReply.checked("hi", 1, True) == EnvReply("hi", 1.0, True)
    for bad in ((3, 0.0), ("x", "lots"), ("x", float("nan"))):
        with pytest.raises(EnvFailure):
            EnvReply.checked(*bad)


def test_an_openenv_shaped_class_gets_its_action_built_from_the_turn() -> None:
    env = make_environment("python", PLUGIN, {"turns": 2})
    assert env.reset(seed=7) == EnvReply("what is it 7")
    assert env.step("it is 4") == EnvReply("answer 1", 1.0, False)
    assert env.step("no idea") == EnvReply("answer 0", 0.0, True)


@pytest.mark.parametrize(("mode", "error"), [("raise", "RuntimeError: the simulator crashed"),
                                             ("hang", "no answer within 0.5 s"),
                                             ("garbage", "has no text")])
def test_a_failing_step_is_an_outcome_not_an_exception(mode: str, error: str) -> None:
    runner = EnvRunner(lambda: make_environment("python", PLUGIN, {"mode": mode}), workers=2, timeout=0.5)
    first = runner.reset_all([("e0", 1, {})])[0]
    assert first.reply == EnvReply("what is it 1")
    outcome = runner.submit("e0", "3").result(timeout=30)
    assert outcome.reply is None and error in outcome.error
    runner.close()


@needs_textarena
def test_a_textarena_game_is_seeded_and_answers_each_guess() -> None:
    first, again = make_environment("textarena", "GuessTheNumber-v0"), make_environment("textarena", "GuessTheNumber-v0")
    assert "Guess The Number" in first.reset(seed=3).text
    again.reset(seed=3)
    target = first.game.state.game_state["game_number"]
    assert again.game.state.game_state["game_number"] == target  # the seed fixes the number
    wrong = 1 if target != 1 else 2
    hint = first.step(f"[{wrong}]")
    assert hint.text == f"The target number is {'higher' if target > wrong else 'lower'}." and not hint.done
    won = first.step(f"my guess is [{target}]")
    assert won.reward == 1.0 and won.done


@needs_textarena
def test_textarena_action_wrappers_format_the_turn_before_the_game_reads_it() -> None:
    from verl_hpc.config.errors import FieldError

    game = {"min_number": 1, "max_number": 3, "max_turns": 2}
    bare = make_environment("textarena", "GuessTheNumber-v0", game)
    bare.reset(seed=3)
    assert "Invalid move format" in bare.step("2").text  # the game parses only `[2]`
    wrapped = make_environment("textarena", "GuessTheNumber-v0", game, ["ActionFormattingWrapper"])
    assert "between 1 and 3 within 2 turns" in wrapped.reset(seed=3).text  # kwargs reach the game
    target = wrapped.game.state.game_state["game_number"]
    wrong = 1 if target != 1 else 2
    assert wrapped.step(str(wrong)).text.startswith("The target number is")  # `2` became `[2]`
    assert wrapped.step(str(target)).reward == 1.0
    with pytest.raises(FieldError, match=r"environment\.action_wrappers.*'Brackets'.*ActionFormattingWrapper"):
        make_environment("textarena", "GuessTheNumber-v0", game, ["Brackets"])


def test_action_wrappers_are_refused_for_an_environment_that_is_not_textarena(tmp_path: Path) -> None:
    from verl_hpc.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"environment\.action_wrappers: .*TextArena's, not source 'python'"):
        load_config(REPO / "configs" / "agent_quickstart.yaml", [
            f"model.path={tmp_path / 'm'}", "rollout.multi_turn.environment.source=python",
            f"rollout.multi_turn.environment.id={PLUGIN}", "rollout.multi_turn.environment.action_wrappers="
            "[ActionFormattingWrapper]"])


def _agent(model_dir: Path, env: EnvironmentConfig, max_turns: int = 4, deterministic: bool = False,
           **multi_turn: Any):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.roles.agent import AgentRollout
    from verl_hpc.roles.rollout.base import stop_token_ids
    from verl_hpc.roles.rollout.hf import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir), tok)
    cfg = MultiTurnConfig(enable=True, environment=env, max_assistant_turns=max_turns,
                          deterministic_rounds=deterministic, **multi_turn)
    return AgentRollout(cfg, engine, tok, stop_token_ids(tok, str(model_dir)), 512), tok


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory):
    from verl_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("m") / "tiny-agent", preset="tiny-agent", seed=0)


def _rows(agent, rows: int, modes: list[str] | None = None):
    infos = [json.dumps({"env_seed": 100 + i}) for i in range(rows)]
    ds = SimpleNamespace(prompts=[[{"role": "system", "content": "play"}]] * rows, answers=[""] * rows,
                         data_sources=[None] * rows, extra_infos=infos)
    batch = agent.rows(1, list(range(rows)), [0] * rows, list(range(rows)), ds,
                       SamplingConfig(n=1, max_new_tokens=24), version=2)
    return batch, [json.loads(t) for t in batch.column("trajectory").to_pylist()]


def test_environment_win_pays_a_won_game_and_not_a_games_partial_credit() -> None:
    assert environment_win(extra_info={"env_done": True, "env_reward": 1.0}) == 1.0
    assert environment_win(extra_info={"env_done": True, "env_reward": 0.67}) == 0.0  # the turn limit's credit
    assert environment_win(extra_info={"env_done": False, "env_reward": 1.0}) == 0.0  # an episode cut short
    assert environment_win(extra_info={"env_failed": True}) == environment_win() == 0.0

def test_environment_turns_are_inserted_user_turns_and_rewards_add_up(agent_dir: Path) -> None:
    import torch

    agent, tok = _agent(agent_dir, EnvironmentConfig(source="python", id=PLUGIN, kwargs={"turns": 3}),
                        deterministic=True)
    torch.manual_seed(0)  # seeded: the same episodes every time, some of which end turns and step
    batch, records = _rows(agent, 6)
    for row, record in enumerate(records):
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        assert users[0] == f"what is it {100 + row}"  # the reset's observation, seeded by the row
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert record["env_steps"] == len(answers) - (0 if record["env_done"] else 1) or record["truncated"]
        assert users[1:] == [f"answer {3 - k}" for k in range(1, len(users))]
        assert environment_score(extra_info=record) == record["env_reward"]
    masks, responses = batch.column("loss_mask").to_pylist(), batch.column("response_ids").to_pylist()
    for record, mask, ids in zip(records, masks, responses, strict=True):
        inserted = tok.decode([i for i, m in zip(ids, mask, strict=True) if m == 0])
        for text in [m["content"] for m in record["messages"] if m["role"] == "user"][1:]:
            assert text in inserted  # the environment's text is never the model's: loss mask 0
    metrics = agent.metrics()
    assert metrics["env/failures"] == 0 and metrics["env/steps/mean"] > 0
    agent.close()


def test_without_the_first_observation_the_rows_prompt_alone_opens_the_episode(agent_dir: Path) -> None:
    import torch

    env = EnvironmentConfig(source="python", id=PLUGIN, kwargs={"turns": 3}, first_observation=False)
    agent, tok = _agent(agent_dir, env, deterministic=True)
    torch.manual_seed(0)
    batch, records = _rows(agent, 4)
    for record, prompt in zip(records, batch.column("prompt_ids").to_pylist(), strict=True):
        assert [m["role"] for m in record["messages"][:2]] == ["system", "assistant"]  # no reset text between
        assert "what is it" not in tok.decode(prompt)
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        assert users == [f"answer {3 - k}" for k in range(1, len(users) + 1)]  # the environment speaks from step 1
    assert agent.metrics()["env/failures"] == 0
    agent.close()


@needs_textarena
def test_a_turn_cut_at_max_tokens_per_turn_is_a_whole_turn_the_game_answers(agent_dir: Path) -> None:
    import torch

    env = EnvironmentConfig(source="textarena", id="GuessTheNumber-v0", action_wrappers=["ActionFormattingWrapper"],
                            kwargs={"min_number": 1, "max_number": 3, "max_turns": 3})
    agent, tok = _agent(agent_dir, env, max_turns=3, deterministic=True, max_tokens_per_turn=1)
    torch.manual_seed(0)
    batch, records = _rows(agent, 8)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    masks, responses = batch.column("loss_mask").to_pylist(), batch.column("response_ids").to_pylist()
    played = 0
    for record, mask, ids in zip(records, masks, responses, strict=True):
        answers = [m for m in record["messages"] if m["role"] == "assistant"]
        assert sum(mask) == len(answers) <= 3  # one sampled token per turn
        for at, (token, trained) in enumerate(zip(ids[:-1], mask[:-1], strict=True)):
            if trained and token != eot:  # a cut turn: its close is the template's, not trained on
                assert ids[at + 1] == eot and mask[at + 1] == 0
        if not any(m["role"] == "tool" for m in record["messages"]):  # (a cut `<tool_call>` is a tool turn)
            assert record["env_steps"] == len(answers)  # every turn, cut or closed, reached the game
            played += len(answers) > 1
    assert played  # and the game answered: episodes went on past their first turn
    agent.close()


def test_a_failing_environment_costs_its_episode_and_is_counted(agent_dir: Path) -> None:
    import torch

    agent, _ = _agent(agent_dir, EnvironmentConfig(source="python", id=PLUGIN, kwargs={"mode": "raise"}),
                      deterministic=True)
    torch.manual_seed(0)  # a turn reaches the environment only when the model ends it: seeded, some do
    _, records = _rows(agent, 8)
    assert all(r["env_failed"] and r["env_reward"] == 0.0 for r in records if r["finished"])
    failed, retries = sum(r["env_failed"] for r in records), sum(r["env_retries"] for r in records)
    metrics = agent.metrics()
    assert metrics["env/failures"] == failed + retries > 0  # each run that failed, re-runs included
    assert metrics["env/retries"] == retries > 0  # max_retries 1: every failed episode ran once more
    assert all(r["env_retries"] == 1 for r in records if r["env_failed"])
    agent.close()


def test_an_episode_whose_environment_failed_is_run_again_from_a_fresh_reset(agent_dir: Path) -> None:
    """A simulator that crashes once per seed: the re-run replaces the failed episode in its row."""
    import torch

    seen = type(make_environment("python", PLUGIN, {}).env).failed_seeds  # the class as the config loads it
    seen.clear()
    env = EnvironmentConfig(source="python", id=PLUGIN, kwargs={"mode": "flaky"})
    agent, _ = _agent(agent_dir, env, deterministic=True)
    torch.manual_seed(0)
    _, records = _rows(agent, 8)
    rerun = [r for r in records if r["env_retries"]]
    assert rerun and not any(r["env_failed"] for r in records)  # each re-run got past the crash
    assert all(r["messages"][1]["content"].startswith("what is it 1") for r in rerun)  # reset with its row's seed
    metrics = agent.metrics()
    assert metrics["env/failures"] == metrics["env/retries"] == len(rerun)
    agent.close()
    no_retry, _ = _agent(agent_dir, env.model_copy(update={"max_retries": 0}), deterministic=True)
    seen.clear()
    torch.manual_seed(0)
    _, records = _rows(no_retry, 8)
    assert sum(r["env_failed"] for r in records) == len(rerun) and not any(r["env_retries"] for r in records)
    no_retry.close()


def _process_runner(mode: str = "ok", workers: int = 2, timeout: float = 20.0):
    from verl_hpc.roles.env.workers import ProcessEnvRunner

    spec = {"source": "python", "id": PLUGIN.replace(":CountdownEnv", ":PidEnv"), "kwargs": {"mode": mode}}
    return ProcessEnvRunner.local(spec, workers, timeout)


def kill_a_worker_mid_episode(runner, lost_error: str) -> list:
    """kill -9 of the worker holding episode e0 (PidEnv answers its pid): only its episodes fail, with
    `lost_error` in why, and the next episodes reach a worker started again. Returns the new episodes'
    first observations."""
    import os
    import signal

    firsts = runner.reset_all([(f"e{i}", i, {}) for i in range(4)])
    victim = int(firsts[0].reply.text)
    os.kill(victim, signal.SIGKILL)
    steps = [runner.submit(f"e{i}", "7").result(timeout=30) for i in range(4)]
    lost = [i for i in range(4) if int(firsts[i].reply.text) == victim]
    assert all(steps[i].reply is None and lost_error in steps[i].error for i in lost)
    assert all(steps[i].reply is not None for i in range(4) if i not in lost)
    for i in range(4):
        runner.finish(f"e{i}")
    again = runner.reset_all([(f"f{i}", i, {}) for i in range(4)])
    assert all(a.reply is not None for a in again) and runner.restarts == 1
    assert victim not in {int(a.reply.text) for a in again}
    return again


def test_worker_processes_hold_episodes_and_answer_in_parallel() -> None:
    import os

    runner = _process_runner()
    try:
        firsts = runner.reset_all([(f"e{i}", i, {}) for i in range(4)])
        pids = {int(f.reply.text) for f in firsts}
        assert len(pids) == 2 and os.getpid() not in pids  # two processes of their own, episodes spread
        steps = [runner.submit(f"e{i}", "7").result(timeout=30) for i in range(4)]
        assert all(s.reply == EnvReply("answer 2", 1.0, False) for s in steps)
    finally:
        runner.close()


def test_a_worker_that_falls_behind_holds_requests_back_instead_of_timing_them_out() -> None:
    """Eight 0.4 s steps on one worker of two threads, with a 1 s timeout: queued inside the worker,
    the last ones would wait 1.6 s and fail; held back by the rollout, each gets its own second."""
    from verl_hpc.roles.env.workers import ProcessEnvRunner

    spec = {"source": "python", "id": PLUGIN, "kwargs": {"mode": "slow"}, "threads": 2}
    runner = ProcessEnvRunner.local(spec, 1, timeout=1.0)
    try:
        runner.reset_all([(f"e{i}", i, {}) for i in range(8)])
        steps = [runner.submit(f"e{i}", "7") for i in range(8)]
        assert max(runner.admission.busy.values()) == 2 and len(runner.admission.waiting[0]) == 6
        assert [s.result(timeout=30).error for s in steps] == [None] * 8
        assert runner.admission.busy[0] == 0 and not runner.admission.waiting[0]
    finally:
        runner.close()


def test_admission_sends_in_order_and_a_send_that_fails_at_once_does_not_recurse() -> None:
    from verl_hpc.roles.env.workers import Admission

    admission, sent = Admission(1), []
    admission.run(0, lambda: sent.append("a"))
    for name in "bcd":
        admission.run(0, lambda name=name: sent.append(name))
    assert sent == ["a"] and len(admission.waiting[0]) == 3
    admission.release(0)
    assert sent == ["a", "b"]

    many = Admission(1)

    def fails_at_once(name: str) -> None:  # a dead worker: answered, so released, inside the send
        sent.append(name)
        many.release(0)

    many.run(0, lambda: None)
    for i in range(5000):  # deeper than Python's recursion limit if each release sent the next itself
        many.run(0, lambda i=i: fails_at_once(str(i)))
    sent.clear()
    many.release(0)
    assert len(sent) == 5000 and many.busy[0] == 0
    unlimited = Admission(None)
    unlimited.run(3, lambda: sent.append("now"))
    assert sent[-1] == "now"


def test_a_killed_worker_fails_its_episodes_only_and_is_started_again() -> None:
    runner = _process_runner()
    try:
        kill_a_worker_mid_episode(runner, "died")
    finally:
        runner.close()


def test_a_worker_that_crashes_or_hangs_costs_a_failure_within_the_timeout() -> None:
    runner = _process_runner(workers=1, timeout=2.0)
    try:
        runner.reset_all([("crash", 0, {})])
        crashed = runner.submit("crash", "crash").result(timeout=30)
        assert crashed.reply is None and "exit code 3" in crashed.error
    finally:
        runner.close()
    runner = _process_runner(mode="hang", workers=1, timeout=1.0)
    try:
        runner.reset_all([("slow", 0, {})])
        hung = runner.submit("slow", "7").result(timeout=30)
        assert hung.reply is None and "no answer within 1 s" in hung.error
    finally:
        runner.close()


def test_episodes_run_the_same_with_environments_in_worker_processes(agent_dir: Path) -> None:
    import torch

    env = {"source": "python", "id": PLUGIN, "kwargs": {"turns": 3}}
    records = []
    for workers in (0, 2):  # each round waits for every reply: the samples cannot depend on timing
        agent, _ = _agent(agent_dir, EnvironmentConfig(**env, num_workers=workers), deterministic=True)
        torch.manual_seed(0)
        records.append(_rows(agent, 4)[1])
        agent.close()
    in_threads, in_processes = records
    assert any(r["env_steps"] > 0 for r in in_threads)
    assert [r["messages"] for r in in_processes] == [r["messages"] for r in in_threads]
    assert [r["env_reward"] for r in in_processes] == [r["env_reward"] for r in in_threads]


def test_the_example_config_trains_with_its_environment(tmp_path: Path) -> None:
    """configs/env_box.yaml through the CLI, three steps: every episode has its environment, none fails."""
    from tests.conftest import run_cli

    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/env_box.yaml", "--run-dir", str(run_dir), f"model.path={tmp_path / 'model'}",
                   "trainer.total_steps=3", "trainer.batch_size=16", "trainer.save_hf_model=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["env/failures"] == 0 for r in rows)
    assert sum(r["env/steps/mean"] for r in rows) > 0
