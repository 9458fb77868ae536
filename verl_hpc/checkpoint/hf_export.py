"""Hugging Face directories written atomically: a half-written model is never visible.

Why atomic: users point inference servers and evaluation jobs at `hf_model/`; a job
killed mid-save must leave either the previous directory or the complete new one.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from verl_hpc.utils.fs import replace_dir


def save_hf_directory(model: torch.nn.Module, tokenizer, out_dir: str | Path) -> Path:
    """`save_pretrained` (safetensors) + tokenizer into a temp sibling, then rename into place."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        replace_dir(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out
