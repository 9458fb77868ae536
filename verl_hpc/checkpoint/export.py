"""Export the policy of a DCP checkpoint as a Hugging Face directory, one tensor at a time.

Why streaming: the checkpoint may be sharded over many ranks and larger than one node's
memory would like; the exporter reads DCP's metadata (every key's shape and dtype),
writes the safetensors header first, then loads and appends one tensor at a time
(`dcp.load` of a single key reassembles it from all shards), so peak memory is about
one tensor. No process group is needed. The directory appears atomically (temp + rename).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from verl_hpc.checkpoint.export_lora import write_lora_export
from verl_hpc.checkpoint.layout import (
    CheckpointError,
    SafeFileSystemReader,
    check_tensors_only,
    read_dcp_metadata,
    read_manifest,
)
from verl_hpc.utils.fs import replace_dir

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
# Files of a model directory that are weights (replaced by ours), not config or tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".index.json")
# The marker of a freshly built random model (models/tiny.py): an export is not that model.
_NOT_COPIED = {"verl_hpc_model.json"}


def _tied(model_dir: Path) -> tuple[bool, bool]:
    """(tie_word_embeddings, is a causal LM) from the model's config, with the class's defaults."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    causal = any(a.endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or []))
    return tied, causal


def policy_tensors(checkpoint: Path, prefix: str, model_dir: Path) -> dict[str, tuple[str, Any]]:
    """HF name -> (DCP key, TensorStorageMetadata) for the policy's weights, in writing order."""
    metadata = read_dcp_metadata(checkpoint)
    check_tensors_only(checkpoint, metadata)
    found = {key[len(prefix):]: (key, md) for key, md in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not found:
        roots = sorted({k.split(".")[0] for k in metadata.state_dict_metadata})
        raise CheckpointError(f"{checkpoint}: no tensor key starts with {prefix!r} (top-level keys: {roots})")
    tied, causal = _tied(model_dir)
    if tied:
        found.pop("lm_head.weight", None)  # HF re-ties it to the embedding on load
    elif causal and "lm_head.weight" not in found:
        raise CheckpointError(f"{checkpoint}: the model has untied embeddings but no {prefix}lm_head.weight")
    # Larger elements first keeps every tensor naturally aligned in the file.
    order = sorted(found, key=lambda n: (-found[n][1].properties.dtype.itemsize, n))
    return {name: found[name] for name in order}


def _header(tensors: dict[str, tuple[str, Any]]) -> bytes:
    """safetensors header: JSON of dtype/shape/offsets, space-padded to 8 bytes, length-prefixed."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (_key, md) in tensors.items():
        dtype = md.properties.dtype
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {dtype}, which safetensors cannot hold")
        nbytes = md.size.numel() * dtype.itemsize
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(md.size),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(checkpoint: Path, tensors: dict[str, tuple[str, Any]], out_file: Path) -> int:
    """Stream the tensors from DCP into `out_file`; returns the bytes written."""
    reader_metadata = read_dcp_metadata(checkpoint)
    with open(out_file, "wb") as fh:
        fh.write(_header(tensors))
        for name, (key, md) in tensors.items():
            holder = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)}
            dcp.load(holder, storage_reader=SafeFileSystemReader(checkpoint, reader_metadata), no_dist=True)
            data = holder.pop(key).contiguous().reshape(-1).view(torch.uint8).numpy()
            if fh.write(memoryview(data)) != data.nbytes:
                raise OSError(f"short write of {name} to {out_file}")
        fh.flush()
        os.fsync(fh.fileno())
        return fh.tell()


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
              model_dir: str | os.PathLike | None = None, prefix: str = "actor.model.",
              adapter: bool = False) -> Path:
    """Write `out_dir` = config/tokenizer files of `model_dir` + `model.safetensors` of the policy.

    `model_dir` (the original HF model) defaults to the `model_dir` recorded in the
    checkpoint's manifest meta. An existing `out_dir` is replaced only if it holds a
    model (config.json, adapter_config.json) or nothing, so a mistyped path cannot wipe
    unrelated files. A LoRA run's checkpoint (`model.lora` in its meta) is merged into the
    base model, or with `adapter` written as the adapter alone (export_lora.py).
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    meta = read_manifest(checkpoint).get("meta", {})
    model_dir = Path(model_dir or meta.get("model_dir") or "")
    lora = meta.get("lora")
    if adapter and lora is None:
        raise CheckpointError(f"{checkpoint} is not from a LoRA run (no model.lora in its meta): it has no "
                              "adapter to export; drop --adapter to export the model")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"model directory {str(model_dir) or '<none>'} has no config.json; pass "
                              "--model-dir (the checkpoint's meta records no usable model_dir)")
    if out_dir.exists() and any(out_dir.iterdir()) and not any(
            (out_dir / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise CheckpointError(f"{out_dir} exists and is not a model directory; choose a new or empty one")
    tensors = policy_tensors(checkpoint, prefix, model_dir) if lora is None else {}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for src in sorted(model_dir.iterdir()):
            if adapter:
                break
            if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES) and src.name not in _NOT_COPIED:
                shutil.copy2(src, staging / src.name)
        if lora is not None:
            write_lora_export(checkpoint, staging, model_dir, prefix, lora, adapter)
        else:
            write_safetensors(checkpoint, tensors, staging / "model.safetensors")
        os.chmod(staging, 0o755)
        replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir

