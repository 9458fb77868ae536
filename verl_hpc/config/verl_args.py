"""verl's command line (`python3 -m verl.trainer.main_ppo KEY=VALUE ...`) as a verl-hpc config.

Why a table: a verl user's run script is a list of Hydra overrides. Each verl key that
changes what a run computes has one row in `KEYS` — its verl 0.9.1 default, the verl-hpc
field(s) it sets and how — and `IGNORED` names the keys that only steer Ray, the engines'
speed or memory, with the reason. Any other key is refused in one line naming it: no
override is silently dropped. docs/verl.md is generated from these two tables
(tools/gen_verl_docs.py), so the documentation is the code.

Why every row applies even when the key is not given: a verl key left out means verl's
default (lr 1e-6, lam 1.0, weight decay 0.01, ...), which is often not verl-hpc's. The
made config therefore states every such value; `verl-hpc verl --print-config` prints it.

Counts: verl's `data.train_batch_size` and `ppo_mini_batch_size` count *prompts*;
verl-hpc's `trainer.batch_size` and `algorithm.mini_batch_size` count *sequences*
(prompts x `rollout.n`). The conversion multiplies and says so (`Conversion.comments`).
Pure: no file is read here (the CLI passes the number of training rows for
`trainer.total_epochs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.verl_keys import ALWAYS, DEFAULTS, IGNORED, KEYS, PREFIX_KEYS
from verl_hpc.config.verl_rules import NOT_SET, VerlArgs, VerlKey, set_path

__all__ = ["Conversion", "IGNORED", "KEYS", "NOT_SET", "VerlKey", "parse_overrides", "verl_to_config"]


SECTION_ORDER = ("model", "data", "reward", "algorithm", "trainer", "resources", "checkpoint", "logging", "slurm",
                 "run_dir")


class _PlainDumper(yaml.SafeDumper):
    """No `&id001` anchors for lists that happen to be shared: a config a reader can edit."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass
class Conversion:
    """The made config (a dict that `load_config(data=...)` validates) and what to tell the user."""

    config: dict[str, Any]
    comments: list[str] = field(default_factory=list)       # the sequence counts, stated
    ignored: list[tuple[str, Any, str]] = field(default_factory=list)  # (verl key, value, why)

    def yaml(self) -> str:
        """The config as YAML under comments a reader can keep with it."""
        head = ["# made by `verl-hpc verl` from verl's arguments; every verl key not given has verl 0.9.1's default",
                *[f"# {line}" for line in self.comments]]
        if self.ignored:
            head.append("# accepted and ignored (they steer Ray, engine speed or memory only):")
            head += [f"#   {key}={value!r}: {why}" for key, value, why in self.ignored]
        ordered = {k: self.config[k] for k in sorted(self.config, key=_section_rank)}
        return "\n".join(head) + "\n" + yaml.dump(ordered, Dumper=_PlainDumper, sort_keys=False)


def _section_rank(name: str) -> int:
    return SECTION_ORDER.index(name) if name in SECTION_ORDER else len(SECTION_ORDER)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`key=value` items as Hydra reads them (values as YAML; a leading `+`/`++` adds a key, as here)."""
    given: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.lstrip("+")
        if item.startswith("~") or not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(item, "is not a verl override of the form key.path=value",
                              "e.g. data.train_batch_size=256 (deleting keys with ~ is not supported)")
        given[key] = hydra_value(raw)
    return given


def hydra_value(raw: str) -> Any:
    """A value as Hydra reads it: YAML, except that `1e-6` is a number (YAML 1.1 wants `1.0e-6`)."""
    if raw == "":
        return ""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") and value.lower() not in ("inf", "nan") \
                else int(value)
        except ValueError:
            return value
    return value


def _classify(given: dict[str, Any]) -> tuple[list[tuple[str, Any, str]], dict[str, Any]]:
    """(the ignored keys with their reasons, the prefix-rule keys); refuses a key that maps to nothing."""
    known = {k.key for k in KEYS}
    ignored, prefixed = [], {}
    for key, value in given.items():
        if key in known:
            continue
        prefix = next((p for p in PREFIX_KEYS if key.startswith(p)), None)
        if prefix is not None:
            prefixed[key] = value
            continue
        why = IGNORED.get(key) or next((r for p, r in IGNORED.items() if p.endswith("*") and key.startswith(p[:-1])),
                                       None)
        if why is None:
            raise ConfigError(key, "is a verl key that maps to nothing in verl-hpc",
                              "remove it, or see docs/verl.md for the keys verl-hpc takes")
        ignored.append((key, value, why))
    return ignored, prefixed


def verl_to_config(overrides: list[str], train_rows: int | None = None) -> Conversion:
    """verl's overrides -> a verl-hpc config dict; `train_rows`: rows of data.train_files (for epochs)."""
    given = parse_overrides(overrides)
    ignored, prefixed = _classify(given)
    args = VerlArgs(given, train_rows, DEFAULTS)
    config: dict[str, Any] = {}
    for rule in KEYS:
        value = args.get(rule.key)
        if rule.put is None or (value is NOT_SET and rule.key not in ALWAYS):
            continue
        for path, out in rule.put(value, args):
            set_path(config, path, out)
    for prefix, put in PREFIX_KEYS.items():
        for key in (k for k in prefixed if k.startswith(prefix)):
            for path, out in put(key[len(prefix):], prefixed[key], args):
                set_path(config, path, out)
    return Conversion(config, args.comments(), ignored)
