"""Log-probs and entropies without the full-vocab tensor (`model.logprob_chunk_tokens`).

The chunked path must give the whole-logits numbers and gradients, keep no `[tokens, vocab]`
tensor for backward, and step aside for models whose logits are not just `head(hidden)`.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from verl_hpc.models.tiny import PRESETS, build_model
from verl_hpc.roles.forward import batched_logprobs, chunkable_head, response_logprobs

VOCAB, PAD, EOS = 512, 0, 1  # a vocab several times the hidden size, as in real models (49k vs 576)


def tiny(preset: str = "tiny", seed: int = 0) -> torch.nn.Module:
    return build_model(PRESETS[preset], VOCAB, PAD, EOS, seed)


def inputs(rows: int = 6, prompt: int = 5, response: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses, as `RolloutBatch.model_inputs` lays them out."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, prompt + response), generator=gen)
    attention = torch.ones_like(ids)
    for row in range(rows):
        attention[row, :row % 3] = 0  # prompt padding
        attention[row, prompt + response - row % 4:] = 0  # response padding
    ids = ids.masked_fill(attention == 0, PAD)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": positions,
            "response_mask": attention[:, prompt:].float()}


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])  # tied and untied heads
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_bonus", [True, False])  # autograd under a checkpoint; the hand-written backward
def test_chunks_give_the_whole_logits_numbers_and_gradients(preset: str, temperature: float,
                                                            entropy_bonus: bool) -> None:
    batch = inputs()
    results = {}
    for chunk in (0, 7, 53):  # whole; chunks not dividing the 54 tokens; a chunk and a row
        model = tiny(preset)
        logprobs, entropy = response_logprobs(model, batch, temperature, with_entropy=True, chunk_tokens=chunk,
                                              entropy_grad=entropy_bonus)
        mask = batch["response_mask"]
        ((logprobs * mask).sum() + (0.1 * (entropy * mask).sum() if entropy_bonus else 0)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[chunk] = logprobs.detach(), entropy.detach(), grads
    whole_lp, whole_ent, whole_grads = results[0]
    assert whole_lp.shape == batch["response_mask"].shape
    for chunk in (7, 53):
        lp, ent, grads = results[chunk]
        torch.testing.assert_close(lp, whole_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, whole_ent, rtol=1e-5, atol=1e-5)
        assert grads.keys() == whole_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, whole_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_inference_passes_agree_and_never_touch_the_pad_token() -> None:
    model, batch = tiny(), inputs(rows=5)
    with torch.no_grad():
        whole = batched_logprobs(model, batch, 1.0, micro_batch_size=2, chunk_tokens=0)
        chunked = batched_logprobs(model, batch, 1.0, micro_batch_size=2, chunk_tokens=4)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    pad_batch = {**batch, "input_ids": batch["input_ids"].clone()}
    pad_batch["input_ids"][:, -1] = PAD  # the pad token as a label: excluded from the distribution
    with torch.no_grad():
        lp, _ = response_logprobs(model, pad_batch, 1.0, chunk_tokens=4)
    assert bool((lp[:, -1] < -1e8).all())


def largest_saved(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int) -> int:
    """Elements of the largest tensor autograd keeps for backward with a vocab-sized last dim."""
    largest = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        if tensor.dim() and tensor.shape[-1] == VOCAB and tensor.dtype.is_floating_point:
            largest = max(largest, tensor.numel())
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, entropy = response_logprobs(model, batch, 1.0, with_entropy=True, chunk_tokens=chunk)
    (logprobs.sum() + entropy.sum()).backward()
    return largest


def test_backward_keeps_no_logits_beyond_a_chunk() -> None:
    """The memory claim, measured on what autograd saves: whole keeps [B*R, V] tensors, chunks none.

    The head's weight is [V, H] and is kept either way (it is the model); with chunks nothing
    else vocab-wide is saved, since each chunk's logits are recomputed in backward.
    """
    batch = inputs(rows=8, response=16)
    tokens = batch["response_mask"].numel()
    weight = VOCAB * PRESETS["tiny"].hidden_size
    assert largest_saved(tiny(), batch, chunk=0) >= tokens * VOCAB
    assert largest_saved(tiny(), batch, chunk=16) <= max(16 * VOCAB, weight)
    assert tokens * VOCAB > weight  # the test means something: the whole logits outsize the head


def test_a_batch_within_one_chunk_keeps_the_whole_paths_numbers_bit_for_bit() -> None:
    model, batch = tiny(), inputs()  # 54 response tokens
    with torch.no_grad():
        whole, _ = response_logprobs(model, batch, 1.0, chunk_tokens=0)
        within, _ = response_logprobs(model, batch, 1.0, chunk_tokens=54)
    assert torch.equal(within, whole)


def test_models_that_rescale_their_logits_take_the_whole_path() -> None:
    model = tiny()
    assert chunkable_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert chunkable_head(model) is None
    batch = inputs()
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch, 1.0, chunk_tokens=4)
        whole, _ = response_logprobs(model, batch, 1.0, chunk_tokens=0)
    assert torch.equal(lp, whole)


def vocab_wide_work(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int,
                    entropy_grad: bool) -> tuple[int, int, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Elements of every `[.., V]` tensor autograd saves, and of every one backward computes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB:
                    self.elements += t.numel()
            return out

    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if tensor.dim() and tensor.shape[-1] == VOCAB and tensor.dtype.is_floating_point:
            saved += tensor.numel()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, entropy = response_logprobs(model, batch, 1.0, with_entropy=True, chunk_tokens=chunk,
                                              entropy_grad=entropy_grad)
    counter = Count()
    with counter:
        (logprobs * batch["response_mask"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return saved, counter.elements, logprobs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("chunk", [0, 16])
def test_an_entropy_kept_only_as_a_metric_costs_backward_nothing(chunk: int) -> None:
    """`entropy_coef: 0` (the default): same numbers and gradients, less vocab-wide work.

    Whole path: autograd no longer saves the entropy's softmax. Chunked path: the
    hand-written backward (head_logprobs.py) makes the gradient from one recomputed chunk
    of logits in place, where autograd made the recompute's, the gather's and logsumexp's.
    """
    batch = inputs(rows=8, response=16)
    with_grad = vocab_wide_work(tiny(), batch, chunk, entropy_grad=True)
    metric_only = vocab_wide_work(tiny(), batch, chunk, entropy_grad=False)
    # Log-probs bit for bit; the entropy formula and the hand-written backward round otherwise.
    torch.testing.assert_close(metric_only[2], with_grad[2], rtol=0, atol=0)
    torch.testing.assert_close(metric_only[3], with_grad[3], rtol=1e-6, atol=1e-5)
    assert with_grad[4].keys() == metric_only[4].keys()
    for name, grad in with_grad[4].items():
        torch.testing.assert_close(metric_only[4][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if chunk == 0:  # the softmax is no longer saved; backward never ran through it anyway
        assert metric_only[0] < with_grad[0], (metric_only[0], with_grad[0])
    else:  # nothing vocab-wide is saved either way; the recompute no longer redoes the entropy
        assert metric_only[0] == with_grad[0] == 0
        assert metric_only[1] < with_grad[1], (metric_only[1], with_grad[1])
