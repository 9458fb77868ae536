"""Tiny random-weight causal LMs and tokenizers built on the spot, with no model hub.

Why: the quickstart, the tests and the benchmarks must run on a laptop CPU with no
network. A Qwen2-style model of a few hundred thousand parameters trains in
milliseconds per step, and a byte-level BPE tokenizer trained here on the synthetic
task's own text keeps the vocabulary small: a random policy then hits the right
answer token often enough (a few percent per sample) for GRPO groups to have reward
spread from the first step — with a 150k vocabulary it would be 0 for hundreds of steps.

Everything is deterministic for a seed, so two machines building "tiny" get the same
bytes, and the build is reused when a directory already holds a finished model.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
MARKER_FILE = "verl_hpc_model.json"
# A chat template spelled in the tokenizer's own alphabet (a byte-level BPE trained on the
# task corpus drops characters it never saw, so `<|im_start|>` would vanish): each message
# is its role, its content and EOS; the generation prompt is "answer ". Why one at all:
# chat datasets (verl's `prompt` messages) must be testable with the tiny model.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} {{ message['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}answer {% endif %}")


@dataclass(frozen=True)
class ModelPreset:
    """The shape of a locally built model; `vocab_size` is the tokenizer's target size."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    family: str = "qwen2"  # or "llama": a second architecture through every placement


PRESETS: dict[str, ModelPreset] = {
    # ~0.3M parameters: overhead-dominated, the quickstart and most tests.
    "tiny": ModelPreset(hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=256, vocab_size=64),
    # Untied variant of tiny: weight sync and export must handle a separate lm_head.
    "tiny-untied": ModelPreset(hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                               intermediate_size=256, vocab_size=64, tie_word_embeddings=False),
    # tiny with 32-wide attention heads: vLLM's CPU attention supports head sizes 32..512 only.
    "tiny-hd32": ModelPreset(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=256, vocab_size=64),
    "tiny-hd32-untied": ModelPreset(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                    intermediate_size=256, vocab_size=64, tie_word_embeddings=False),
    # A Llama (no attention biases, untied head) of tiny's size, head size 32 for vLLM's CPU attention.
    "tiny-llama": ModelPreset(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=256, vocab_size=64, tie_word_embeddings=False, family="llama"),
    # tiny with a tool-capable chat template and a ~50-token vocabulary (models/tiny_agent.py): the
    # built-in multi-turn task; head size 32, so vLLM's CPU attention serves it too.
    "tiny-agent": ModelPreset(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=256, vocab_size=48),
    # tiny-agent with room for a game's rules: TextArena's two-player intros run ~300 of its tokens.
    "tiny-agent-1k": ModelPreset(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=256, vocab_size=48, max_position_embeddings=1024),
    # small's shape with tiny-agent's tokenizer: agent benchmarks whose step is compute, not overhead
    # (a tool's latency is judged against a step that generation and the update dominate).
    "small-agent": ModelPreset(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                               intermediate_size=1536, vocab_size=48),
    # ~20M parameters: compute-dominated, for benchmarks.
    "small": ModelPreset(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                         intermediate_size=1536, vocab_size=1024, max_position_embeddings=512),
    # ~150M parameters: GPU benchmarks, where the smaller ones are all launch overhead and
    # the placements' memory footprints (weights, grads, Adam state, KV cache) differ visibly.
    "medium": ModelPreset(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
                          intermediate_size=2816, vocab_size=1024, max_position_embeddings=512),
}


def tokenizer_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Text the tokenizer is trained on: the arithmetic task's language plus plain words."""
    rng = random.Random(seed)
    words = ["the", "sum", "of", "and", "is", "answer", "what", "copy", "reverse", "add"]
    corpus = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        corpus.append(f"{a}+{b}={a + b}")
        corpus.append(" ".join(rng.choice(words) for _ in range(4)) + f" {rng.randint(0, 99)}")
    return corpus


def build_tokenizer(vocab_size: int, seed: int):  # -> PreTrainedTokenizerFast
    """Train a byte-level BPE on the task corpus (its alphabet, not all 256 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits split one by one (as Qwen2 and Llama do): numbers never merge, so the
    # vocabulary stays small and arithmetic answers are spelled digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, EOS_TOKEN],
                                  show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                        bos_token=None, unk_token=None, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(preset: ModelPreset, vocab_size: int, pad_id: int, eos_id: int, seed: int):
    """A randomly initialised Qwen2 (or Llama, by `preset.family`) causal LM (fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if preset.family == "llama" else \
        (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(
        vocab_size=vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads, num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings, pad_token_id=pad_id,
        eos_token_id=eos_id, bos_token_id=eos_id, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.pad_token_id = pad_id
    model.generation_config.eos_token_id = eos_id
    return model


def is_built(out_dir: str | os.PathLike) -> bool:
    return (Path(out_dir) / MARKER_FILE).is_file()


def init_model(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0,
               overwrite: bool = False) -> Path:
    """Build a model + tokenizer into `out_dir` (atomically); reuse it if already built.

    The directory appears only when complete (built in a temporary sibling, then
    renamed), so an interrupted build never leaves a half model that later runs load.
    Refuses to overwrite a non-empty directory it did not build unless `overwrite`.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    if is_built(out) and not overwrite:
        recorded = json.loads((out / MARKER_FILE).read_text())
        if recorded.get("preset") == preset and recorded.get("seed") == seed:
            return out
        raise FileExistsError(f"{out} holds a model built with {recorded}; pass --overwrite to replace it")
    if out.exists() and any(out.iterdir()) and not is_built(out):
        raise FileExistsError(f"{out} exists and is not a model built by verl-hpc; choose an empty directory")
    spec = PRESETS[preset]
    if preset in ("tiny-agent", "tiny-agent-1k", "small-agent"):
        from verl_hpc.models.tiny_agent import build_agent_tokenizer

        tokenizer = build_agent_tokenizer(spec.vocab_size, seed)
    else:
        tokenizer = build_tokenizer(spec.vocab_size, seed)
    model = build_model(spec, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.chmod(staging, 0o755)  # a model is no secret: a shared cache must be readable by all
        marker = {"preset": preset, "seed": seed, **asdict(spec), "vocab_size": len(tokenizer)}
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        if out.exists() and is_built(out) and not overwrite:
            return out  # another process finished the same build first: use theirs
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out
