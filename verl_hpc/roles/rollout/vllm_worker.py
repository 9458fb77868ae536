"""Runs inside vLLM's worker: replaces the served weights in place from a safetensors file.

Why a worker extension and a file: vLLM's own weight-transfer API needs CUDA/NCCL, and
tensors handed to `collective_rpc` arrive as lists; a file in /dev/shm (shared memory)
costs one memcpy and works for every executor, including tensor-parallel workers, each
of which loads its own shard from the checkpoint-format names.

Why the lm_head repack on CPU: vLLM's CPU GEMM keeps a pre-packed copy of each linear
weight. With tied embeddings the LM head shares the embedding's tensor, so reloading the
embedding leaves the head's packed copy stale: logits would come from the old policy.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightReloadExtension:
    """Mixed into vLLM's worker class via `worker_extension_cls`; methods run per worker."""

    model_runner: Any

    def verl_hpc_reload(self, path: str) -> int:
        """Load every tensor in `path` into the served model; returns the element count."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        model = self.model_runner.get_model()
        if torch.device(self.model_runner.device).type == "cpu":
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
            _repack_tied_head(model)
        else:
            model.load_weights(weights=iter(tensors.items()))
        return sum(t.numel() for t in tensors.values())


def _repack_tied_head(model: torch.nn.Module) -> None:
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    config = getattr(model, "config", None)
    if head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
        return
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
