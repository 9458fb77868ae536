"""What a config sets itself, read from YAML and overrides as a user writes them, and the memory
plan leaving each such switch as written however short the memory (the config path end to end:
`load_config` -> `explicit_fields` -> `plan_process`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from verl_hpc.config import load_config
from verl_hpc.config.explicit import MEMORY_SWITCHES, explicit_fields, preset_keys
from verl_hpc.roles.memory.budget import runtime_floor
from verl_hpc.roles.memory.estimate import RUNTIME_GROWTH_CPU
from verl_hpc.runtime.step.memory import MemorySeat, plan_process

QUICKSTART = REPO / "configs" / "quickstart.yaml"
# The value each switch is pinned to: its default where the plan would change the default, so the
# test shows that "written, even as the default" counts as the user's decision.
PINNED = {"model.logprob_chunk_tokens": 0, "model.remove_padding": False, "model.gradient_checkpointing": False,
          "model.param_offload.ref": False, "algorithm.use_dynamic_bsz": False,
          "algorithm.max_token_len_per_gpu": 4096, "algorithm.micro_batch_size": 16}
GIB = 1 << 30


def tight() -> list[str]:
    """Overrides that leave the tiny model's quickstart step 0.15 GiB above what this process holds
    now, no headroom: without switches its step needs ~0.2 GiB more, with them ~0.08 (the shape
    comes from the model's `init_preset`, no weights needed). Relative to this process, because
    the plan counts what it holds, and a test process holds what earlier tests loaded."""
    budget = (runtime_floor() + RUNTIME_GROWTH_CPU) / GIB + 0.15
    return [f"model.memory_budget_gb={budget:.3f}", "model.memory_headroom=0", "model.path=/nonexistent/tiny"]


def _value(cfg, field: str):
    section, _, rest = field.partition(".")
    value = getattr(cfg, section)
    for part in rest.split("."):
        value = getattr(value, part)
    return value


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_defaults_and_presets_set_no_memory_switch() -> None:
    """A switch the quickstart or a preset fills in would look like the user's and block the plan."""
    cfg = load_config(QUICKSTART)
    assert not set(MEMORY_SWITCHES) & explicit_fields(cfg)
    assert not set(MEMORY_SWITCHES) & preset_keys()
    for name in ("grpo", "ppo", "dapo", "rloo"):
        assert not set(MEMORY_SWITCHES) & explicit_fields(load_config(QUICKSTART, [f"algorithm.name={name}"]))


@pytest.mark.parametrize("switch", MEMORY_SWITCHES)
def test_a_switch_written_in_the_config_is_explicit_and_kept_by_the_plan(switch: str, tmp_path: Path) -> None:
    override = f"{switch}={_yaml(PINNED[switch])}"
    cfg = load_config(QUICKSTART, [*tight(), override])
    explicit = explicit_fields(cfg)
    assert switch in explicit
    planned, watch = plan_process(cfg, MemorySeat(("actor", "rollout", "ref"), torch.device("cpu")), explicit)
    assert watch is not None
    assert _value(planned, switch) == PINNED[switch], (switch, watch.plan.lines())
    kept = [d for d in watch.plan.decisions if d.field == switch]
    assert all(not d.by_plan for d in kept), kept


def test_the_tight_budget_makes_the_plan_change_what_is_left_out() -> None:
    """The control for the test above: left out, the same switches are the plan's to turn on."""
    cfg = load_config(QUICKSTART, tight())
    planned, watch = plan_process(cfg, MemorySeat(("actor", "rollout", "ref"), torch.device("cpu")),
                                  explicit_fields(cfg))
    assert watch is not None and watch.plan.fits
    changed = watch.plan.changed()
    assert {"model.remove_padding", "model.gradient_checkpointing"} <= set(changed)
    for field, value in ((f, v) for f, v in changed.items() if f in MEMORY_SWITCHES):  # the config runs the plan
        assert _value(planned, field) == value, field
