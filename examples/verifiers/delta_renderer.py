"""A `renderers` renderer that builds prompts the way verl-hpc's agent loop does, for verifiers' TrainClient.

Why: a verifiers harness renders each turn's prompt itself and sends token ids to the engine. For its
traces to be trainable as verl-hpc trajectories, a turn's prompt must be the previous prompt, the ids
the engine sampled (verbatim) and the ids of only the text the chat template adds for the new messages
- exactly what `verl_hpc.roles.agent.render.ChatRenderer` appends. `renderers`' own renderers do that
for the model families they know, by name; this one does it for any template that renders history as
a prefix (the tiny model's, configs/hermes_chatml.jinja), with the same probe, and reads hermes tool
calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) from the text, so a model whose
vocabulary spells the tags in several tokens (SmolLM2) can call tools.

It runs in verifiers' own environment (it imports `renderers`, not verl-hpc):

    vf-eval ... --client.type train --client.renderer.name custom \\
        --client.renderer.import-path /path/to/examples/verifiers/delta_renderer.py:DeltaRenderer \\
        --client.renderer.chat-template-file configs/hermes_chatml.jinja   # optional: the run's template
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from renderers.base import ParsedResponse, ParsedToolCall, RenderedTokens, ToolCallParseStatus
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

SENTINEL = "VERLHPCPROBEREPLY"  # the agent loop's probe reply: the same probe, the same deltas
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


class DeltaRenderer(DefaultRenderer):
    """The model's chat template for first prompts; probe deltas for every later turn; hermes calls."""

    config_class = DefaultRendererConfig

    def __init__(self, tokenizer: Any, config: DefaultRendererConfig | None = None):
        super().__init__(tokenizer, config)
        extra = dict(self.config.model_extra or {})
        template_file = extra.pop("chat_template_file", None)  # the run's rollout.multi_turn.chat_template
        self._template = Path(template_file).read_text() if template_file else None
        self._probed: dict[str, tuple[list[dict[str, Any]], str, str]] = {}

    @property
    def supports_tools(self) -> bool:
        return True

    def get_stop_token_ids(self) -> list[int]:
        return [self._tokenizer.eos_token_id] if self._tokenizer.eos_token_id is not None else []

    def _text(self, messages: list[Any], tools: Any, generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                   add_generation_prompt=generation_prompt,
                                                   chat_template=self._template)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _attributed(self, text: str, ends: list[int], skip: int = 0) -> tuple[list[int], list[int]]:
        """`text` encoded once, each token given the message whose text (ending at `ends[i]`) holds its
        first character; -1 for the first `skip` characters (a turn's closing) and for text after the
        last message (the generation prompt)."""
        enc = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        owners = [-1 if start < skip else next((i for i, end in enumerate(ends) if start < end), -1)
                  for start, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), owners

    def render(self, messages: list[Any], *, tools: Any = None, add_generation_prompt: bool = False,
               **_: Any) -> RenderedTokens:
        """The whole conversation as one rendering, encoded once (as the agent loop's first prompt)."""
        text = self._text(messages, tools, add_generation_prompt)
        prefixes = [self._text(messages[:k + 1], tools, False) for k in range(len(messages))]
        ends = [len(p) for p in prefixes]
        if not all(text.startswith(p) for p in prefixes):
            ends = [len(text)] * len(messages)  # not prefix-stable: the tokens are right, attribution coarse
        ids, owners = self._attributed(text, ends)
        return RenderedTokens(token_ids=ids, message_indices=owners,
                              message_roles=[m.get("role") or "" for m in messages])

    def _probe(self, tools: Any) -> tuple[list[dict[str, Any]], str, str]:
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._probed:
            base = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": SENTINEL}]
            prefix = self._text(base, tools, False)
            at = prefix.find(SENTINEL)
            self._probed[key] = (base, prefix, prefix[at + len(SENTINEL):] if at >= 0 else "")
        return self._probed[key]

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list[Any], *, tools: Any = None, **_: Any) -> RenderedTokens | None:
        """Previous prompt + sampled ids + the template's text for the new messages (None: not a prefix)."""
        base, prefix, tail = self._probe(tools)
        full = self._text([*base, *new_messages], tools, True)
        if not prefix or not full.startswith(prefix):
            return None
        eot = self._tokenizer.eos_token
        ended = bool(previous_completion_ids) and previous_completion_ids[-1] == self._tokenizer.eos_token_id
        closing = tail[len(eot):] if ended and eot and tail.startswith(eot) else tail
        starts = len(closing) - len(prefix)  # a message's end in `full`, shifted into the delta text
        ends = [len(self._text([*base, *new_messages[:k + 1]], tools, False)) + starts
                for k in range(len(new_messages))]
        delta, owners = self._attributed(closing + full[len(prefix):], ends, skip=len(closing))
        kept = len(previous_prompt_ids) + len(previous_completion_ids)
        return RenderedTokens(token_ids=[*previous_prompt_ids, *previous_completion_ids, *delta],
                              message_indices=[-1] * kept + owners,
                              message_roles=[m.get("role") or "" for m in new_messages])

    def parse_response(self, token_ids: list[int], *, tools: Any = None, prompt_ids: Any = None) -> ParsedResponse:
        """Content before the first `<tool_call>`, and every call in the text (malformed ones kept, marked)."""
        stops = set(self.get_stop_token_ids())
        while token_ids and token_ids[-1] in stops:
            token_ids = token_ids[:-1]
        text = self._tokenizer.decode(token_ids, skip_special_tokens=False)
        calls = [_parsed_call(body.strip(), closed=bool(end)) for body, end in _CALL.findall(text)]
        content = text.split("<tool_call>", 1)[0].strip() if calls else text
        return ParsedResponse(content=content, tool_calls=calls)


def _parsed_call(body: str, closed: bool) -> ParsedToolCall:
    if not closed:
        return ParsedToolCall(raw=body, status=ToolCallParseStatus.UNCLOSED_BLOCK)
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return ParsedToolCall(raw=body, status=ToolCallParseStatus.INVALID_JSON)
    name = value.get("name") if isinstance(value, dict) else None
    if not name:
        return ParsedToolCall(raw=body, status=ToolCallParseStatus.MISSING_NAME)
    return ParsedToolCall(raw=body, name=name, arguments=value.get("arguments") or {})
