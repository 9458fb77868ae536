"""Chat-template deltas: the token ids a conversation grows by, never a re-tokenised history.

Why deltas (and why not the `renderers` package): the trainer must score exactly the tokens the
policy sampled. Re-rendering the whole conversation after each turn changes earlier tokens —
merges (`" comp"+"ute"` -> `" compute"`), JSON re-serialised with spaces, `<think>` blocks
dropped, a `\\n` after the end-of-turn token that was never sampled. So an episode's sequence is
the prompt's ids, then each turn's sampled ids verbatim, then the ids of *only the text the
template adds* for the inserted messages: the rest of the turn's closing (`\\n` after
`<|im_end|>`, or the whole `<|im_end|>\\n` when the turn stopped at `</tool_call>`), the tool
messages and the next generation prompt. That text is found by rendering a fixed probe
conversation with and without the new messages and taking the difference — which works for
any Jinja template that renders history as a prefix, checked once at start-up.

`renderers` 0.1.12 (PyPI) does the same with `bridge_to_next_turn`, but through one
hand-written renderer per model family (Qwen3, Llama 3, GPT-OSS, ...) that needs the hub
tokenizer's name, and it pulls `openai-harmony` and `prime-pydantic-config`. It has no answer
for the tiny model's template or a user's own template file, both of which the probe handles
from the template itself, so the project renders its own deltas. What the template would
have rendered instead of the kept ids is counted per episode (`agent/template_mismatch`).
"""

from __future__ import annotations

import logging
from typing import Any

from verl_hpc.config.errors import ConfigError

log = logging.getLogger(__name__)

SENTINEL = "VERLHPCPROBEREPLY"
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "A probe.", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "description": "text"}}, "required": ["x"]}}}
_FIELD = "rollout.multi_turn.chat_template"
_HINT = ("set rollout.multi_turn.chat_template to a Jinja file that renders tools= and assistant tool_calls "
         "(configs/hermes_chatml.jinja renders Qwen's hermes format)")


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A dataset prompt (text or chat messages) as chat messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


class ChatRenderer:
    """Renders prompts and message deltas with one chat template and one tool list."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]], template: str | None = None,
                 template_source: str = "the tokenizer's chat template"):
        self.tokenizer, self.tools = tokenizer, tools
        self.template = template if template is not None else getattr(tokenizer, "chat_template", None)
        self.source = template_source if template is not None else "the tokenizer's chat template"
        if not self.template:
            raise ConfigError(_FIELD, "the tokenizer has no chat template", _HINT)
        self._probed: tuple[list[dict[str, Any]], str, str] | None = None

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = "run") -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools if tools == "run" else tools, chat_template=self.template, tokenize=False,
            add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: Any) -> list[int]:
        """The episode's first prompt: the dataset's messages with the tools, and the generation prompt."""
        return self.encode(self.render(as_messages(prompt), generation_prompt=True))

    def _probe(self) -> tuple[list[dict[str, Any]], str, str]:
        """(probe messages, their rendering, what the template writes after the assistant's text)."""
        if self._probed is not None:
            return self._probed
        base = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": SENTINEL}]
        prefix = self.render(base, generation_prompt=False)
        at = prefix.find(SENTINEL)
        if at < 0:
            raise ConfigError(_FIELD, f"{self.source} does not render an assistant message's content", _HINT)
        self._probed = (base, prefix, prefix[at + len(SENTINEL):])
        return self._probed

    def delta_text(self, new_messages: list[dict[str, Any]], sampled_close: str) -> str | None:
        """Text after an assistant turn whose sampled text ended with `sampled_close` (its end-of-turn
        token's text, or '' when it stopped elsewhere): the rest of the turn's closing, the new
        messages and the next generation prompt. None: the template re-renders history."""
        base, prefix, tail = self._probe()
        full = self.render([*base, *new_messages], generation_prompt=True)
        if not full.startswith(prefix):
            return None
        closing = tail[len(sampled_close):] if sampled_close and tail.startswith(sampled_close) else tail
        return closing + full[len(prefix):]

    def delta_ids(self, new_messages: list[dict[str, Any]], sampled_close: str) -> list[int]:
        text = self.delta_text(new_messages, sampled_close)
        if text is None:
            raise RuntimeError(f"{self.source} re-rendered the history when messages were added")
        return self.encode(text)

    def closing_ids(self, sampled_close: str) -> list[int]:
        """What the template writes after a final turn that the model did not sample (e.g. `\\n`)."""
        _, _, tail = self._probe()
        return self.encode(tail[len(sampled_close):] if sampled_close and tail.startswith(sampled_close) else tail)

    def rendered_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The whole conversation as the template would tokenise it (the `template_mismatch` check)."""
        return self.encode(self.render(messages, generation_prompt=False))

    def check_user_turns(self) -> None:
        """Refuse, in one line, a template that cannot append a user turn after an answer as a delta."""
        if self.delta_text([{"role": "user", "content": "42"}], "") is None:
            raise ConfigError(_FIELD, f"{self.source} renders earlier messages differently once another user "
                              "turn follows, so an environment's turns cannot be appended as deltas", _HINT)
        log.info("multi-turn chat template: %s", self.source)

    def check_tool_capable(self) -> None:
        """Refuse, in one line, a template that cannot hold a tool conversation."""
        user = [{"role": "user", "content": "probe"}]
        if self.render(user, False, tools=[_PROBE_TOOL]) == self.render(user, False, tools=None):
            raise ConfigError(_FIELD, f"{self.source} ignores tools= (the model would never see the tools)",
                              _HINT)
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "probe_tool", "arguments": {"x": "1"}}}]}
        try:
            self.render([*user, call, {"role": "tool", "content": "42"}], False)
        except Exception as err:  # noqa: BLE001 - the template's own error, shown in the refusal
            raise ConfigError(_FIELD, f"{self.source} cannot render an assistant tool call: "
                              f"{type(err).__name__}: {err}", _HINT) from None
        if self.delta_text([{"role": "tool", "content": "42"}], "") is None:
            raise ConfigError(_FIELD, f"{self.source} renders earlier messages differently once a tool reply "
                              "follows, so turns cannot be appended as deltas", _HINT)
        log.info("multi-turn chat template: %s", self.source)
