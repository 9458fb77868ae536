"""The vLLM engine's own process: `python -m verl_hpc.roles.rollout.vllm_server ADDRESS OPTIONS`.

Why a separate process: vLLM builds a torch.distributed world of its own (size 1, or
the tensor-parallel size) and pins the process's thread count; inside a trainer or
rollout rank that already belongs to the job's world, either would break the job. The
parent starts this process once per run with the torchrun/Slurm rank variables removed,
and talks to it over an authenticated local socket: generate, submit and poll (requests
joining the running batch one by one), reload weights, sleep, wake, close. The engine runs in-process here (no third process), which starts in
seconds rather than the tens of seconds of vLLM's multiprocess client.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Client
from typing import Any

EXTENSION = "verl_hpc.roles.rollout.vllm_worker.WeightReloadExtension"


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so a killed rank leaves no engine behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def build_llm(options: dict[str, Any]):
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=options["model"], dtype=options["dtype"], seed=options["seed"],
        enforce_eager=options["enforce_eager"], tensor_parallel_size=options["tensor_parallel_size"],
        gpu_memory_utilization=options["gpu_memory_utilization"], enable_sleep_mode=options["enable_sleep_mode"],
        # Logprobs of the distribution actually sampled from (temperature applied), the
        # same quantity the trainer recomputes; raw logprobs would ignore the temperature.
        logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION, disable_log_stats=True)
    for optional in ("max_model_len", "kv_cache_memory_bytes"):
        if options.get(optional):
            kwargs[optional] = options[optional]
    return LLM(**kwargs)


def _requests(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """(prompts, sampling params) of a generate or submit request: one seed and token limit each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    s = request["sampling"]
    bias = {request["pad_id"]: -100.0} if request["pad_id"] is not None else None  # vLLM clamps to ±100
    limits = request.get("max_tokens") or [s["max_new_tokens"]] * len(request["seeds"])
    params = [SamplingParams(n=1, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"] or 0,
                             max_tokens=limit, stop=s["stop"] or None, logprobs=0, seed=seed,
                             logit_bias=bias, stop_token_ids=request.get("eos_ids") or None)
              for seed, limit in zip(request["seeds"], limits, strict=True)]
    return [TokensPrompt(prompt_token_ids=ids) for ids in request["prompt_ids"]], params


def _sampled(out: Any) -> tuple[list[int], list[float]]:
    sample = out.outputs[0]
    tokens = list(sample.token_ids)
    return tokens, [float(step[token].logprob) for token, step in zip(tokens, sample.logprobs, strict=True)]


def generate(llm, request: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
    prompts, params = _requests(request)
    sampled = [_sampled(out) for out in llm.generate(prompts, params, use_tqdm=False)]
    return [tokens for tokens, _ in sampled], [logprobs for _, logprobs in sampled]


class Stream:
    """Requests submitted one turn at a time and taken back as they finish (continuous batching).

    Why: an agent episode's next turn can start only once its tool replied; with `submit` it
    joins the engine's running batch at once, instead of waiting for a round of other
    episodes' turns to end. vLLM's scheduler adds it at its next step.
    """

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}  # vLLM's request id (as its outputs carry it) -> the caller's key

    def submit(self, llm, request: dict[str, Any]) -> None:
        prompts, params = _requests(request)
        for rid, key in zip(llm.enqueue(prompts, params, use_tqdm=False), request["keys"], strict=True):
            self.keys[rid.split("-", 1)[0]] = key  # outputs carry the id without vLLM's random suffix

    def poll(self, llm, wait: float) -> list[tuple[Any, list[int], list[float]]]:
        """Engine steps until a request finished or `wait` seconds passed: [(key, ids, logprobs)]."""
        deadline = time.monotonic() + wait
        finished: list[tuple[Any, list[int], list[float]]] = []
        engine = llm.llm_engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.append((self.keys.pop(out.request_id), *_sampled(out)))
            if finished or time.monotonic() > deadline:
                break
        return finished


def handle(llm, command: str, payload: Any, sleep_mode: bool, stream: Stream) -> Any:
    if command == "generate":
        return generate(llm, payload)
    if command == "submit":
        return stream.submit(llm, payload)
    if command == "poll":
        return stream.poll(llm, payload)
    if command == "reload":
        return sum(llm.collective_rpc("verl_hpc_reload", args=(payload,)))
    if command == "sleep":
        if sleep_mode:
            llm.sleep(level=1)  # weights to host memory, KV cache discarded
        return None
    if command == "wake":
        if sleep_mode:
            llm.wake_up(tags=payload)
        return None
    if command == "close":
        return None
    raise ValueError(f"unknown command {command!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    address, options = argv[0], json.loads(argv[1])
    authkey = bytes.fromhex(os.environ.pop("VERL_HPC_ENGINE_KEY"))
    _die_with_parent()
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    started = time.monotonic()
    try:
        llm = build_llm(options)
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return 1
    conn.send(("ok", {"pid": os.getpid(), "seconds": time.monotonic() - started}))
    stream = Stream()
    while True:
        try:
            command, payload = conn.recv()
        except EOFError:  # the parent went away
            return 0
        try:
            result = handle(llm, command, payload, options["enable_sleep_mode"], stream)
        except Exception:  # noqa: BLE001 - the parent decides whether this is fatal
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))
        if command == "close":
            return 0


if __name__ == "__main__":
    sys.exit(main())
