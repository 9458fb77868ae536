"""The rollout engine behind an HTTP generate endpoint, for harnesses that drive their own episodes.

Why: verifiers' harnesses (prime-rl's environments) own the agent loop and reach the model through
`POST /inference/v1/generate`: token ids in, sampled token ids and their logprobs out. The tokens a
trace records are then exactly the ones the engine sampled, with no re-tokenisation of text between
them, which is what training on those traces needs. Requests that arrive together are sampled in one
engine call, as the agent loop batches the turns of many episodes. Every call can be appended to a
JSON-lines file (`calls_path`): the engine's own record, to check a harness's traces against.
"""

from __future__ import annotations

import hmac
import json
import queue
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from verl_hpc.config import SamplingConfig
from verl_hpc.roles.rollout.base import RolloutEngine

GENERATE_PATH = "/inference/v1/generate"


class RequestError(ValueError):
    """A request the server refuses: `status` is the HTTP code, the message names the field."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenerateCall:
    """One request's prompt and sampling settings; calls with equal `batch_key`s share an engine call."""

    prompt_ids: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: tuple[int, ...]

    @property
    def batch_key(self) -> tuple[float, float, int, tuple[int, ...]]:
        return (self.temperature, self.top_p, self.top_k, self.stop_token_ids)


def _number(params: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"sampling_params.{key}: {value!r} is not a number in [{low}, {high}]")
    return float(value)


def parse_generate(body: Any, default_max_tokens: int, context_len: int | None) -> GenerateCall:
    """The `GenerateCall` a `/inference/v1/generate` body asks for; `RequestError` names a bad field.

    Temperature 0 (greedy, as vLLM reads it) samples from the top token alone. `n` above 1 is refused:
    a harness asks once per episode turn, and a group is many episodes.
    """
    if not isinstance(body, dict):
        raise RequestError("the body is not a JSON object")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise RequestError("token_ids: a non-empty list of token ids is required (the rendered prompt)")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError("sampling_params: not a JSON object")
    if params.get("n", 1) != 1:
        raise RequestError(f"sampling_params.n: {params['n']!r}; this endpoint samples one response per request")
    temperature = _number(params, "temperature", 1.0, 0.0, 100.0)
    top_k = int(_number(params, "top_k", 0, -1, 1 << 30))
    if temperature == 0.0:
        temperature, top_k = 1.0, 1
    room = context_len - len(ids) if context_len is not None else None
    if room is not None and room < 1:
        raise RequestError(f"token_ids: the prompt's {len(ids)} tokens fill the model's {context_len}-token context")
    max_tokens = int(_number(params, "max_tokens", default_max_tokens, 1, 1 << 30))
    stops = params.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) for t in stops):
        raise RequestError("sampling_params.stop_token_ids: a list of token ids")
    return GenerateCall(tuple(ids), temperature, _number(params, "top_p", 1.0, 1e-9, 1.0), max(top_k, 0),
                        min(max_tokens, room) if room is not None else max_tokens, tuple(sorted(set(stops))))


def finish_reason(completion_ids: list[int], stop_ids: set[int], max_tokens: int) -> str:
    """`stop` when the response ended on a stop token, `length` when it ran out of tokens (vLLM's words)."""
    if completion_ids and completion_ids[-1] in stop_ids:
        return "stop"
    return "length" if len(completion_ids) >= max_tokens else "stop"


def generate_reply(request_id: str, call: GenerateCall, completion_ids: list[int], logprobs: list[float],
                   reason: str) -> dict[str, Any]:
    """The response body vLLM's generate endpoint gives: each logprob names its token as `token_id:N`."""
    return {
        "request_id": request_id,
        "prompt_token_ids": list(call.prompt_ids),
        "choices": [{
            "index": 0, "token_ids": completion_ids, "finish_reason": reason,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                     for t, lp in zip(completion_ids, logprobs, strict=True)]},
        }],
        "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(completion_ids),
                  "total_tokens": len(call.prompt_ids) + len(completion_ids)},
    }


class GenerateBatcher:
    """One thread owns the engine; requests queue up and those waiting together share one `generate`."""

    def __init__(self, engine: RolloutEngine, stop_ids: list[int], calls_path: Path | None = None):
        self.engine = engine
        self.stop_ids = stop_ids
        self.calls_path = calls_path
        self.calls = 0
        self._queue: queue.Queue[tuple[GenerateCall, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="generate-batcher", daemon=True)
        self._thread.start()

    def submit(self, call: GenerateCall) -> Future:
        future: Future = Future()
        self._queue.put((call, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            waiting = [first]
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                waiting.append(item)
            groups: dict[tuple, list[tuple[GenerateCall, Future]]] = {}
            for call, future in waiting:
                groups.setdefault(call.batch_key, []).append((call, future))
            for group in groups.values():
                self._run(group)

    def _run(self, group: list[tuple[GenerateCall, Future]]) -> None:
        first = group[0][0]
        sampling = SamplingConfig(n=1, temperature=first.temperature, top_p=first.top_p, top_k=first.top_k,
                                  max_new_tokens=max(c.max_tokens for c, _ in group))
        try:
            out = self.engine.generate([list(c.prompt_ids) for c, _ in group], sampling,
                                       stop_token_ids=first.stop_token_ids,
                                       max_tokens=[c.max_tokens for c, _ in group])
        except Exception as err:  # the engine failed: each waiting request gets the error, the server goes on
            for _, future in group:
                future.set_exception(err)
            return
        stops = {*self.stop_ids, *first.stop_token_ids}
        for (call, future), ids, lps in zip(group, out.response_ids, out.logprobs, strict=True):
            request_id = f"gen-{uuid.uuid4().hex[:16]}"
            reply = generate_reply(request_id, call, list(ids), [float(x) for x in lps],
                                   finish_reason(list(ids), stops, call.max_tokens))
            self._record(reply)
            future.set_result(reply)

    def _record(self, reply: dict[str, Any]) -> None:
        self.calls += 1
        if self.calls_path is None:
            return
        choice = reply["choices"][0]
        line = {"request_id": reply["request_id"], "policy_version": getattr(self.engine, "policy_version", 0),
                "prompt_ids": reply["prompt_token_ids"], "completion_ids": choice["token_ids"],
                "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
                "finish_reason": choice["finish_reason"]}
        with self.calls_path.open("a") as out:
            out.write(json.dumps(line) + "\n")


@dataclass(frozen=True)
class ServedModel:
    """What `/v1/models` reports and requests must name."""

    name: str
    context_len: int | None
    default_max_tokens: int


class _GenerateHandler(BaseHTTPRequestHandler):
    """The endpoints; `_handler` binds the served model, the batcher and the token to a subclass."""

    protocol_version = "HTTP/1.1"
    model: ServedModel
    batcher: GenerateBatcher
    token: str | None = None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        return  # one line per request would drown the run's log; `calls_path` records each call

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "code": status}})

    def _authorised(self) -> bool:
        if self.token is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return True
        self._error(401, "a bearer token is required (the one the server was started with)")
        return False

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.rstrip("/")
        if path == "/health":
            self._send(200, {"status": "ok"})
        elif path in ("/v1/models", "/models"):
            if self._authorised():
                card = {"id": self.model.name, "object": "model", "owned_by": "verl-hpc"}
                if self.model.context_len is not None:
                    card["max_model_len"] = self.model.context_len
                self._send(200, {"object": "list", "data": [card]})
        else:
            self._error(404, f"no GET {self.path}; this server has /health, /v1/models and POST {GENERATE_PATH}")

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != GENERATE_PATH:
            self._error(404, f"no POST {self.path}; generate with POST {GENERATE_PATH}")
            return
        if not self._authorised():
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            if isinstance(body, dict) and body.get("model") not in (None, self.model.name):
                raise RequestError(f"model: {body['model']!r} is not served here; this server serves "
                                   f"{self.model.name!r}", status=404)
            call = parse_generate(body, self.model.default_max_tokens, self.model.context_len)
            reply = self.batcher.submit(call).result()
        except json.JSONDecodeError as err:
            self._error(400, f"the body is not JSON: {err}")
        except RequestError as err:
            self._error(err.status, str(err))
        except Exception as err:  # the engine's failure: this request fails, the server stays up
            self._error(500, f"generation failed: {type(err).__name__}: {err}")
        else:
            self._send(200, reply)


def _handler(model: ServedModel, batcher: GenerateBatcher, token: str | None) -> type[BaseHTTPRequestHandler]:
    return type("GenerateHandler", (_GenerateHandler,), {"model": model, "batcher": batcher, "token": token})


class GenerateServer:
    """`ThreadingHTTPServer` on (host, port) over one `GenerateBatcher`; port 0 picks a free port."""

    def __init__(self, engine: RolloutEngine, model: ServedModel, stop_ids: list[int], *, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None, calls_path: Path | None = None, owns_engine: bool = True):
        self.owns_engine = owns_engine  # False: the engine is a run's, which closes it itself
        self.batcher = GenerateBatcher(engine, stop_ids, calls_path)
        self.httpd = ThreadingHTTPServer((host, port), _handler(model, self.batcher, token))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> GenerateServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="generate-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (`verl-hpc serve`); `close()` afterwards."""
        self.httpd.serve_forever()

    def close(self) -> None:
        """Stop serving, then the batcher, then the engine if it owns it (a vLLM engine is a child process)."""
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.batcher.close()
        if not self.owns_engine:
            return
        close_engine = getattr(self.batcher.engine, "close", None)
        if callable(close_engine):
            close_engine()
