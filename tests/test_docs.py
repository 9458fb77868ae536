"""docs/configuration.md must match the schema: regenerated block in sync, every field listed.

Why a test: the reference is generated, but only when someone runs the generator; this
fails CI the moment a field is added, renamed or given a new default without it.
"""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from verl_hpc.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"


def _nested_model(annotation: object) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def leaf_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths (aliases where set) of every field that holds a value, not a section."""
    paths = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        child = _nested_model(info.annotation)
        paths.extend(leaf_paths(child, path + ".") if child is not None else [path])
    return paths


def test_generated_reference_is_up_to_date() -> None:
    result = subprocess.run([sys.executable, "tools/gen_config_docs.py", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        "docs/configuration.md is out of date; run `python tools/gen_config_docs.py`\n" + result.stderr)


def test_every_leaf_field_is_documented() -> None:
    text = DOC.read_text()
    paths = leaf_paths(RunConfig)
    assert {"checkpoint.async", "resources.rollout.vllm_args.gpu_memory_utilization",
            "algorithm.sampling.n", "trainer.actor_optim.lr", "run_dir"} <= set(paths)
    missing = [p for p in paths if f"`{p}`" not in text]
    assert not missing, f"fields missing from docs/configuration.md: {missing}"
