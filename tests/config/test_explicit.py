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
from verl_hpc.runtime.step.memory import MemorySeat, plan_process

QUICKSTART = REPO / "configs" / "quickstart.yaml"
# The value each switch is pinned to: its default where the plan would change the default, so the
# test shows that "written, even as the default" counts as the user's decision.
PINNED = {"model.logprob_chunk_tokens": 0, "model.remove_padding": False, "model.gradient_checkpointing": False,
          "model.param_offload.ref": False, "algorithm.use_dynamic_bsz": False,
          "algorithm.max_token_len_per_gpu": 4096, "algorithm.micro_batch_size": 16}
# Tight enough that the plan switches on padding removal, checkpointing and smaller micro-batches
# for the tiny model's quickstart step (the shape comes from its `init_preset`, no weights needed).
TIGHT = ["model.memory_budget_gb=0.6", "model.path=/nonexistent/tiny"]


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
    cfg = load_config(QUICKSTART, [*TIGHT, override])
    explicit = explicit_fields(cfg)
    assert switch in explicit
    planned, watch = plan_process(cfg, MemorySeat(("actor", "rollout", "ref"), torch.device("cpu")), explicit)
    assert watch is not None
    assert _value(planned, switch) == PINNED[switch], (switch, watch.plan.lines())
    kept = [d for d in watch.plan.decisions if d.field == switch]
    assert all(not d.by_plan for d in kept), kept


def test_the_tight_budget_makes_the_plan_change_what_is_left_out() -> None:
    """The control for the test above: left out, the same switches are the plan's to turn on."""
    cfg = load_config(QUICKSTART, TIGHT)
    planned, watch = plan_process(cfg, MemorySeat(("actor", "rollout", "ref"), torch.device("cpu")),
                                  explicit_fields(cfg))
    assert watch is not None and watch.plan.fits
    changed = watch.plan.changed()
    assert {"model.remove_padding", "model.gradient_checkpointing", "algorithm.micro_batch_size"} <= set(changed)
    assert planned.model.gradient_checkpointing and planned.model.remove_padding
    assert planned.algorithm.micro_batch_size == changed["algorithm.micro_batch_size"] < cfg.trainer.batch_size


def test_the_worker_processes_read_what_the_launcher_recorded(tmp_path: Path) -> None:
    """Workers read the full `config.yaml`; the record beside it says which fields the user wrote."""
    from verl_hpc.runtime.state.run_dir import read_explicit, write_explicit

    cfg = load_config(QUICKSTART, ["model.gradient_checkpointing=false"])
    write_explicit(tmp_path, cfg)
    assert read_explicit(tmp_path) == explicit_fields(cfg)
    # A run directory made before the record existed: every switch stays as its config says.
    assert read_explicit(tmp_path / "older") == frozenset(MEMORY_SWITCHES)
