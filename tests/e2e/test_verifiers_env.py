"""A verifiers tool environment runs its episodes against `verl-hpc serve`, and its traces' token ids are ours.

verifiers 0.4.0 inverts control: its harness drives the episode and calls the model through
`POST /inference/v1/generate` with token ids its renderer built. Here its own CLI (`vf-eval`, in a
venv of its own: tools/verifiers_ref.sh) runs examples/verifiers/vf_calc (a calculator tool served by
verifiers' MCP tool server, three worked calls in the prompt) with its null harness against SmolLM2-135M-
Instruct behind `verl-hpc serve`, the renderer being examples/verifiers/delta_renderer.py with the run's
hermes template. Checked on every model call of every trace: the trace's tokens up to that call are the
prompt and completion the engine recorded (`--calls`), its sampled tokens and logprobs are the engine's,
and its prompt is what verl-hpc's own agent loop renders for the same messages (the first prompt with
the tools, then sampled ids verbatim plus the template's delta for the tool reply).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import REPO, smollm2_dir

pytestmark = pytest.mark.slow
TEMPLATE = REPO / "configs" / "hermes_chatml.jinja"


@pytest.fixture(scope="module")
def verifiers_venv() -> Path:
    """verifiers' venv with the example environment installed (skipped, saying why, without PyPI)."""
    proc = subprocess.run(["bash", "tools/verifiers_ref.sh"], cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.skip(f"verifiers 0.4.0 could not be installed here: {proc.stderr.strip()[-400:]}")
    venv = Path(proc.stdout.strip().splitlines()[-1])
    subprocess.run([str(venv / "bin" / "uv"), "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                    "-e", str(REPO / "examples" / "verifiers" / "vf_calc")], check=True, timeout=300)
    return venv


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """`verl-hpc serve` on SmolLM2-135M-Instruct, any free port, every call recorded."""
    model = smollm2_dir()
    calls = tmp_path_factory.mktemp("serve") / "calls.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "verl_hpc", "serve", str(model), "--port", "0", "--max-tokens",
                             "64", "--calls", str(calls)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("verl-hpc serve: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    url = line.split()[2].removesuffix("/inference/v1/generate")
    yield model, url, calls
    proc.terminate()
    assert proc.wait(timeout=30) == 0  # SIGTERM ends it cleanly


def run_vf_eval(venv: Path, model: Path, url: str, out: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    if os.environ.get("PIP_INDEX_URL"):  # the harness's uv scripts fetch from the index pip uses
        env.setdefault("UV_DEFAULT_INDEX", os.environ["PIP_INDEX_URL"])
    proc = subprocess.run(
        [str(venv / "bin" / "vf-eval"), "vf-calc", "-n", "2", "-r", "2", "--no-push", "-m", str(model),
         "--client.type", "train", "--client.base-url", f"{url}/v1", "--client.api-key-var", "VERL_HPC_UNSET_KEY",
         "--client.renderer.name", "custom", "--client.renderer.import-path",
         f"{REPO / 'examples' / 'verifiers' / 'delta_renderer.py'}:DeltaRenderer",
         "--client.renderer.chat-template-file", str(TEMPLATE), "--env.agent.harness.id", "null",
         "--env.agent.runtime.type", "subprocess", "--sampling.temperature", "0.5", "-o", str(out)],
        cwd=out.parent, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (traces,) = out.glob("*/traces.jsonl")
    return [trace for line in traces.read_text().splitlines() for trace in json.loads(line)["traces"]]


def path_to(nodes: list[dict[str, Any]], index: int) -> list[int]:
    """The node indices from the root of the trace graph to `index`."""
    path = []
    while index is not None:
        path.append(index)
        index = nodes[index].get("parent")
    return path[::-1]


def wire(message: dict[str, Any]) -> dict[str, Any]:
    """A trace message as the chat template takes it (OpenAI's tool_calls shape)."""
    out = {"role": message["role"], "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in message["tool_calls"]]
    return out


def our_prompts(trace: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    """Each call's prompt as verl-hpc's agent loop builds it from the same messages and sampled ids."""
    from verl_hpc.roles.agent.render import ChatRenderer

    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
             for t in trace["tools"]]
    renderer = ChatRenderer(tokenizer, tools, TEMPLATE.read_text(), str(TEMPLATE))
    nodes, prompts, seen = trace["nodes"], [], 0
    for call in trace["calls"]:
        path = path_to(nodes, call["node"])
        messages = [wire(nodes[i]["message"]) for i in path[:-1]]
        if not prompts:
            prompts.append(renderer.prompt_ids(messages))
        else:
            last = nodes[path[seen]]
            sampled = [t for t, m in zip(last["token_ids"], last["mask"], strict=True) if m]
            close = tokenizer.eos_token if sampled and sampled[-1] == tokenizer.eos_token_id else ""
            prompts.append([*prompts[-1], *sampled, *renderer.delta_ids(messages[seen + 1:], close)])
        seen = len(path) - 1
    return prompts


def test_a_verifiers_tool_environment_runs_against_our_engine_with_our_token_ids(
        verifiers_venv: Path, served, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model, url, calls_file = served
    traces = run_vf_eval(verifiers_venv, model, url, tmp_path / "vf-out")
    engine_calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    assert len(traces) == 4 and all(t["ok"] and not t["errors"] for t in traces), [t["errors"] for t in traces]
    tool_episodes = 0
    for trace in traces:
        nodes = trace["nodes"]
        prompts = our_prompts(trace, tokenizer)
        for call, ours in zip(trace["calls"], prompts, strict=True):
            sampled = nodes[call["node"]]
            completion = [t for t, m in zip(sampled["token_ids"], sampled["mask"], strict=True) if m]
            ids = [t for i in path_to(nodes, call["node"]) for t in nodes[i]["token_ids"]]
            # the engine's own record of this call: the trace holds exactly its prompt and completion
            record = next(c for c in engine_calls if c["prompt_ids"] + c["completion_ids"] == ids)
            assert record["completion_ids"] == completion
            assert sampled["logprobs"] == pytest.approx(record["logprobs"], abs=5e-5)  # traces keep 4 decimals
            # and that prompt is the one verl-hpc's agent loop renders for these messages
            assert record["prompt_ids"] == ours, trace["id"]
        roles = [nodes[i]["message"]["role"] for i in path_to(nodes, trace["calls"][-1]["node"])]
        tool_episodes += len(trace["calls"]) > 1 and roles[-2] == "tool"
        assert set(trace["rewards"]) == {"correct"}
    assert tool_episodes >= 1  # the model called the tool and answered after its reply
    assert len(engine_calls) == sum(len(t["calls"]) for t in traces)


VLLM = ["resources.rollout.strategy=vllm",
        "resources.rollout.vllm_args={dtype: float32, enforce_eager: true, kv_cache_space_gb: 1}"]


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed"))])
def test_a_verifiers_environment_trains_on_its_traces(engine: str, verifiers_venv: Path, tmp_path: Path) -> None:
    """`source: verifiers` (configs/verifiers_calc.yaml): the rollout serves its own engine (HF or vLLM),
    verifiers' harness runs each row's episode against it, and the rows trained are the traces' token ids,
    loss masks and logprobs, scored by the traces' rewards; every call's prompt is the one our agent loop
    renders."""
    from transformers import AutoTokenizer

    from verl_hpc.data.rollout_batch import RolloutBatch

    model, run = smollm2_dir(), tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "verl_hpc", "train", "configs/verifiers_calc.yaml", "--run-dir", str(run),
         f"model.path={model}", "data.record_rollouts=true", "trainer.total_steps=2", "trainer.batch_size=2",
         f"rollout.multi_turn.environment.kwargs.python={verifiers_venv / 'bin' / 'python'}",
         "rollout.multi_turn.environment.kwargs.keep_traces=true", *(VLLM if engine == "vllm" else [])],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env=dict(os.environ))  # no verifiers on PATH: the rollout finds its venv from kwargs.python
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = {}
    for line in (run / "verifiers" / "traces.jsonl").read_text().splitlines():
        entry = json.loads(line)
        kept[entry["row"]] = entry["episode"]["traces"][0]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows = 0
    for step in (1, 2):
        (record,) = (run / "rollouts").glob(f"step_{step:08d}_rank*.arrow")
        batch = RolloutBatch.from_ipc(record.read_bytes())
        for row in batch.record_batch.to_pylist():
            trace = kept[f"episode-{step}-{row['group_id']}-{row['sample_index']}"]
            nodes = trace["nodes"]
            path = path_to(nodes, trace["calls"][-1]["node"])
            ids = [t for i in path for t in nodes[i]["token_ids"]]
            mask = [m for i in path for m in nodes[i]["mask"]]
            assert row["prompt_ids"] + row["response_ids"] == ids  # the trace's tokens, nothing re-tokenised
            assert [0] * len(row["prompt_ids"]) + row["loss_mask"] == [int(m) for m in mask]
            sampled = [lp for lp, m in zip(row["rollout_logprobs"], row["loss_mask"], strict=True) if m]
            assert sampled == pytest.approx([x for i in path for x in nodes[i]["logprobs"]], abs=1e-6)
            reward = sum(r["score"] * r["weight"] for r in trace["rewards"].values())
            assert row["score"] == pytest.approx(reward, abs=1e-6)
            for call, ours in zip(trace["calls"], our_prompts(trace, tokenizer), strict=True):
                upto = [t for i in path_to(nodes, call["node"]) for t in nodes[i]["token_ids"]]
                done = nodes[call["node"]]
                completion = [t for t, m in zip(done["token_ids"], done["mask"], strict=True) if m]
                assert upto == ours + completion  # the prompt our agent loop builds, then what was sampled
            rows += 1
    assert rows == 4  # 2 steps x 1 task x 2 samples
    metrics = [json.loads(line) for line in (run / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "actor/pg_loss" in m]
    assert len(trained) == 2 and all(m["env/failures"] == 0 and m["agent/num_turns/mean"] >= 1 for m in trained)


def test_verifiers_drivers_on_the_env_component_survive_a_killed_worker(verifiers_venv: Path, tmp_path: Path) -> None:
    """`resources.env` with a verifiers environment: each env task (started here as `srun` starts it) opens
    a driver on its node against the rollout's endpoint, a step's episodes spread over them, and kill -9 of
    one worker mid-step costs only the episodes it held: they fail, are counted and re-run on the worker its
    supervisor started again."""
    import signal
    import threading

    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.config import SamplingConfig, load_config
    from verl_hpc.roles.agent.verifiers import VerifiersRollout
    from verl_hpc.roles.env.remote import EnvHome, address_path, attempt_dir
    from verl_hpc.roles.rollout.base import stop_token_ids
    from verl_hpc.roles.rollout.hf import HFRolloutEngine
    from verl_hpc.transport.secret import create_run_secret

    model, run_dir = smollm2_dir(), tmp_path / "run"
    config = yaml.safe_load((REPO / "configs" / "verifiers_calc.yaml").read_text())
    config["model"]["path"] = str(model)
    config["rollout"]["multi_turn"]["environment"]["kwargs"]["python"] = str(verifiers_venv / "bin" / "python")
    config["resources"]["env"] = {"num_workers": 2}
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    token = create_run_secret(run_dir)
    tasks = [subprocess.Popen([sys.executable, "-m", "verl_hpc.roles.env.remote", str(run_dir)], cwd=REPO,
                              env={**os.environ, "SLURM_PROCID": str(i), "SLURM_JOB_ID": "77",
                                   "SLURM_RESTART_COUNT": "0", "PYTHONPATH": str(REPO)}) for i in range(2)]
    home = EnvHome(attempt_dir(run_dir, "77", 0), 2, token, 120.0)
    cfg = load_config(run_dir / "config.yaml")
    tok = AutoTokenizer.from_pretrained(str(model), padding_side="left")
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(str(model)), tok)
    rollout = VerifiersRollout(cfg.rollout.multi_turn, engine, str(model), stop_token_ids(tok, str(model)), 2048,
                               str(run_dir), home)
    victim = json.loads(address_path(home.directory, 0).read_text())["pid"]
    killer = threading.Timer(4.0, os.kill, (victim, signal.SIGKILL))  # mid-step: its episodes are running
    try:
        dataset = SimpleNamespace(answers=[""] * 2, data_sources=["vf"] * 2,
                                  extra_infos=[json.dumps({"env_seed": i}) for i in range(2)])
        killer.start()
        batch = rollout.rows(1, [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1, 1], dataset,
                             SamplingConfig(n=2, temperature=0.5, max_new_tokens=128), version=0)
    finally:
        killer.cancel()
        rollout.close()
        for task in tasks:
            task.send_signal(signal.SIGINT)
        for task in tasks:
            assert task.wait(timeout=30) == 0
    records = [json.loads(t) for t in batch.column("trajectory").to_pylist()]
    assert all(not r["env_failed"] for r in records)  # every episode answered in the end
    assert rollout.metrics()["env/failures"] == 2  # worker 0 held two of the four (every other one)
    assert rollout.driver.starts == 3  # two opened, the killed one reopened on its restarted worker
    assert all(r["num_turns"] >= 1 for r in records)
    for i in (0, 1):  # both nodes ran verifiers: each has its driver's log
        assert "rollout done" in (run_dir / "logs" / f"verifiers_driver_env{i}.log").read_text()
