"""Rollouts with vLLM, whose weights follow the actor in place after every update.

Why a child process (see vllm_server): vLLM owns a torch.distributed world and the
thread count of the process it runs in. The engine is started once per run, kept warm,
and fed new weights as a safetensors file in shared memory; its logprobs are those of
the distribution it sampled from, computed by vLLM, so the trainer can check drift.

Colocated on GPU the engine sleeps between rollouts (weights to host memory, KV cache
freed) and wakes in two stages: weights first, to take the update, and the KV cache
only when generation starts — waking both before the update holds two copies of the
model and the cache at once, the OOM peers hit at the train-to-rollout switch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch

from verl_hpc.config import SamplingConfig
from verl_hpc.config.resources import VllmArgs
from verl_hpc.roles.rollout.base import Generation
from verl_hpc.utils.child import accept_child

log = logging.getLogger(__name__)

# Variables that would make vLLM join (or collide with) the job's own torch.distributed world.
_WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
DEFAULT_CPU_KV_CACHE_GB = 1.0


class EngineError(RuntimeError):
    """The engine process failed or stopped answering; the message carries its traceback."""


def engine_environment(parent: dict[str, str], device_type: str, device_ids: list[int] | None,
                       args: VllmArgs) -> dict[str, str]:
    """The child's environment: the parent's minus the job's rank variables, plus vLLM's knobs.

    GPUs: with `device_ids` (the embedded runtime, which sees every GPU) the configured ids,
    mapped through the parent's own CUDA_VISIBLE_DEVICES; without (a launched rank, whose
    launcher or Slurm already narrowed visibility to its slot) the parent's GPUs as they are.
    """
    env = {k: v for k, v in parent.items() if k not in _WORLD_VARIABLES and not k.startswith("TORCHELASTIC_")}
    tp = args.tensor_parallel_size
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs inside the child itself
    elif device_type == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        # vLLM's automatic binding wants one NUMA node per CPU worker; split our cores instead.
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(sorted(os.sched_getaffinity(0)), tp)
    if device_type == "cuda" and device_ids is not None:
        visible = parent.get("CUDA_VISIBLE_DEVICES")
        listed = visible.split(",") if visible else None
        if listed is not None and max(device_ids) >= len(listed):
            raise ValueError(f"rollout device ids {device_ids} are not all among CUDA_VISIBLE_DEVICES={visible}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(listed[i] if listed else str(i) for i in device_ids)
    return env


def cpu_binding(cores: list[int], workers: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers: contiguous core ranges, '|'-separated
    (workers share the cores round-robin when there are fewer cores than workers)."""
    if len(cores) < workers:
        return "|".join(str(cores[i % len(cores)]) for i in range(workers))
    per = len(cores) // workers
    parts = [cores[i * per:(i + 1) * per] for i in range(workers)]
    return "|".join(",".join(str(c) for c in part) for part in parts)


def engine_options(model_dir: str, device_type: str, args: VllmArgs, colocated: bool) -> dict[str, Any]:
    """The LLM(...) arguments, JSON-safe (they travel on the child's command line)."""
    kv_gb = args.kv_cache_space_gb or (DEFAULT_CPU_KV_CACHE_GB if device_type == "cpu" else None)
    return {"model": model_dir, "dtype": args.dtype, "seed": args.seed, "enforce_eager": args.enforce_eager,
            "tensor_parallel_size": args.tensor_parallel_size,
            "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
            "kv_cache_memory_bytes": int(kv_gb * 2**30) if kv_gb else None,
            "enable_sleep_mode": device_type == "cuda" and (args.enable_sleep_mode or colocated)}


# Starting an engine imports vLLM, loads the model and allocates its KV cache: minutes on a loaded
# CPU machine, far longer than one step's collective (resources.timeout_seconds, 60 s in the colocated
# example). The child is polled while it starts, so a crash still fails at once; only a hung start
# waits this long.
ENGINE_START_ALLOWANCE_S = 600.0


class VLLMRolloutEngine:
    starts = 0  # engines started by this process; a run starts one per rollout rank, never one per step

    def __init__(self, model_dir: str, pad_id: int | None, args: VllmArgs, device_type: str = "cpu",
                 device_ids: list[int] | None = None, colocated: bool = False, timeout: float = 600.0,
                 log_file: Path | None = None, eos_ids: list[int] | None = None):
        self.model_dir, self.pad_id, self.timeout = model_dir, pad_id, timeout
        self.eos_ids = list(eos_ids or [])  # stop on exactly what the HF engine stops on (base.stop_token_ids)
        self.options = engine_options(model_dir, device_type, args, colocated)
        self.policy_version = 0
        self.last_update: tuple[int, float] = (0, 0.0)  # bytes, seconds of the latest weight update
        self._asleep: set[str] = set()
        self._specs: list[tuple[str, torch.Size]] | None = None
        self._shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self._start(engine_environment(dict(os.environ), device_type, device_ids, args), log_file)

    def _start(self, env: dict[str, str], log_file: Path | None) -> None:
        started = time.monotonic()
        self._sock_dir = tempfile.mkdtemp(prefix="verl-hpc-engine-")  # 0700: only this user can connect
        address = os.path.join(self._sock_dir, "engine.sock")
        key = secrets.token_bytes(32)
        listener = Listener(address, family="AF_UNIX", authkey=key)
        out = open(log_file, "ab") if log_file is not None else None  # noqa: SIM115 - lives with the child
        cmd = [sys.executable, "-m", "verl_hpc.roles.rollout.vllm_server", address, json.dumps(self.options)]
        # Its own session: under Slurm, srun relays a preemption notice (USR1) to the rank's whole
        # process group, and USR1 kills a process without a handler; the rank stops it itself.
        self.process = subprocess.Popen(cmd, env={**env, "VERL_HPC_ENGINE_KEY": key.hex()},
                                        stdout=out, stderr=subprocess.STDOUT if out else None,
                                        start_new_session=True)
        try:
            start_timeout = max(self.timeout, ENGINE_START_ALLOWANCE_S)
            self.conn = accept_child(listener, self.process, start_timeout, "vllm engine", EngineError)
            info = self._reply("start", start_timeout)
        except BaseException:
            listener.close()
            self.close()
            raise
        finally:
            if out is not None:
                out.close()
        listener.close()
        VLLMRolloutEngine.starts += 1
        log.info("vllm engine started: pid %d, %.1fs (%s)", info["pid"], time.monotonic() - started,
                 ", ".join(f"{k}={v}" for k, v in self.options.items() if k != "model"))

    def _reply(self, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if self.process.poll() is not None:
                raise EngineError(f"vllm engine (pid {self.process.pid}) died during '{what}' "
                                  f"(exit code {self.process.returncode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm engine (pid {self.process.pid}) timed out: no answer to '{what}' "
                                   f"within {timeout:.0f}s")
        status, payload = self.conn.recv()
        if status != "ok":
            raise EngineError(f"vllm engine failed in '{what}':\n{payload}")
        return payload

    def call(self, command: str, payload: Any = None) -> Any:
        self.conn.send((command, payload))
        return self._reply(command, self.timeout)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                 stop_token_ids: Sequence[int] = (), max_tokens: Sequence[int] | None = None) -> Generation:
        """One request per prompt. `stop_token_ids`: more ids that end a response (a multi-turn turn's
        end-of-turn or tool-call end tag); `max_tokens`: each request's own limit (an episode's
        remaining budget)."""
        # One seed per request, drawn from the trainer's per-step RNG: a resumed run
        # samples exactly what the uninterrupted run sampled.
        seeds = torch.randint(0, 2**31 - 1, (len(prompt_ids),)).tolist()
        responses, logprobs = self.call("generate", self._request(prompt_ids, seeds, sampling, stop_token_ids,
                                                                  max_tokens))
        return Generation(responses, logprobs)

    def _request(self, prompt_ids: list[list[int]], seeds: list[int], sampling: SamplingConfig,
                 stop_token_ids: Sequence[int], max_tokens: Sequence[int] | None) -> dict[str, Any]:
        stops = [*self.eos_ids, *(int(t) for t in stop_token_ids if int(t) not in self.eos_ids)]
        return {"prompt_ids": prompt_ids, "seeds": seeds, "pad_id": self.pad_id, "eos_ids": stops,
                "sampling": sampling.model_dump(include={"temperature", "top_p", "top_k", "max_new_tokens", "stop"}),
                "max_tokens": list(max_tokens) if max_tokens else None}

    def submit(self, keys: list[int], prompt_ids: list[list[int]], seeds: list[int], sampling: SamplingConfig,
               stop_token_ids: Sequence[int] = (), max_tokens: Sequence[int] | None = None) -> None:
        """Requests that join the engine's running batch now (continuous batching); `poll` returns
        them, by `keys`, as they finish. The caller gives each its seed: when a request is
        submitted depends on tool latency, so its seed must not depend on the order."""
        request = self._request(prompt_ids, seeds, sampling, stop_token_ids, max_tokens)
        self.call("submit", {**request, "keys": list(keys)})

    def poll(self, wait: float) -> list[tuple[int, list[int], list[float]]]:
        """[(key, sampled ids, logprobs)] of submitted requests that finished: the engine steps until
        one does or `wait` seconds pass."""
        return [(key, list(ids), list(logprobs)) for key, ids, logprobs in self.call("poll", wait)]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the served weights in place (no restart); records bytes and seconds."""
        started = time.monotonic()
        from safetensors.torch import save_file

        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        fd, path = tempfile.mkstemp(prefix="verl-hpc-weights-", suffix=".safetensors", dir=self._shm)
        os.close(fd)
        try:
            save_file(tensors, path)
            if "weights" in self._asleep:
                self.call("wake", ["weights"])
                self._asleep.discard("weights")
            self.call("reload", path)
        finally:
            os.unlink(path)
        moved = sum(t.numel() * t.element_size() for t in tensors.values())
        self.last_update = (moved, time.monotonic() - started)
        self.policy_version = version
        log.debug("vllm weights v%d: %d bytes in %.3fs", version, moved, self.last_update[1])

    def weight_specs(self) -> list[tuple[str, torch.Size]]:
        """(name, shape) of every parameter the trainer sends, from the config alone (no memory)."""
        if self._specs is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir))
            self._specs = [(name, p.shape) for name, p in model.named_parameters()]
        return self._specs

    def sleep(self) -> None:
        if self.options["enable_sleep_mode"] and not self._asleep:
            self.call("sleep")
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        if self._asleep:
            self.call("wake", sorted(self._asleep))
            self._asleep.clear()

    def close(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            try:
                self.conn.send(("close", None))
                process.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a dead or stuck engine is killed below
                pass
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(getattr(self, "_sock_dir", ""), ignore_errors=True)

    def __del__(self) -> None:  # a forgotten engine still goes away with its owner
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn modules down
            self.close()
