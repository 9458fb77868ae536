"""`verl-hpc serve MODEL_DIR|CONFIG`: a policy behind vLLM's token-level generate endpoint.

Why a command: harnesses that drive their own episodes (verifiers, prime-rl's environments) call the
model over HTTP with token ids; serving the run's model (or an exported checkpoint) from the project's
own rollout engine lets such an environment run against it, and `--calls` keeps the engine's record
of every call to check the harness's traces against.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_hpc.config import ConfigError

if TYPE_CHECKING:
    from verl_hpc.roles.rollout.serve import GenerateServer


@dataclass(frozen=True)
class ServeSpec:
    """The model to load, the name requests give it, its engine and the default token limit."""

    model_dir: str
    name: str
    resources: Any
    max_tokens: int
    timeout: float



def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a policy at POST /inference/v1/generate (token ids in and out)")
    p.add_argument("target", help="a Hugging Face model directory (the HF engine), or a run config YAML (its "
                   "model.path on resources.rollout's engine, algorithm.sampling.max_new_tokens as the default)")
    p.add_argument("overrides", nargs="*", help="Hydra-style key.path=value overrides (with a config)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--max-tokens", type=int, help="a request's token limit when it sets none (default: the "
                   "config's algorithm.sampling.max_new_tokens; 256 for a model directory)")
    p.add_argument("--calls", help="append every call (prompt and completion ids, logprobs) to this JSON-lines file")
    p.add_argument("--token-env", metavar="VAR",
                   help="require `Authorization: Bearer $VAR` (the token is read from the environment, never argv)")
    p.set_defaults(func=_cmd_serve)


def _token(var: str | None) -> str | None:
    if var is None:
        return None
    value = os.environ.get(var)
    if not value:
        raise ConfigError("--token-env", f"${var} is not set or empty", f"export {var}=<a secret> first")
    return value


def served_from(target: str, overrides: list[str], max_tokens: int | None) -> ServeSpec:
    """What `serve TARGET` serves: a model directory alone, or a run config's model on its rollout engine."""
    import torch

    from verl_hpc.config import load_config
    from verl_hpc.config.resources import RoleResources

    if Path(target).is_dir():
        if overrides:
            raise ConfigError("overrides", f"{' '.join(overrides)}: overrides need a config, not a model directory",
                              "pass a run config YAML, or drop the overrides")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return ServeSpec(target, target, RoleResources(strategy="hf", device_type=device), max_tokens or 256, 180.0)
    if not Path(target).is_file():
        raise ConfigError("target", f"{target}: no such model directory or config file",
                          "pass a Hugging Face model directory or a run config YAML")
    cfg = load_config(target, overrides)
    from verl_hpc.runtime.build import ensure_model

    return ServeSpec(str(ensure_model(cfg)), str(cfg.model.path), cfg.resources.rollout,
                     max_tokens or cfg.algorithm.sampling.max_new_tokens, cfg.resources.timeout_seconds)


def _cmd_serve(args: argparse.Namespace) -> int:
    from verl_hpc.roles.rollout.serve import GENERATE_PATH

    token = _token(args.token_env)
    spec = served_from(args.target, args.overrides, args.max_tokens)
    server = build_server(spec, args.host, args.port, token, Path(args.calls) if args.calls else None)
    print(f"verl-hpc serve: {server.url}{GENERATE_PATH}  model {spec.name}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a scheduler's stop ends it like Ctrl-C
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.close()
    return 0


def build_server(spec: ServeSpec, host: str, port: int, token: str | None, calls: Path | None) -> GenerateServer:
    """The `GenerateServer` for `spec` (not started): its engine built as a run's rollout role builds it."""
    import torch
    from transformers import AutoTokenizer

    from verl_hpc.roles.agent.build import max_context
    from verl_hpc.roles.rollout.base import stop_token_ids
    from verl_hpc.roles.rollout.factory import build_engine
    from verl_hpc.roles.rollout.serve import GenerateServer, ServedModel

    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir, padding_side="left")
    device = torch.device("cuda" if spec.resources.device_type == "cuda" else "cpu")
    engine = build_engine(spec.resources, spec.model_dir, tokenizer, device, colocated=False, timeout=spec.timeout)
    model = ServedModel(spec.name, max_context(spec.model_dir), spec.max_tokens)
    try:
        return GenerateServer(engine, model, stop_token_ids(tokenizer, spec.model_dir), host=host, port=port,
                              token=token, calls_path=calls)
    except OSError as err:
        raise ConfigError("--port", f"cannot listen on {host}:{port}: {err.strerror}",
                          "pick a free port, or --port 0 for any") from None


SERVE_PARSERS = (_add_serve,)
