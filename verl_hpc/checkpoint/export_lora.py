"""Export a LoRA run's checkpoint: the merged model, or the adapter alone in peft's format.

Why not streamed like a full export (export.py): the checkpoint holds only the adapters
(a few MB); the base weights come from the model directory, so the merge needs the base
model in memory once. peft itself writes both forms, so what `PeftModel.from_pretrained`
and `AutoModelForCausalLM.from_pretrained` read back is exactly their own format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from verl_hpc.checkpoint.layout import (
    CheckpointError,
    SafeFileSystemReader,
    check_tensors_only,
    read_dcp_metadata,
)


def adapter_tensors(checkpoint: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The adapters' tensors, keyed as in the adapted model (`model.layers.0...lora_A.default.weight`)."""
    metadata = read_dcp_metadata(checkpoint)
    check_tensors_only(checkpoint, metadata)
    keys = {key: md for key, md in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and ".lora_" in key and isinstance(md, TensorStorageMetadata)}
    if not keys:
        raise CheckpointError(f"{checkpoint}: its manifest says model.lora, but no {prefix}*.lora_* tensor is in it")
    holder = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in keys.items()}
    dcp.load(holder, storage_reader=SafeFileSystemReader(checkpoint, metadata), no_dist=True)
    return {key[len(prefix):]: tensor for key, tensor in holder.items()}


def adapted_model(checkpoint: Path, model_dir: Path, prefix: str, lora: dict[str, Any]):
    """A peft `PeftModel`: the base model of `model_dir` with the checkpoint's adapters loaded."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise CheckpointError("exporting a LoRA checkpoint needs peft: pip install 'verl-hpc[lora]'") from None
    from transformers import AutoModelForCausalLM

    tensors = adapter_tensors(checkpoint, prefix)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=lora["target_modules"],
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    missing, unexpected = model.base_model.model.load_state_dict(tensors, strict=False)
    absent = [name for name in missing if ".lora_" in name]
    if absent or unexpected:
        raise CheckpointError(f"{checkpoint}: its adapters do not fit {model_dir} with {lora} (missing "
                              f"{absent[:3]}, unexpected {sorted(unexpected)[:3]})")
    return model


def write_lora_export(checkpoint: Path, staging: Path, model_dir: Path, prefix: str, lora: dict[str, Any],
                      adapter: bool) -> None:
    """Into `staging`: the adapter alone (`adapter_config.json` + weights) or the merged model."""
    model = adapted_model(checkpoint, model_dir, prefix, lora)
    if adapter:
        model.save_pretrained(staging)
    else:
        model.merge_and_unload().save_pretrained(staging, safe_serialization=True)
