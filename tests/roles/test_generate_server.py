"""`verl-hpc serve`'s endpoint: vLLM's token-level generate over the project's rollout engine.

The end-to-end run with verifiers' own harness is tests/e2e/test_verifiers_env.py; here the request
parsing, the reply's shape (renderers' client refuses any other), batching of concurrent requests,
refusals naming their field, the bearer token and the CLI command itself, on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from verl_hpc.roles.rollout.base import Generation
from verl_hpc.roles.rollout.serve import (
    GenerateServer,
    RequestError,
    ServedModel,
    finish_reason,
    generate_reply,
    parse_generate,
)


def test_parse_takes_vllms_fields_and_names_a_bad_one() -> None:
    call = parse_generate({"token_ids": [5, 6], "sampling_params": {"temperature": 0.5, "top_p": 0.9,
                                                                     "max_tokens": 7, "stop_token_ids": [3, 2, 3]}},
                          default_max_tokens=16, context_len=100)
    assert (call.prompt_ids, call.temperature, call.top_p, call.max_tokens, call.stop_token_ids) == \
        ((5, 6), 0.5, 0.9, 7, (2, 3))
    assert parse_generate({"token_ids": [1]}, 16, None).max_tokens == 16  # the server's default
    assert parse_generate({"token_ids": [1], "sampling_params": {"max_tokens": 50}}, 16, 10).max_tokens == 9
    greedy = parse_generate({"token_ids": [1], "sampling_params": {"temperature": 0}}, 16, None)
    assert (greedy.temperature, greedy.top_k) == (1.0, 1)  # vLLM's greedy: the top token alone
    for body, field in [({"token_ids": []}, "token_ids"), ({"token_ids": [1, "a"]}, "token_ids"),
                        ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
                        ({"token_ids": [1], "sampling_params": {"n": 4}}, "sampling_params.n"),
                        ({"token_ids": [1], "sampling_params": {"stop_token_ids": "x"}}, "sampling_params.stop"),
                        ({"token_ids": [1] * 10}, "token_ids: the prompt's 10 tokens fill"), ([1, 2], "JSON object")]:
        with pytest.raises(RequestError, match=field):
            parse_generate(body, 16, 10)


def test_the_reply_is_the_shape_renderers_reads() -> None:
    call = parse_generate({"token_ids": [1, 2]}, 4, None)
    reply = generate_reply("gen-1", call, [7, 9], [-0.5, -1.25], "stop")
    choice = reply["choices"][0]
    assert choice["token_ids"] == [7, 9] and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"] == [{"token": "token_id:7", "logprob": -0.5},
                                             {"token": "token_id:9", "logprob": -1.25}]
    assert reply["prompt_token_ids"] == [1, 2] and reply["usage"]["total_tokens"] == 4
    assert finish_reason([4, 2], {2}, 8) == "stop" and finish_reason([4, 5], {2}, 2) == "length"


class CountingEngine:
    """Records each generate call's batch; the response is the prompt's last id, then a stop id."""

    policy_version = 3

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.release = threading.Event()

    def generate(self, prompt_ids, sampling, stop_token_ids=(), max_tokens=None) -> Generation:
        self.batches.append(len(prompt_ids))
        self.release.wait(10)
        return Generation([[p[-1], 2] for p in prompt_ids], [[-0.1, -0.2] for _ in prompt_ids])


def post(url: str, body: Any, token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(f"{url}/inference/v1/generate", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def server(tmp_path: Path):
    engine = CountingEngine()
    srv = GenerateServer(engine, ServedModel("m", 64, 8), [2], token="s3cret", calls_path=tmp_path / "calls.jsonl")
    yield srv.start(), engine, tmp_path / "calls.jsonl"
    srv.close()


def test_requests_waiting_together_share_one_engine_call_and_are_recorded(server) -> None:
    srv, engine, calls = server
    replies: list[tuple[int, dict]] = []
    threads = [threading.Thread(target=lambda i=i: replies.append(post(srv.url, {"token_ids": [1, 10 + i]}, "s3cret")))
               for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30  # the engine holds the first call; every other request queues behind it
    while (not engine.batches or engine.batches[0] + srv.batcher._queue.qsize() < 6) and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.release.set()
    for t in threads:
        t.join(30)
    assert sorted(r[1]["choices"][0]["token_ids"][0] for r in replies) == list(range(10, 16))
    assert all(r[0] == 200 and r[1]["choices"][0]["finish_reason"] == "stop" for r in replies)
    assert len(engine.batches) == 2 and sum(engine.batches) == 6  # those that waited went in one call
    lines = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(lines) == 6 and {line["policy_version"] for line in lines} == {3}
    assert {tuple(line["prompt_ids"]) for line in lines} == {(1, 10 + i) for i in range(6)}


def test_refusals_name_the_field_and_the_token_is_required(server) -> None:
    srv, engine, _ = server
    engine.release.set()
    assert post(srv.url, {"token_ids": [1]})[0] == 401
    assert post(srv.url, {"token_ids": [1]}, "wrong")[0] == 401
    status, body = post(srv.url, {"token_ids": [1], "model": "other"}, "s3cret")
    assert status == 404 and "this server serves 'm'" in body["error"]["message"]
    status, body = post(srv.url, {"token_ids": []}, "s3cret")
    assert status == 400 and body["error"]["message"].startswith("token_ids:")
    with urllib.request.urlopen(f"{srv.url}/health", timeout=10) as reply:
        assert json.loads(reply.read()) == {"status": "ok"}
    models = urllib.request.Request(f"{srv.url}/v1/models", headers={"Authorization": "Bearer s3cret"})
    with urllib.request.urlopen(models, timeout=10) as reply:
        assert json.loads(reply.read())["data"][0] == {"id": "m", "object": "model", "owned_by": "verl-hpc",
                                                        "max_model_len": 64}


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(tmp_path: Path) -> None:
    class Flaky(CountingEngine):
        def generate(self, prompt_ids, sampling, stop_token_ids=(), max_tokens=None) -> Generation:
            if prompt_ids[0][-1] == 0:
                raise RuntimeError("out of memory")
            return super().generate(prompt_ids, sampling, stop_token_ids, max_tokens)

    engine = Flaky()
    engine.release.set()
    srv = GenerateServer(engine, ServedModel("m", None, 8), [2]).start()
    try:
        status, body = post(srv.url, {"token_ids": [0]})
        assert status == 500 and "RuntimeError: out of memory" in body["error"]["message"]
        assert post(srv.url, {"token_ids": [4]})[1]["choices"][0]["token_ids"] == [4, 2]
    finally:
        srv.close()


def test_the_serve_command_samples_from_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SERVE_TOKEN": "t0k"}
    proc = subprocess.Popen([sys.executable, "-m", "verl_hpc", "serve", str(tiny_model_dir), "--port", "0",
                             "--max-tokens", "5", "--calls", str(calls), "--token-env", "SERVE_TOKEN"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("verl-hpc serve: http://127.0.0.1:"), line
        url = line.split()[2].removesuffix("/inference/v1/generate")
        status, reply = post(url, {"token_ids": [3, 4, 5], "sampling_params": {"temperature": 0.8}}, "t0k")
        assert status == 200 and 1 <= len(reply["choices"][0]["token_ids"]) <= 5
        record = json.loads(calls.read_text())
        assert record["completion_ids"] == reply["choices"][0]["token_ids"] and record["prompt_ids"] == [3, 4, 5]
    finally:
        proc.terminate()
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize(("args", "field"), [(["serve", "/nonexistent/model"], "target"),
                                              (["serve", "configs/quickstart.yaml", "--token-env", "UNSET_VAR_X"],
                                               "--token-env")])
def test_the_serve_command_refuses_bad_input_in_one_line(args: list[str], field: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "UNSET_VAR_X"}
    proc = subprocess.run([sys.executable, "-m", "verl_hpc", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"verl-hpc: error: {field}"), proc.stderr
    assert proc.stderr.count("\n") == 1
