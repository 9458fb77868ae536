"""Runs verifiers episodes for verl-hpc's rollout: a child process under verifiers' own Python.

Why a child in another venv: verifiers 0.4.0 pins packages verl-hpc's training stack does not (its own
pydantic, MCP, uv-managed harnesses), and its control is inverted: its harness drives each episode and
calls the model through an endpoint. So verl-hpc serves its rollout engine at that endpoint and starts
this script with verifiers' interpreter; the script loads the environment exactly as `vf-eval` does
(the same flags: `--env.*`, `--client.renderer.*`, ...), then runs one episode per request line and
answers each with the episode verifiers recorded: its traces' token ids, masks and logprobs are the
trajectory the trainer scores.

Wire (JSON lines): stdin takes `{"id", "task", "sampling"}` (run task `task` modulo the taskset's
size) or `{"cancel": id}`; stdout gives `{"ready": true, "tasks": N}` once, then `{"id", "episode"}`
or `{"id", "error"}` per request. Everything else this process or verifiers prints goes to stderr.
This file imports only the standard library and verifiers: verl-hpc is not installed here.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any, TextIO


def protocol_stream() -> TextIO:
    """Stdout kept for the wire alone: print()s of verifiers or a harness go to stderr instead."""
    wire = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return wire


def load(argv: list[str]) -> tuple[Any, Any, list[Any]]:
    """(the eval config, the environment, its tasks) from vf-eval's own flags."""
    from pydantic_config import cli
    from verifiers.v1.cli.resolve import narrow_config, plugin_errors, with_positional_taskset
    from verifiers.v1.configs.cli.eval import EvalConfig
    from verifiers.v1.utils.loaders import load_environment
    from verifiers.v1.utils.logging import setup_logging

    setup_logging("INFO")
    argv = with_positional_taskset(list(argv))
    with plugin_errors():
        config_type = narrow_config(EvalConfig, argv)
        sys.argv = ["verl-hpc-verifiers", *argv]
        config = cli(config_type)
    env = load_environment(config.env)
    taskset = env.taskset.select(config.select)
    if not taskset.bounded:
        raise SystemExit(f"{type(taskset).__name__} is infinite: bound it (--num-examples)")
    return config, env, list(taskset)


class Driver:
    """Requests in, episodes out; every episode a task of one event loop."""

    def __init__(self, config: Any, env: Any, tasks: list[Any], wire: TextIO):
        self.config, self.env, self.tasks, self.wire = config, env, tasks, wire
        self.running: dict[str, asyncio.Task] = {}

    def send(self, line: str) -> None:
        """One wire line; only the event loop's thread writes, so lines never interleave."""
        self.wire.write(line + "\n")
        self.wire.flush()

    async def episode(self, request: dict[str, Any]) -> None:
        from verifiers.v1.clients import ModelContext

        rid = str(request["id"])
        try:
            sampling = self.config.sampling.model_copy(update=dict(request.get("sampling") or {}))
            ctx = ModelContext(client=self.config.client, model=self.config.model, sampling=sampling)
            (slot,) = self.env.slots(self.tasks[int(request["task"]) % len(self.tasks)])
            done = await self.env.run_slot(slot, ctx)
            self.send(f'{{"id": {json.dumps(rid)}, "episode": {done.model_dump_json()}}}')
        except asyncio.CancelledError:
            self.send(json.dumps({"id": rid, "error": "cancelled: the rollout gave up on it"}))
        except Exception as err:  # noqa: BLE001 - one episode's failure is data, not the driver's end
            self.send(json.dumps({"id": rid, "error": f"{type(err).__name__}: {err}"}))
        finally:
            self.running.pop(rid, None)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        async with self.env.serving():
            self.send(json.dumps({"ready": True, "tasks": len(self.tasks)}))
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                request = json.loads(line)
                if "cancel" in request:
                    task = self.running.get(str(request["cancel"]))
                    if task is not None:
                        task.cancel()
                    continue
                self.running[str(request["id"])] = asyncio.create_task(self.episode(request))
            for task in list(self.running.values()):  # stdin closed: the rollout is gone
                task.cancel()


def main(argv: list[str]) -> None:
    wire = protocol_stream()
    config, env, tasks = load(argv)
    asyncio.run(Driver(config, env, tasks, wire).serve())


if __name__ == "__main__":
    main(sys.argv[1:])
