"""Hydra-style overrides (`key=value`, `~key`): parsed as YAML, applied before validation.

Split from tests/config/test_config.py to keep both short.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_hpc.config import ConfigError, apply_overrides, load_config

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def test_overrides_parse_values_as_yaml() -> None:
    base = {"a": {"keep": "yes"}}

    out = apply_overrides(base, ["a.b=3", "a.c=[1,2]", "x.y=off", "x.z=null", "x.s='3'", "x.f=0.5",
                                 "x.m={k: v}", "a.t=hello world", "+n.new=1"])

    assert out == {"a": {"keep": "yes", "b": 3, "c": [1, 2], "t": "hello world"},
                   "x": {"y": False, "z": None, "s": "3", "f": 0.5, "m": {"k": "v"}}, "n": {"new": 1}}
    assert type(out["a"]["b"]) is int and type(out["x"]["f"]) is float
    assert base == {"a": {"keep": "yes"}}  # the input is not modified


def test_override_value_that_is_not_yaml_stays_a_string() -> None:
    assert apply_overrides({}, ["a.b=[1,2"]) == {"a": {"b": "[1,2"}}


def test_override_replaces_existing_values_and_sections() -> None:
    out = apply_overrides({"t": {"steps": 5, "opt": {"lr": 1}}}, ["t.steps=7", "t.opt={lr: 2, wd: 0}"])

    assert out == {"t": {"steps": 7, "opt": {"lr": 2, "wd": 0}}}


def test_tilde_deletes_and_never_adds() -> None:
    base = {"a": {"b": 1, "c": 2}, "top": 3}

    out = apply_overrides(base, ["~a.b", "~top", "~a.missing", "~absent.section.key"])

    assert out == {"a": {"c": 2}}
    assert base == {"a": {"b": 1, "c": 2}, "top": 3}


def test_deleting_inside_an_absent_role_does_not_enable_it() -> None:
    cfg = load_config(QUICKSTART, ["~resources.critic.strategy", "~resources.ref.device_ids"])

    assert cfg.resources.critic is None and cfg.resources.ref is None


@pytest.mark.parametrize(("override", "named"), [
    ("trainer.total_steps", "trainer.total_steps"),
    ("=3", "=3"),
    ("a..b=1", "a..b"),
    (".a=1", ".a"),
    ("a.=1", "a."),
    ("~", "~"),
    ("a.b.c=1", "a.b"),  # a.b is an int, not a section
], ids=["no-equals", "no-key", "empty-middle-part", "empty-first-part", "empty-last-part", "bare-tilde",
        "through-a-scalar"])
def test_bad_override_raises_config_error_naming_it(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({"a": {"b": 2}}, [override])

    assert info.value.path == named
    assert info.value.one_line().startswith(f"{named}: ")
    assert len(info.value.one_line().splitlines()) == 1


def test_overrides_reach_the_validated_config() -> None:
    cfg = load_config(QUICKSTART, ["trainer.total_steps=7", "trainer.actor_optim.lr=1e-4", "logging.progress=off",
                                   "algorithm.sampling.n=4", "~algorithm.entropy_coef"])

    assert cfg.trainer.total_steps == 7
    assert cfg.trainer.actor_optim.lr == pytest.approx(1e-4)
    assert cfg.logging.progress == "off"  # YAML reads `off` as False; the schema maps it back
    assert cfg.algorithm.sampling.n == 4
    assert cfg.algorithm.entropy_coef == 0.0  # deleted, so the default
