"""An environment written against OpenEnv's own base class trains in-process and through `create_app`
over its WebSocket, with the same episodes both ways."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO
from verl_hpc.config.loader import load_config
from verl_hpc.launch.train import train
from verl_hpc.roles.env import EnvReply, make_environment

pytestmark = pytest.mark.skipif(importlib.util.find_spec("openenv") is None, reason="openenv-core not installed")
BOX = f"{REPO / 'tests' / 'plugins' / 'openenv_box.py'}:BoxEnvironment"


@pytest.fixture(scope="module")
def server_url():
    """OpenEnv's own server for the box environment, in a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "plugins" / "openenv_box.py"), str(port)],
                            cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the OpenEnv server did not start (exit code {proc.poll()})")
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_the_server_keeps_each_episode_in_its_own_session(server_url: str) -> None:
    first, second = (make_environment("openenv_server", server_url) for _ in range(2))
    try:
        assert first.reset(seed=3) == EnvReply("what is in the box")
        second.reset(seed=4)
        local = make_environment("python", BOX)
        local.reset(seed=3)
        digit = next(d for d in "01234" if local.step(d).done)
        assert first.step(digit) == EnvReply("it is", 1.0, True)  # seed 3's digit, whatever the other session holds
    finally:
        first.close()
        second.close()


def box_config(model_dir: Path, source: str, ref: str) -> dict:
    return {"model": {"path": str(model_dir), "init_preset": "tiny-agent"},
            "data": {"task": {"name": "hidden_digit", "num_prompts": 16, "seed": 0}},
            "reward": {"function": "verl_hpc.data.trajectory:environment_score"},
            "rollout": {"multi_turn": {"enable": True, "max_assistant_turns": 3, "deterministic_rounds": True,
                                       "environment": {"source": source, "id": ref}}},
            "algorithm": {"name": "grpo", "sampling": {"n": 4, "max_new_tokens": 6}, "kl": {"coef": 0.0}},
            "trainer": {"total_steps": 2, "batch_size": 16, "save_hf_model": False, "torch_threads": 1, "seed": 0},
            "checkpoint": {"interval_steps": 100}, "logging": {"sinks": []}}


def test_openenv_trains_in_process_and_over_its_websocket_alike(server_url: str, tmp_path: Path) -> None:
    from verl_hpc.models.tiny import init_model

    model_dir = init_model(tmp_path / "tiny-agent", preset="tiny-agent")
    rows = {}
    for source, ref in (("python", BOX), ("openenv_server", server_url)):
        run = train(load_config(data=box_config(model_dir, source, ref)), tmp_path / source)
        assert run.steps == 2
        rows[source] = [json.loads(line) for line in
                        (tmp_path / source / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows["python"], rows["openenv_server"], strict=True):
        assert a["env/steps/mean"] > 0 and a["env/failures"] == b["env/failures"] == 0
        for key in ("critic/score/mean", "env/steps/mean", "env/done_ratio", "actor/pg_loss"):
            assert a[key] == b[key], key  # the same episodes and the same update, whichever way they were played


def test_a_server_error_or_no_server_costs_the_episode_only(server_url: str) -> None:
    from verl_hpc.roles.env import EnvFailure
    from verl_hpc.roles.env.openenv_client import session_url

    assert session_url("http://h:8000/") == "ws://h:8000/ws"
    assert session_url("https://h") == "wss://h/ws" and session_url("ws://h:1") == "ws://h:1/ws"
    wrong = make_environment("openenv_server", server_url, {"action_field": "no_such_field"})
    try:
        wrong.reset(seed=3)
        with pytest.raises(EnvFailure, match="the server's error"):  # OpenEnv refuses the action's fields
            wrong.step("1")
    finally:
        wrong.close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EnvFailure, match="cannot reach the OpenEnv server"):
        make_environment("openenv_server", f"http://127.0.0.1:{port}")


def test_a_finished_episode_leaves_its_session_to_the_next_and_a_failed_one_does_not(server_url: str) -> None:
    first = make_environment("openenv_server", server_url)
    first.reset(seed=3)
    first.close()  # kept open for the next episode
    second = make_environment("openenv_server", server_url)
    assert second.reused and second.ws is first.ws
    assert second.reset(seed=3) == EnvReply("what is in the box")  # a fresh episode on the same session
    second.close()
    hasty = make_environment("openenv_server", server_url, {"message_timeout_s": 0.5})
    with pytest.raises(TimeoutError):  # no answer in time: the session's state is unknown
        hasty.reset(seed=99)  # the box's slow seed: its reset takes 2 s (an instant timeout raced a busy CPU)
    hasty.close()
    third = make_environment("openenv_server", server_url)
    assert third.ws is not hasty.ws  # a session whose call failed was ended, not kept
    third.close()
