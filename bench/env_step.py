"""Environment steps: what an environment's cost does to a rollout, per arrangement of its workers.

`python -m bench env_step`. TextArena's GuessTheNumber-v0, played for real, behind an OpenEnv
`Environment` class (`BusyGuess`) whose every step also costs `work_ms` — of CPU (`cpu`: a
simulator's work) or of waiting (`wait`: a remote service) — played by the tiny-agent model with a
head that ends a turn with probability 1/6 per token, so every episode reaches the environment on
most turns. The model's text does not steer the game (a tiny tokenizer cannot spell a guess): each
turn guesses a number drawn from the episode's seed, which is what a timing harness needs; the
game's hints come back as they are, its 500-character rules as one short line (the tiny model has
256 positions).

Each repetition samples the same episodes (seeded, `deterministic_rounds`) in every arrangement,
one after the other, and times the rollout of the whole batch (the update after it is the same in
every arrangement):

- `free`: the environment costs nothing (`work_ms: 0`), in threads of the rollout process;
- `threads`: the environment in threads of the rollout process (the in-rollout-process arrangement);
- `workers`: in `WORKERS` environment worker processes (`environment.num_workers`);
- `openenv_server`: through OpenEnv's own server (`create_app`, a WebSocket session per episode),
  against `in_process`: the same class in threads of the rollout process.

Targets (issue: environments at cluster scale): `workers` <= 1.15x `free` with 50 ms of CPU per step;
the server <= 1.2x in-process.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench import summary as _summary

WORKERS_TARGET, SERVER_TARGET = 1.15, 1.2
WORKERS = 4
END_PROBABILITY = 1 / 6  # per token: turns of ~6 tokens, closed, so they reach the environment
THIS = f"{Path(__file__).resolve()}:BusyGuess"


def _openenv_types():  # imported late: openenv-core is an optional extra
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class GuessAction(Action):
        message: str

    class GuessObservation(Observation):
        prompt: str

    return Environment, GuessAction, GuessObservation, State


try:
    Environment, GuessAction, GuessObservation, State = _openenv_types()
except ImportError:  # run() says what to install
    Environment = GuessAction = GuessObservation = State = object  # type: ignore[misc,assignment]


class BusyGuess(Environment):  # type: ignore[misc,valid-type]
    """GuessTheNumber-v0 from TextArena, each step costing `work_ms` of CPU (`cpu`) or of waiting."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, work_ms: float = 50.0, kind: str = "cpu"):
        super().__init__()
        from verl_hpc.roles.env.sources import TextArenaEnvironment

        self.game, self.work_s, self.kind = TextArenaEnvironment("GuessTheNumber-v0"), work_ms / 1000, kind
        self.guesses, self._state = list(range(1, 21)), State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Any:
        # distinct guesses (a repeated one is an invalid move), not drawn from Random(seed): TextArena draws
        # its number from `random.seed(seed)`, so the first guess would always win
        self.guesses = random.Random(f"guesses-{seed}").sample(range(1, 21), 20)
        self._state = State(episode_id=episode_id, step_count=0)
        self.game.reset(seed=seed)  # its 500-character rules would fill the tiny model's 256 positions:
        return GuessObservation(prompt="guess the number, 1 to 20")  # the hints after each guess are its own

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        self._state.step_count += 1
        _spend(self.work_s, self.kind)
        reply = self.game.step(f"[{self.guesses.pop()}]")
        return GuessObservation(prompt=reply.text, reward=reply.reward, done=reply.done)

    @property
    def state(self) -> Any:
        return self._state


def _spend(seconds: float, kind: str) -> None:
    if kind == "wait":
        time.sleep(seconds)
        return
    start = time.thread_time()  # this thread's CPU: threads of one worker each burn their own share
    while time.thread_time() - start < seconds:
        pass


def _ending_policy(model_dir: Path) -> torch.nn.Module:
    """The tiny-agent model with a head that picks uniformly, ending a turn with END_PROBABILITY."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.models.tiny_agent import EOT

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    vocab = model.config.vocab_size
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        tok = AutoTokenizer.from_pretrained(model_dir)
        end = tok.convert_tokens_to_ids(EOT)
        head.bias[end] = math.log(END_PROBABILITY / (1 - END_PROBABILITY) * (vocab - 1))
        for token, index in tok.get_vocab().items():  # no tool calls: every closed turn goes to the game
            if "tool" in token:
                head.bias[index] = -30.0
    model.lm_head = head
    return model


def _agent(model: torch.nn.Module, model_dir: Path, env: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    from verl_hpc.config.multi_turn import EnvironmentConfig, MultiTurnConfig
    from verl_hpc.roles.agent import AgentRollout
    from verl_hpc.roles.agent.build import max_context
    from verl_hpc.roles.rollout.base import stop_token_ids
    from verl_hpc.roles.rollout.hf import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    cfg = MultiTurnConfig(enable=True, environment=EnvironmentConfig(**env, timeout_seconds=600, workers=256),
                          max_assistant_turns=4, deterministic_rounds=True)
    return AgentRollout(cfg, HFRolloutEngine(model, tok), tok, stop_token_ids(tok, str(model_dir)),
                        max_context(str(model_dir)))


def _rollout_seconds(agent: Any, episodes: int, rep: int) -> tuple[float, dict[str, float]]:
    from verl_hpc.config import SamplingConfig

    data = SimpleNamespace(prompts=[[{"role": "system", "content": "guess the number"}]] * episodes,
                           answers=[""] * episodes, data_sources=[None] * episodes,
                           extra_infos=[json.dumps({"env_seed": rep * 10_000 + i}) for i in range(episodes)])
    torch.manual_seed(rep)
    start = time.perf_counter()
    agent.rows(1, list(range(episodes)), [0] * episodes, list(range(episodes)), data,
               SamplingConfig(n=1, max_new_tokens=32), version=0)
    return time.perf_counter() - start, agent.metrics()


class _Server:
    """OpenEnv's own server for BusyGuess, in a process of its own."""

    def __init__(self, work_ms: float, kind: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.env_step", str(port), str(work_ms), kind],
                                     cwd=Path(__file__).resolve().parents[1])
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"the OpenEnv server did not start (exit code {self.proc.poll()})") from None
                time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def measure(kind: str, work_ms: float, episodes: int, reps: int, work: Path, quick: bool = False) -> dict[str, Any]:
    """Every arrangement, once per repetition, on the same episodes (`quick`: one worker process and no
    server, a smoke test of the code)."""
    from verl_hpc.models.tiny import init_model

    model_dir = init_model(work / "tiny-agent", preset="tiny-agent", seed=0)
    model = _ending_policy(model_dir)
    kwargs = {"work_ms": work_ms, "kind": kind}
    server = None if quick else _Server(work_ms, kind)
    arrangements = {
        "free": {"source": "python", "id": THIS, "kwargs": {"work_ms": 0.0}},
        "threads": {"source": "python", "id": THIS, "kwargs": kwargs},
        "workers": {"source": "python", "id": THIS, "kwargs": kwargs, "num_workers": 1 if quick else WORKERS}}
    if server is not None:
        arrangements["openenv_server"] = {"source": "openenv_server", "id": server.url}
    agents = {name: _agent(model, model_dir, env) for name, env in arrangements.items()}
    seconds: dict[str, list[float]] = {name: [] for name in agents}
    env_steps: list[float] = []
    try:
        for rep in range(reps + 1):  # repetition 0: a warm-up, dropped
            for name, agent in agents.items():
                took, metrics = _rollout_seconds(agent, episodes, rep)
                if rep:
                    seconds[name].append(took)
                    env_steps.append(metrics.get("env/steps/mean", 0.0))
    finally:
        for agent in agents.values():
            agent.close()
        if server is not None:
            server.close()
    ratio = lambda a, b: _summary([x / y for x, y in zip(seconds[a], seconds[b], strict=True)])  # noqa: E731
    ratios = {"workers_vs_free": ratio("workers", "free"), "threads_vs_free": ratio("threads", "free")}
    if server is not None:
        ratios["openenv_server_vs_in_process"] = ratio("openenv_server", "threads")
    return {"kind": kind, "work_ms": work_ms, "episodes": episodes, "env_steps_per_episode": _summary(env_steps),
            "rollout_s": {name: _summary(v) for name, v in seconds.items()}, "ratios": ratios}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    import importlib.util

    out: dict[str, Any] = {"quick": quick, "targets": {"workers_vs_free": WORKERS_TARGET,
                                                       "openenv_server_vs_in_process": SERVER_TARGET}}
    missing = [m for m in ("textarena", "openenv") if importlib.util.find_spec(m) is None]
    if missing:
        out["skipped"] = f"{' and '.join(missing)} not installed: pip install -e '.[envs]'"
        return out
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_env_", dir=scratch))
    episodes, reps, kinds = (8, 1, ("wait",)) if quick else (256, 3, ("cpu", "wait"))  # quick: a smoke test
    out["runs"] = {kind: measure(kind, 50.0, episodes, reps, work, quick) for kind in kinds}
    out["ratios"] = {f"{kind}/{name}": value for kind, result in out["runs"].items()
                     for name, value in result["ratios"].items()}
    return out


def table(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return f"environment step benchmark: skipped: {result['skipped']}"
    lines = ["environment step benchmark: GuessTheNumber-v0 behind an OpenEnv class, each step costing 50 ms; "
             "rollout seconds of the same episodes per arrangement (median over repetitions)"]
    for kind, run in result["runs"].items():
        steps = run["env_steps_per_episode"]["median"]
        lines.append(f"{kind} ({run['episodes']} episodes, {steps:.2f} environment steps each):")
        lines += [f"  {name:<16}{value['median']:>8.2f} s" for name, value in run["rollout_s"].items()]
        ratios = run["ratios"]
        workers = ratios["workers_vs_free"]["median"]
        line = (f"  threads / free {ratios['threads_vs_free']['median']:.2f}x; target: workers / free <= "
                f"{WORKERS_TARGET}x: {_verdict(workers, WORKERS_TARGET)} ({workers:.2f}x)")
        if "openenv_server_vs_in_process" in ratios:
            server = ratios["openenv_server_vs_in_process"]["median"]
            line += f"; target: server / in-process <= {SERVER_TARGET}x: {_verdict(server, SERVER_TARGET)} ({server:.2f}x)"
        lines.append(line)
    return "\n".join(lines)


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else "MISSED"


def serve(port: int, work_ms: float, kind: str) -> None:
    """BusyGuess behind OpenEnv's own server (FastAPI, a WebSocket session per episode)."""
    import functools

    import uvicorn
    from openenv.core.env_server.http_server import create_app

    make = functools.partial(BusyGuess, work_ms=work_ms, kind=kind)
    app = create_app(make, GuessAction, GuessObservation, max_concurrent_envs=512)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    serve(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
