"""Which fields a config sets itself, as dotted paths: what an automatic choice must leave alone.

Why pydantic's `model_fields_set` and not a comparison with the defaults: a user who writes
`gradient_checkpointing: false` has decided, even though it is the default, and the memory
plan must not turn it on. `model_fields_set` holds exactly the keys that were given (a
preset's expansion included: see `PRESET_KEYS`), recursively per section. A run directory's
`config.yaml` lists every field, so the launching process records this set beside it
(`explicit_fields.json`, runtime/state/run_dir.py) for the worker processes to read.
"""

from __future__ import annotations

from pydantic import BaseModel

# The switches the memory plan (roles/memory/) may set when the config leaves them out.
MEMORY_SWITCHES = (
    "model.logprob_chunk_tokens", "model.remove_padding", "model.gradient_checkpointing", "model.param_offload.ref",
    "algorithm.use_dynamic_bsz", "algorithm.max_token_len_per_gpu", "algorithm.micro_batch_size",
)


def explicit_fields(cfg: BaseModel, prefix: str = "") -> frozenset[str]:
    """Every field `cfg` was given, as dotted paths (`model.remove_padding`), sections included."""
    out: set[str] = set()
    for name in cfg.model_fields_set:
        path = f"{prefix}{name}"
        out.add(path)
        value = getattr(cfg, name, None)
        if isinstance(value, BaseModel):
            out |= explicit_fields(value, f"{path}.")
    return frozenset(out)


def preset_keys() -> frozenset[str]:
    """Dotted `algorithm.*` keys some `algorithm.name` preset fills in (config/presets.py).

    Why it matters: a preset's keys land in `model_fields_set` like the user's own, so a
    memory switch that a preset filled would look explicit. `tests/config/test_explicit.py`
    checks that no preset names a memory switch.
    """
    from verl_hpc.config.presets import PRESETS

    keys: set[str] = set()
    for preset in PRESETS.values():
        for key, value in preset.items():
            keys.add(f"algorithm.{key}")
            if isinstance(value, dict):
                keys |= {f"algorithm.{key}.{inner}" for inner in value}
    return frozenset(keys)
