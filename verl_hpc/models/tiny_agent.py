"""The tokenizer of the `tiny-agent` preset: a tool-capable chat template in a ~50-token vocabulary.

Why its own tokenizer: the built-in multi-turn task must be learnable by a random-init model in
a few hundred CPU steps, so a random policy has to call the tool and then answer often enough
for GRPO groups to have reward spread. Roles, turn ends and the hermes tags are special tokens
(one id each, nothing to spell), and the task's one tool call, `<tool_call>{"name": "peek",
"arguments": {}}</tool_call>` exactly as the template renders it, is one added token — the text
is still hermes JSON that `HermesParser` reads and the template writes back, so the same
parsers, deltas and checks run as for Qwen; only the spelling is cheap. Any other call (wrong
name, free text between the tags) is spelled token by token and is parsed, and refused, as usual.
"""

from __future__ import annotations

import random

PAD, EOT = "<|pad|>", "<|im_end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
PEEK_CALL = '<tool_call>{"name": "peek", "arguments": {}}</tool_call>'
PROMPT_TEXT = "what is in the box"

# Hermes-style, in the tokenizer's own alphabet: tools listed by name in the system turn, an
# assistant's calls as hermes JSON, tool replies in <tool_response> tags, each turn closed by EOT.
CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}<|im_end|>"
    "{%- elif m.role == 'tool' %}<|tool|><tool_response>{{ m.content }}</tool_response><|im_end|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|im_end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def agent_corpus(seed: int, lines: int = 2000) -> list[str]:
    """The task's language: its question, tool names, digits and a few words."""
    rng = random.Random(seed)
    words = ["what", "is", "in", "the", "box", "tools:", "peek", "answer", "it", "a"]
    corpus = [PROMPT_TEXT, "tools: peek"]
    for _ in range(lines):
        corpus.append(" ".join(rng.choice(words) for _ in range(3)) + f" {rng.randint(0, 9)}")
    return corpus


def build_agent_tokenizer(vocab_size: int, seed: int):  # -> PreTrainedTokenizerFast
    """A byte-level BPE over the task's language, the special tokens above and the one-token call."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, EOT, *ROLE_TOKENS, *TAG_TOKENS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(agent_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(PEEK_CALL, normalized=False, special=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOT, bos_token=None,
                                        unk_token=None, padding_side="left",
                                        additional_special_tokens=[*ROLE_TOKENS, *TAG_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
