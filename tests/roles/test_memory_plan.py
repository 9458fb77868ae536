"""The memory plan's pure parts: model shapes, the estimate's constants against a live count, the
budget parsers, and the ladder (what it switches on, in which order, and what it never touches)."""

from __future__ import annotations

import resource

import pytest
import torch

from verl_hpc.config.explicit import MEMORY_SWITCHES
from verl_hpc.roles.memory.budget import Budget, address_space_room, cgroup_room, meminfo_available
from verl_hpc.roles.memory.estimate import (
    CHECKPOINTED_HIDDEN,
    estimate,
    layer_activation_values,
)
from verl_hpc.roles.memory.plan import plan_memory
from verl_hpc.roles.memory.shapes import ModelShape, Switches, Workload

GIB = 1 << 30
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
           "tie_word_embeddings": True}
# SmolLM2's GRPO step of docs/memory.md: 8 prompts x 4 samples, ~71 prompt + 64 new tokens, one process.
STEP = Workload(rows=32, prompt_tokens=71, response_tokens=64, trains=True, ref=True, engine="hf_shared",
                generate_rows=32, floor_bytes=int(0.45 * GIB))
DEFAULTS = Switches(micro_batch_rows=32)


def shape() -> ModelShape:
    return ModelShape.from_hf_config(SMOLLM2)


def test_smollm2_shape_counts_its_parameters() -> None:
    model = shape()
    assert model.params == 134_515_008  # SmolLM2-135M, tied embeddings
    assert model.lora_params(16) == 4_884_480  # rank 16 on every linear layer: 3.6% of the weights
    assert model.lora_params(8, ["q_proj", "v_proj"]) == 30 * 8 * ((576 + 576) + (576 + 192))


def _saved_values_per_token(checkpointing: bool) -> float:
    """What autograd keeps for a real Llama decoder stack, per token and layer (distinct storages)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=100)
    model = LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    rows, width = 4, 64
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.model(input_ids=torch.randint(0, 100, (rows, width)))
    saved = sum(size for ptr, size in seen.items() if ptr not in params)
    return saved / (rows * width * config.num_hidden_layers * 4)


def test_the_activation_constants_match_what_autograd_keeps() -> None:
    model = ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=100)
    plain = _saved_values_per_token(checkpointing=False)
    assert layer_activation_values(model, padded=False) == pytest.approx(plain, rel=0.1)
    assert CHECKPOINTED_HIDDEN * model.hidden == pytest.approx(_saved_values_per_token(True), rel=0.1)


def test_checkpointing_and_chunks_lower_the_estimate_where_they_act() -> None:
    model = shape()
    plain = estimate(model, STEP, DEFAULTS.with_(logprob_chunk_tokens=0))
    chunked = estimate(model, STEP, DEFAULTS)
    checkpointed = estimate(model, STEP, DEFAULTS.with_(gradient_checkpointing=True))
    assert chunked.phases["ref"] < plain.phases["ref"]  # whole [tokens, vocab] logits vs one chunk
    assert checkpointed.phases["update_actor"] < chunked.phases["update_actor"] / 3
    assert checkpointed.phases["gen"] == chunked.phases["gen"]  # generation keeps its KV cache either way
    assert chunked.resident["adamw"] == 2 * chunked.resident["weights"]  # fp32 moments
    halved = estimate(model, STEP, DEFAULTS.with_(micro_batch_rows=16))
    assert halved.phases["update_actor"] < chunked.phases["update_actor"]


def test_a_fresh_runs_first_step_holds_no_moments_until_its_update() -> None:
    model = shape()
    steady = estimate(model, STEP, DEFAULTS)
    first = estimate(model, Workload(**{**STEP.__dict__, "optimizer_state": False}), DEFAULTS)
    assert "adamw" not in first.resident and "gradients" not in steady.resident  # freed after each step
    assert first.phases["gen"] == steady.phases["gen"] and first.phases["ref"] == steady.phases["ref"]
    # The update's activations dominate this step (no checkpointing): they peak as the steady update
    # does, less AdamW's moments, which appear only in the optimizer step after them.
    moments = steady.resident["adamw"]
    steady_update = steady.resident_bytes + steady.phases["update_actor"]
    first_update = first.resident_bytes + first.phases["update_actor"]
    assert abs(first_update - (steady_update - moments)) <= 1
    # With checkpointing the update is small, and the first optimizer step (gradients and the new
    # moments at once, on top of the resident set) is the step's peak instead.
    tight = DEFAULTS.with_(gradient_checkpointing=True, micro_batch_rows=1)
    first_tight = estimate(model, Workload(**{**STEP.__dict__, "optimizer_state": False}), tight)
    held = estimate(model, STEP, tight).resident
    assert first_tight.phases["update_actor"] >= held["weights"] + held["adamw"]  # gradients are the weights' size
    assert first.peak < steady.peak


def test_the_watch_asks_the_actors_optimizer_whether_it_holds_state() -> None:
    from verl_hpc.runtime.step.memory import has_optimizer_state

    class Actor:
        def __init__(self) -> None:
            self.weight = torch.nn.Parameter(torch.ones(3))
            self.optimizer = torch.optim.AdamW([self.weight])

    actor = Actor()
    assert not has_optimizer_state(actor)  # a fresh run's first step
    actor.weight.sum().backward()
    actor.optimizer.step()
    assert has_optimizer_state(actor)  # every later step, and a resumed run's first
    assert has_optimizer_state(object())  # nothing to ask: the steady state


def test_budget_parsers() -> None:
    assert meminfo_available("MemTotal: 100 kB\nMemAvailable:   2048 kB\n") == 2048 * 1024
    assert cgroup_room("max\n", "123\n") is None  # v2, no limit
    assert cgroup_room("9223372036854771712\n", "5") is None  # v1's "no limit"
    assert cgroup_room("1000\n", "700\n", "anon 1\ninactive_file 200\n") == 500  # page cache is reclaimable
    assert cgroup_room("1000", "1200", "total_inactive_file 0") == 0
    assert address_space_room(resource.RLIM_INFINITY, 5) is None
    assert address_space_room(10 * GIB, 4 * GIB) == 6 * GIB
    assert Budget(8 * GIB, "x").share(4).bytes == 2 * GIB


def test_a_roomy_host_turns_on_checkpointing_only_where_it_halves_the_step() -> None:
    plan = plan_memory(shape(), STEP, DEFAULTS, frozenset(), Budget(64 * GIB, "test"), 0.15, mini_rows=32)
    assert plan.changed() == {"model.gradient_checkpointing": True}
    assert "halves the step" in "\n".join(plan.lines())
    gpu = plan_memory(shape(), Workload(**{**STEP.__dict__, "device": "cuda", "floor_bytes": 0}), DEFAULTS,
                      frozenset(), Budget(64 * GIB, "test"), 0.15, mini_rows=32)
    assert gpu.changed() == {}  # a GPU's memory is the job's own: only the fit counts
    tiny = ModelShape(hidden=96, layers=2, heads=4, kv_heads=2, head_dim=24, intermediate=256, vocab=64)
    small_step = Workload(rows=128, prompt_tokens=8, response_tokens=4, ref=True, engine="hf_shared",
                          generate_rows=128, floor_bytes=int(0.45 * GIB))
    assert plan_memory(tiny, small_step, Switches(micro_batch_rows=128), frozenset(), Budget(64 * GIB, "t"), 0.15,
                       mini_rows=128).changed() == {}  # nothing worth a recompute: the quickstart is untouched


def test_a_tight_budget_climbs_the_ladder_cheapest_first() -> None:
    order = ("model.logprob_chunk_tokens", "model.remove_padding", "algorithm.use_dynamic_bsz",
             "algorithm.max_token_len_per_gpu", "model.gradient_checkpointing", "algorithm.micro_batch_size",
             "rollout.generate_rows")
    trainer = Workload(**{**STEP.__dict__, "engine": None, "generate_rows": 0})  # split: no engine here
    plan = plan_memory(shape(), trainer, DEFAULTS.with_(logprob_chunk_tokens=0), frozenset(),
                       Budget(int(3.9 * GIB), "test"), 0.15, mini_rows=32)
    assert plan.fits
    changed = plan.changed()
    assert 0 < changed["model.logprob_chunk_tokens"] <= 1024 and changed["model.gradient_checkpointing"] is True
    assert changed["algorithm.micro_batch_size"] < 32 and 32 % changed["algorithm.micro_batch_size"] == 0
    assert list(changed) == [f for f in order if f in changed]  # in the order the ladder took them
    # With the engine here, generating 64 rows at once holds the peak once the update is bounded:
    # its prompts go in chunks.
    wide = Workload(**{**STEP.__dict__, "generate_rows": 64})
    rollout = plan_memory(shape(), wide, DEFAULTS, frozenset(), Budget(int(4.1 * GIB), "test"), 0.15,
                          mini_rows=32, generate_chunks=True)
    assert rollout.fits and rollout.changed()["rollout.generate_rows"] < 64
    hopeless = plan_memory(shape(), STEP, DEFAULTS, frozenset(), Budget(GIB, "test"), 0.15, mini_rows=32)
    assert not hopeless.fits and "DOES NOT FIT" in hopeless.lines()[0]


@pytest.mark.parametrize("switch", MEMORY_SWITCHES)
def test_an_explicit_switch_is_never_changed(switch: str) -> None:
    """Each switch set in the config (even to its default) stays, however short the memory."""
    start = DEFAULTS.with_(logprob_chunk_tokens=0)
    by_tokens = switch in ("algorithm.use_dynamic_bsz", "algorithm.max_token_len_per_gpu")
    # A trainer rank without an engine; the reference offloads only on a GPU; rows shorter than the
    # batch's width give the token budget its use.
    work = Workload(**{**STEP.__dict__, "device": "cuda" if switch == "model.param_offload.ref" else "cpu",
                       "floor_bytes": 0, "engine": None, "generate_rows": 0, "mean_tokens": 90.0 if by_tokens else None})
    tokens = None  # the config's token budget, when it sets one: long rows, whose activations it bounds
    if switch == "algorithm.max_token_len_per_gpu":
        work, tokens = Workload(**{**work.__dict__, "prompt_tokens": 512, "response_tokens": 256,
                                   "mean_tokens": 600.0}), 8000
    budget = Budget(int((2.6 if work.device == "cuda" else 2.3) * GIB), "test")

    def plan(explicit: frozenset[str]):
        return plan_memory(shape(), work, start, explicit, budget, 0.0, mini_rows=32, budget_tokens=tokens,
                           economy=False)

    free, locked = plan(frozenset()), plan(frozenset({switch}))
    assert switch in free.changed(), f"{switch}: the test's budget must make the plan want it"
    if switch == "algorithm.max_token_len_per_gpu":  # the plan may turn micro-batches by tokens on, at that budget
        assert free.switches.token_budget < 8000 and locked.switches.token_budget == 8000
        return
    values = {d.field: d for d in locked.decisions}
    assert switch not in locked.changed()
    assert values[switch].why == "set in the config" and not values[switch].by_plan


def test_an_explicit_token_budget_is_the_one_used_and_kept() -> None:
    work = Workload(**{**STEP.__dict__, "engine": None, "generate_rows": 0, "mean_tokens": 90.0})
    plan = plan_memory(shape(), work, DEFAULTS, frozenset({"algorithm.max_token_len_per_gpu"}),
                       Budget(int(3.3 * GIB), "test"), 0.0, mini_rows=32, budget_tokens=2000, economy=False)
    assert plan.switches.token_budget == 2000 and plan.changed()["algorithm.use_dynamic_bsz"] is True
    kept = next(d for d in plan.decisions if d.field == "algorithm.max_token_len_per_gpu")
    assert kept.value == 2000 and kept.why == "set in the config"
