"""What the memory estimate reads: a model's shape, a process's workload and the switches set.

Why plain frozen dataclasses built from a `config.json` dict: the estimate must run where
no model is loaded (`verl-hpc plan` on a login node, a worker before it builds its roles),
and it must be a pure function a test can feed any shape. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's dimensions (Llama, Qwen2, Mistral and their kin)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = False

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Hugging Face `config.json` (as a dict); a multimodal config's `text_config` is used."""
        config = config.get("text_config") or config
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(hidden=hidden, layers=int(config["num_hidden_layers"]), heads=heads,
                   kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   intermediate=int(config.get("intermediate_size") or 4 * hidden),
                   vocab=int(config["vocab_size"]), tied=bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False)))

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by module name."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return sum(a * b for a, b in self.linear_shapes().values()) + bias + 2 * self.hidden

    @property
    def params(self) -> int:
        """Every parameter: embeddings, the decoder layers, the final norm, an untied head."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    def lora_params(self, rank: int, targets: tuple[str, ...] | str = "all-linear") -> int:
        """Adapter parameters (A and B) for `rank` on the named linear layers of every decoder layer."""
        names = LORA_ALL if targets == "all-linear" else tuple(targets)
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (a + b) for name, (a, b) in shapes.items() if name in names)


@dataclass(frozen=True)
class Switches:
    """The memory switches as a process will run them (config values after the plan)."""

    logprob_chunk_tokens: int = 1024
    remove_padding: bool = False
    token_budget: int | None = None          # algorithm.use_dynamic_bsz: max_token_len_per_gpu, else None
    gradient_checkpointing: bool = False
    ref_offload: bool = False
    micro_batch_rows: int = 1                # rows per forward (algorithm.micro_batch_size, or the mini-batch)
    generate_rows: int | None = None         # prompts per `generate` call (None: all of them at once)

    def with_(self, **changes: Any) -> Switches:
        return replace(self, **changes)


@dataclass(frozen=True)
class Workload:
    """What one process computes in a step, and where (the shape its memory follows)."""

    rows: int                                # sequences this process trains or scores per step
    prompt_tokens: int                       # the longest prompt (every row is padded to it)
    response_tokens: int                     # the longest response
    mean_tokens: float | None = None         # real tokens per row on average (None: every row full width)
    trains: bool = True                      # holds the actor: gradients, optimizer state, the update
    ref: bool = False                        # holds the reference policy
    critic: bool = False                     # holds the critic (value model; PPO)
    engine: str | None = None                # "hf_shared" (the actor's module), "hf" (a copy), "vllm", None
    generate_rows: int = 0                   # prompts this process generates for per step
    old_pass: bool = False                   # a separate no-grad pass for the old log-probs
    shards: int = 1                          # FSDP2 ranks the weights are sharded over
    param_bytes: int = 4                     # bytes per stored weight (model.dtype)
    compute_bytes: int = 4                   # bytes per activation (the compute dtype)
    trainable: int | None = None             # trained parameters (LoRA adapters), None: all of them
    device: str = "cpu"
    floor_bytes: int = 0                     # the runtime's own (interpreter, libraries): measured
    extra_bytes: dict[str, int] = field(default_factory=dict)  # other models held (a judge), by name
    optimizer_state: bool = True             # AdamW's moments exist when the step starts (not on a fresh run's first)

    @property
    def width(self) -> int:
        return self.prompt_tokens + self.response_tokens
