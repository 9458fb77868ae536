"""The peak memory of one process's step, from shapes alone: a pure function of model, workload, switches.

Why phases: a step's memory is what stays resident (weights, AdamW's two moments, the
reference, the runtime's own) plus the largest of what each phase holds for a moment:
generation (the KV cache and the per-step logits `generate` returns), the no-grad log-prob
passes (one layer's activations, the log-prob head), and the update (every layer's
activations kept for backward, or only each layer's input under activation checkpointing
plus one layer recomputed; the gradients, which live only inside an optimizer step). The
peak is the resident part plus the largest phase; each switch changes one term, which is what lets the plan (plan.py) ask "what does
this switch save?" before anything is allocated.

The per-token constants were measured on torch 2.13 (CPU, SDPA) by counting the tensors
autograd saves in a Llama/Qwen2 decoder layer (`tests/roles/test_memory_estimate.py`
checks them against a live count): 4 x intermediate + 9 x hidden + 3 x kv values per token
without checkpointing, 2 x hidden with it. Their accuracy against whole runs is
`bench step_memory`'s second table (docs/memory.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verl_hpc.roles.memory.shapes import ModelShape, Switches, Workload

GB = 1e9
RUNTIME_GROWTH_CPU = 150 << 20  # bytes a CPU process adds after planning: model code, tokenizer, prompts
FP32 = 4
# Values per token a decoder layer keeps for backward: 4 x intermediate (gate, up, act, act*up),
# ~9 x hidden (norms, q, rotary q, attention out, residuals), 3 x kv width (k, v, rotary k).
ACT_INTERMEDIATE, ACT_HIDDEN, ACT_KV = 4, 9, 3
MASK_HIDDEN = 1.5            # a padded forward's attention-mask bookkeeping, per token and layer
CHECKPOINTED_HIDDEN = 2      # what a checkpointed layer keeps: its input (and the rotary cache's share)
NO_GRAD_LAYERS = 1.0         # a no-grad forward holds about one layer's activations at a time
BACKWARD_LAYERS = 1.0        # backward's activation gradients: about one layer's worth at a time
WHOLE_LOGIT_COPIES = 3       # the whole-logits path: logits, padding excluded / tempered, log-softmax
CHUNK_LOGIT_COPIES = 2       # a chunk: its logits, and their softmax (entropy) or gradient
GENERATE_STEP_COPIES = 3     # one generation step: its logits as float, the processors' and sampler's copies


@dataclass(frozen=True)
class Estimate:
    """Bytes: what stays resident, what each phase adds on top, and the peak (resident + largest phase)."""

    resident: dict[str, int]
    phases: dict[str, int]

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name]) if self.phases else "resident"

    @property
    def peak(self) -> int:
        return self.resident_bytes + (max(self.phases.values()) if self.phases else 0)

    def gb(self) -> float:
        return self.peak / GB


def layer_activation_values(model: ModelShape, padded: bool) -> float:
    """Values per token one decoder layer keeps for backward without checkpointing."""
    values = ACT_INTERMEDIATE * model.intermediate + ACT_HIDDEN * model.hidden + ACT_KV * model.kv_dim
    return values + (MASK_HIDDEN * model.hidden if padded else 0.0)


def micro_tokens(work: Workload, switches: Switches) -> tuple[float, float]:
    """(tokens one forward computes, response tokens among them) for the largest micro-batch.

    Padded rows cost the batch's full width; packed rows (padding removal) their real
    tokens; a token budget caps the padded cost of a micro-batch (a row wider than the
    budget goes alone).
    """
    rows = max(1, min(switches.micro_batch_rows, work.rows))
    width = work.width
    real = work.mean_tokens if work.mean_tokens is not None else float(width)
    if switches.token_budget is not None:
        rows = max(1, min(rows, switches.token_budget // max(width, 1)))
    tokens = rows * (real if switches.remove_padding else width)
    response_share = work.response_tokens / max(width, 1)
    return float(tokens), float(rows * work.response_tokens if not switches.remove_padding
                                else tokens * response_share)


def head_bytes(model: ModelShape, switches: Switches, response_tokens: float, grad: bool) -> float:
    """The log-prob head's transient: whole `[tokens, vocab]` logits, or one chunk plus the hidden states."""
    narrow = model.vocab <= model.hidden
    chunk = switches.logprob_chunk_tokens
    if narrow or chunk <= 0 or response_tokens <= chunk:
        return WHOLE_LOGIT_COPIES * response_tokens * model.vocab * FP32
    head_grad = model.vocab * model.hidden * FP32 if grad else 0
    return response_tokens * model.hidden * FP32 + CHUNK_LOGIT_COPIES * chunk * model.vocab * FP32 + head_grad


def no_grad_pass(model: ModelShape, work: Workload, switches: Switches) -> float:
    """A log-prob pass (reference, old policy): one layer's activations at a time, then the head."""
    tokens, response = micro_tokens(work, switches)
    layer = layer_activation_values(model, not switches.remove_padding) * work.compute_bytes
    return NO_GRAD_LAYERS * tokens * layer + head_bytes(model, switches, response, grad=False)


def update_pass(model: ModelShape, work: Workload, switches: Switches) -> float:
    """The actor's forward and backward over its largest micro-batch.

    Everything kept for backward is held at the end of the forward; on top comes the larger
    of the head's pass (its logits, chunk by chunk) and one layer's backward (its activations
    recomputed under checkpointing, and their gradients), and the first gradient backward
    builds: the head's (the embedding's, when tied). The rest of the gradients grow as the
    activations are freed (`update_phase` takes the end of backward too).
    """
    tokens, response = micro_tokens(work, switches)
    layer = layer_activation_values(model, not switches.remove_padding) * work.compute_bytes
    if switches.gradient_checkpointing:
        kept = tokens * model.layers * CHECKPOINTED_HIDDEN * model.hidden * work.compute_bytes
        recompute = tokens * layer  # backward rebuilds one layer's activations at a time
    else:
        kept, recompute = tokens * model.layers * layer, 0.0
    backward = recompute + BACKWARD_LAYERS * tokens * layer
    trainable = trainable_params(model, work)
    head_grad = min(trainable, model.vocab * model.hidden) * work.param_bytes / work.shards
    return kept + max(head_bytes(model, switches, response, grad=True), backward) + head_grad


def update_phase(model: ModelShape, work: Workload, switches: Switches, trainable: float | None = None) -> float:
    """An update on top of the resident set: its forward and backward, or its end (every gradient)
    and the optimizer step, whichever is larger; a fresh run's first step also makes AdamW's moments.

    Why the first step is its own case: until the first optimizer step the moments do not exist,
    so generation and the log-prob passes run that much lower (`resident`); they appear in
    `optimizer.step()`, after the activations are gone. Comparing the first step's peak with the
    steady state's estimate would read as a 20-30% over-estimate on a small model (and would hide
    an under-estimate of the rest from the re-plan's check).
    """
    count = trainable if trainable is not None else trainable_params(model, work)
    grads, moments = count * work.param_bytes / work.shards, 2 * count * FP32 / work.shards
    step_end = grads + optimizer_step(model, work) + (0.0 if work.optimizer_state else moments)
    return max(update_pass(model, work, switches), step_end)


def optimizer_step(model: ModelShape, work: Workload) -> float:
    """AdamW's step: on a GPU the foreach kernels make one trainable-sized temporary; on a CPU one tensor's."""
    trainable = trainable_params(model, work)
    if work.device == "cuda":
        return trainable * FP32 / work.shards
    return 2 * model.vocab * model.hidden * FP32  # the largest tensor (the embedding), twice


def generation(model: ModelShape, work: Workload, switches: Switches) -> float:
    """An HF `generate` call: the KV cache, the per-step logits it returns, one step's working copies."""
    if work.engine not in ("hf", "hf_shared") or work.generate_rows <= 0:
        return 0.0
    rows = min(work.generate_rows, switches.generate_rows or work.generate_rows)
    kv = rows * work.width * model.layers * 2 * model.kv_dim * work.param_bytes
    kept_logits = rows * work.response_tokens * model.vocab * work.param_bytes
    step = GENERATE_STEP_COPIES * rows * model.vocab * FP32
    prefill = rows * work.prompt_tokens * layer_activation_values(model, True) * work.compute_bytes
    return kv + kept_logits + max(step, prefill)


def resident(model: ModelShape, work: Workload, switches: Switches) -> dict[str, int]:
    """What a process holds through every phase of a step: no gradients (freed after each optimizer
    step), and AdamW's moments once they exist (after a run's first optimizer step)."""
    weights = model.params * work.param_bytes / work.shards
    out = {"runtime": work.floor_bytes}
    if work.trains or work.engine in ("hf_shared", "hf"):
        out["weights"] = int(weights)
    if work.engine == "hf" and work.trains:
        out["engine_weights"] = int(weights)  # an engine with its own copy (split, or an FSDP actor)
    if work.trains and work.optimizer_state:  # a fresh run's first step holds none until its update
        trainable = trainable_params(model, work)
        out["adamw"] = int(2 * trainable * FP32 / work.shards)
    if work.ref and not (switches.ref_offload and work.device == "cuda"):
        out["ref_weights"] = int(weights)
    if work.critic:
        moments = 2 * FP32 if work.optimizer_state else 0
        out["critic"] = int(critic_params(model) * (work.param_bytes + moments) / work.shards)
    out.update(work.extra_bytes)
    return out


def estimate(model: ModelShape, work: Workload, switches: Switches) -> Estimate:
    """The step's resident memory and each phase's transient, in bytes (see the module docstring)."""
    phases: dict[str, float] = {}  # named as the step's timer names them (timing_s/<phase>)
    if work.engine in ("hf", "hf_shared") and work.generate_rows:
        phases["gen"] = generation(model, work, switches)
    if work.ref:
        phases["ref"] = no_grad_pass(model, work, switches)
    if work.trains and work.old_pass:
        phases["old_log_prob"] = no_grad_pass(model, work, switches)
    if work.critic:
        phases["values"] = no_grad_pass(model, work, switches)
    if work.trains:
        phases["update_actor"] = update_phase(model, work, switches)
    if work.critic:
        phases["update_critic"] = update_phase(model, work, switches, trainable=critic_params(model))
    return Estimate(resident(model, work, switches), {k: int(math.ceil(v)) for k, v in phases.items()})


def critic_params(model: ModelShape) -> int:
    """A critic is the policy's backbone and a value head: no vocabulary head of its own."""
    return model.params - (0 if model.tied else model.vocab * model.hidden)


def trainable_params(model: ModelShape, work: Workload) -> int:
    """What the actor trains: its LoRA adapters when it has them, else the whole model."""
    return work.trainable if work.trainable is not None else model.params
