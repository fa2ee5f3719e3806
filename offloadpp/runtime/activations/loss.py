"""Hugging Face's causal-LM loss, made to save the logits and not their fp32 log-softmax.

Note: why. `ForCausalLMLoss` (transformers.loss.loss_utils) upcasts the logits to fp32 and calls
`cross_entropy`, whose log-softmax saves its fp32 output for backward: with 16-bit logits that is
twice the logits' own bytes (GPT-3 13B, micro-batch 128 x 1024 tokens: 24.5 GiB of saved
log-softmax beside 12.3 GiB of logits, more than the 4090's activation budget), and the forward
holds the fp32 copy and the log-softmax of every token at once on top of it. The analytic profile
counts the logits (planner/model_profile.py: t x vocab in the compute dtype), which is what this
saves.

What is done: inside the runtime's activation manager (ActivationManager.install) and the
profiler, a model whose `loss_function` is Hugging Face's ForCausalLMLoss gets this one
instead, set on the instance (`_loss_function`, the property's own setter) and removed again by
`restore_loss`. Its labels are shifted and flattened as ForCausalLMLoss does them, then an
autograd Function takes over: forward runs `logits.float()` and `cross_entropy` over rows in
chunks of at most CHUNK_ELEMS elements (one chunk: the very same call, so the same loss bit for
bit; several: the chunks' sums over the count, which rounds differently by an ulp or so) and
saves only the logits and the labels; backward runs each chunk's log-softmax again and applies
the backward formulas autograd would (`nll_loss_backward`, `_log_softmax_backward_data` with the
whole count, the cast back to the logits' dtype): a row's gradient does not depend on the
others, so the gradients are autograd's bit for bit (tests/test_loss.py).

Note: the fused head. Where the activation manager (or the profiler) made the output embedding
return a placeholder (head.py `LazyLogits`: training with labels, `activations.fused_loss`, a
supported model), causal_lm_loss gets that placeholder and hands it, with the same shifted and
flattened labels, to head.py's FusedLinearCrossEntropy: the head's matmul and this loss chunk by
chunk (planner/activations.py LOSS_CHUNK_ELEMS elements at once), the logits kept for backward
or computed again there as the head unit's policy says, their whole gradient never made.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .head import LazyLogits, fused_loss

# rows of fp32 log-softmax computed at once: 256 MiB (a 50257-word vocabulary: 1335 tokens)
CHUNK_ELEMS = 1 << 26
_MEAN, _SUM = 1, 2  # torch's Reduction enum, as nll_loss_backward takes it


def _chunks(n_rows: int, vocab: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMS // max(1, vocab))
    return [(a, min(n_rows, a + step)) for a in range(0, n_rows, step)]


class _CrossEntropy(torch.autograd.Function):
    """cross_entropy(logits.float(), target) of 2-D logits (see the module note)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, divisor) -> torch.Tensor:
        ctx.save_for_backward(logits, target)
        ctx.ignore_index, ctx.divisor = ignore_index, divisor
        reduction = "sum" if divisor is not None else "mean"
        parts = _chunks(logits.shape[0], logits.shape[1])
        ctx.total = (target != ignore_index).sum().float()  # (nll_loss's total weight)
        if len(parts) == 1:
            loss = torch.nn.functional.cross_entropy(
                logits.float(), target, ignore_index=ignore_index, reduction=reduction
            )
        else:
            loss = sum(
                torch.nn.functional.cross_entropy(
                    logits[a:b].float(), target[a:b], ignore_index=ignore_index, reduction="sum"
                )
                for a, b in parts
            )
            if divisor is None:
                loss = loss / ctx.total
        if divisor is not None:
            loss = loss / divisor
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        logits, target = ctx.saved_tensors
        if ctx.divisor is not None:  # (loss / n: DivBackward's grad / n, then a sum's)
            g, red = g / ctx.divisor, _SUM
        else:
            red = _MEAN
        out = torch.empty_like(logits)
        for a, b in _chunks(logits.shape[0], logits.shape[1]):
            x = logits[a:b].float()
            lsm = torch.log_softmax(x, 1)
            gn = torch.ops.aten.nll_loss_backward(g, lsm, target[a:b], None, red, ctx.ignore_index, ctx.total)
            gx = torch.ops.aten._log_softmax_backward_data(gn, lsm, 1, x.dtype)
            out[a:b] = gx.to(logits.dtype)
        return out, None, None, None


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    shift_labels: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """ForCausalLMLoss's signature and result, saving the logits only (see the module note)."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    target = shift_labels.reshape(-1).to(logits.device)
    divisor = num_items_in_batch
    if torch.is_tensor(divisor):
        divisor = divisor.to(logits.device)
    if isinstance(logits, LazyLogits):  # the fused head (see the Note on it)
        return fused_loss(logits, target, ignore_index, divisor)
    return _CrossEntropy.apply(logits.reshape(-1, vocab_size), target, ignore_index, divisor)


def substitute_loss(model) -> Optional[weakref.ref]:
    """Gives `model` causal_lm_loss where its loss is Hugging Face's ForCausalLMLoss; what
    restore_loss needs to undo it (None: nothing was changed)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    model = causal_lm(model)
    if model is None or "_loss_function" in vars(model):
        return None
    try:
        current = model.loss_function
    except AttributeError:
        return None
    if current is not ForCausalLMLoss:
        return None
    model.loss_function = causal_lm_loss
    return weakref.ref(model)


def causal_lm(model):
    """The module whose forward computes the loss: a peft model's base model (peft calls its
    forward directly), else the model itself."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def uses_causal_lm_loss(model) -> bool:
    """substitute_loss gave `model` causal_lm_loss (and it is still in place)."""
    model = causal_lm(model)
    return model is not None and vars(model).get("_loss_function") is causal_lm_loss


def restore_loss(ref: Optional[weakref.ref]) -> None:
    model = ref() if ref is not None else None
    if model is not None and vars(model).get("_loss_function") is causal_lm_loss:
        del model._loss_function


__all__ = [
    "CHUNK_ELEMS",
    "causal_lm",
    "causal_lm_loss",
    "restore_loss",
    "substitute_loss",
    "uses_causal_lm_loss",
]
