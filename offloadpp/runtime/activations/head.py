"""The fused head: a causal LM's output projection and loss computed chunk by chunk, in forward
and in backward, so that neither the whole logits' gradient nor (where the head recomputes) the
whole logits ever exist.

Note: why. At GPT-3 13B, micro-batch 128, the logits (tokens x vocabulary in 16-bit) are 12.3 GiB,
and autograd's path makes their whole gradient in backward as well (another 12.3 GiB). Fused,
backward takes each chunk's gradient and applies it to the matmul at once: grad_h of the chunk's
rows, and the chunk's share of grad_W (and grad_b), summed. What stays from forward to backward is
the head's policy's business (docs/activations.md, "The fused head"): the logits (kept, or swapped
to host/SSD like any saved tensor) where the head keeps, only the norm's output h where it
recomputes (each chunk's logits are computed again from h and W).

Note: how. During a forward with grad enabled, in training mode, with `labels` given, the output
embedding (an nn.Linear, GPT-2's and Llama's `lm_head`) returns a `LazyLogits` instead of its
output: a tensor subclass of the logits' shape, dtype (under autocast, the autocast dtype, as the
linear would give) and device, which remembers its input, weight and bias. The substituted loss
(loss.py `causal_lm_loss`) hands those to `FusedLinearCrossEntropy`. Anything else that reads the
placeholder's values is refused with an ActivationError that says why (`detach` and dtype casts,
which Accelerate applies to outputs without reading them, give another placeholder). The
placeholder carries no autograd history: the loss's graph goes straight to h and W, so the grad
hooks on the norm's output fire when the fused backward gave h its gradient.

Note: exactness. Per chunk of rows the loss is the existing cross-entropy math (loss.py
`_CrossEntropy`): the chunk's logits upcast, `cross_entropy(..., reduction="sum")`, the sum over
chunks divided by the count (or num_items_in_batch); backward applies autograd's own formulas
(nll_loss_backward, _log_softmax_backward_data), so a row's logits gradient is autograd's bit for
bit; grad_h of a row is that row's gradient times W, as autograd's matmul computes it. grad_W is
a sum over chunks instead of one matmul over all rows (it differs by rounding), accumulated in fp32
(a 16-bit W's gradient is cast back once at the end: a running 16-bit sum over hundreds of chunks
would lose bits).
"""

from __future__ import annotations

import inspect
from typing import Callable, ContextManager, Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from offloadpp.planner.activations import LOSS_CHUNK_ELEMS

from .records import ActivationError

# the Hugging Face causal LMs whose forward hands `self.lm_head(hidden_states)` straight to
# `self.loss_function` (transformers' modeling_<type>.py), and nothing else reads the logits
SUPPORTED_MODEL_TYPES = frozenset({"gpt2", "llama", "qwen2", "mistral"})
_MEAN, _SUM = 1, 2  # torch's Reduction enum, as nll_loss_backward takes it
_WHY = (
    "the fused head (activations.fused_loss) never makes the whole logits in training with labels; "
    'set it false ("offloadpp": {"activations": {"fused_loss": false}}) to get outputs.logits'
)


def chunk_rows(vocab: int) -> int:
    """Rows of the flattened tokens computed at once (planner/activations.py LOSS_CHUNK_ELEMS,
    the planner's count; this module's global, read at each call: tests make it small)."""
    return max(1, LOSS_CHUNK_ELEMS // max(1, vocab))


class _Source:
    """What a placeholder stands for: the head's input, weight and bias, the dtype of its
    logits, whether the head keeps them for backward, and the FusedHead that made it (its
    scope and backward callback)."""

    __slots__ = ("h", "weight", "bias", "dtype", "keep", "head")

    def __init__(self, h, weight, bias, dtype, keep: bool, head: FusedHead):
        self.h, self.weight, self.bias = h, weight, bias
        self.dtype, self.keep, self.head = dtype, keep, head


class LazyLogits(torch.Tensor):
    """The output embedding's output under the fused head (see the module note): shape, dtype and
    device of the logits, no values."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    source: Optional[_Source]

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, device: torch.device, source: Optional[_Source] = None):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t.source = source
        return t

    def __repr__(self) -> str:
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}: no values; {_WHY})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], LazyLogits) else None
        if self is not None and func is torch.ops.aten.detach.default:
            return LazyLogits(self.shape, self.dtype, self.device)
        if (
            self is not None
            and func is torch.ops.aten._to_copy.default
            and len(args) == 1
            and set(kwargs) <= {"dtype", "device", "layout", "memory_format", "non_blocking", "pin_memory"}
            and torch.device(kwargs.get("device") or self.device) == self.device
            and kwargs.get("layout") in (None, torch.strided)
        ):  # a dtype cast (Accelerate's outputs to fp32): reads no values
            return LazyLogits(self.shape, kwargs.get("dtype") or self.dtype, self.device)
        raise ActivationError(f"outputs.logits is a placeholder ({func} was called on it): {_WHY}")


def compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(h, weight)` gives here: the autocast dtype where autocast is on for
    h's device, else h's (autocast casts h, W and b to it)."""
    dev = h.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return h.dtype


class FusedLinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(F.linear(h, W, b).float(), target) summed over rows, chunk by chunk, divided
    by the count or `divisor` (see the module note). `src` says the dtype and whether the
    logits are kept for backward (else computed again from h)."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, ignore_index: int, divisor, src: _Source):
        dt = src.dtype
        # h as the matmul reads it (autocast's linear saves the same cast): under autocast the
        # norm's fp32 output would be twice what the planner counts (its loss input, 2 B a value
        # in 16-bit compute); saved in this dtype, its gradient given back in h's
        hs = h.to(dt)
        rows = hs.reshape(-1, h.shape[-1])
        n, vocab = rows.shape[0], weight.shape[0]
        ctx.ignore_index, ctx.divisor, ctx.dtype, ctx.h_shape = ignore_index, divisor, dt, h.shape
        ctx.h_dtype = h.dtype
        ctx.target = target  # (integers, kept on the device like the caller's labels)
        ctx.total = (target != ignore_index).sum().float()  # (nll_loss's total weight)
        with torch.autocast(h.device.type, enabled=False):
            w, b = weight.to(dt), (bias.to(dt) if bias is not None else None)
            logits = torch.empty(n, vocab, dtype=dt, device=h.device) if src.keep else None
            loss = 0
            for a, e in _chunks(n, vocab):
                x = _linear(rows[a:e], w, b, out=logits[a:e] if logits is not None else None)
                loss = loss + torch.nn.functional.cross_entropy(
                    x.float(), target[a:e], ignore_index=ignore_index, reduction="sum"
                )
            loss = loss / ctx.total if divisor is None else loss / divisor
        ctx.keep = src.keep
        ctx.save_for_backward(hs, weight, bias, logits)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        h, weight, bias, logits = ctx.saved_tensors  # (weight: its current data, the runtime's)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dt, target = ctx.dtype, ctx.target
        if ctx.divisor is not None:  # (loss / n: DivBackward's grad / n, then a sum's)
            g, red = g / ctx.divisor, _SUM
        else:
            red = _MEAN
        rows = h.reshape(-1, h.shape[-1])
        n, vocab = rows.shape[0], weight.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dt)
            b = bias.to(dt) if bias is not None else None
            gh = torch.empty(rows.shape, dtype=ctx.h_dtype, device=rows.device) if need_h else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            gb = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_b else None
            for a, e in _chunks(n, vocab):
                hc = rows[a:e]
                x = (logits[a:e] if ctx.keep else _linear(hc, w, b)).float()
                lsm = torch.log_softmax(x, 1)
                del x
                gn = torch.ops.aten.nll_loss_backward(
                    g, lsm, target[a:e], None, red, ctx.ignore_index, ctx.total
                )
                gx = torch.ops.aten._log_softmax_backward_data(gn, lsm, 1, torch.float32).to(dt)
                del lsm, gn
                if gh is not None:
                    gh[a:e] = torch.mm(gx, w)
                if gw is not None:
                    if dt == torch.float32:  # (out=, not addmm_: the FLOP counter knows addmm's)
                        torch.addmm(gw, gx.t(), hc, out=gw)
                    else:  # (a 16-bit product, summed in fp32: see the Note on exactness)
                        gw.add_(torch.mm(gx.t(), hc))
                if gb is not None:
                    gb.add_(gx.sum(0))
        return (
            gh.view(ctx.h_shape) if gh is not None else None,
            gw.to(weight.dtype) if gw is not None else None,
            gb.to(bias.dtype) if gb is not None else None,
            None, None, None, None,
        )  # fmt: skip


def _chunks(n_rows: int, vocab: int) -> list[tuple[int, int]]:
    step = chunk_rows(vocab)
    return [(a, min(n_rows, a + step)) for a in range(0, n_rows, step)]


def _linear(x, w, b, out=None):
    if out is None:
        return torch.nn.functional.linear(x, w, b)
    if b is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)


def fused_loss(logits: LazyLogits, target: torch.Tensor, ignore_index: int, divisor) -> torch.Tensor:
    """The loss of a placeholder's logits against the flattened, shifted labels `target` (loss.py
    causal_lm_loss), its saved tensors made in the placeholder's scope."""
    src = logits.source
    if src is None or src.h is None:
        raise ActivationError(f"the fused head's logits were used for a loss twice, or are a copy: {_WHY}")
    logits.source = None  # (the placeholder no longer holds h and W)
    with src.head.scope():
        loss = FusedLinearCrossEntropy.apply(src.h, src.weight, src.bias, target, ignore_index, divisor, src)
    src.h = src.weight = src.bias = None
    if src.head.on_backward is not None and loss.requires_grad:
        loss.register_hook(_calling(src.head.on_backward))
    return loss


def _calling(fn: Callable[[], None]):
    """A tensor hook that calls fn() and leaves the gradient as it is."""

    def hook(grad):
        fn()

    return hook


def fusable_head(model: Optional[nn.Module]) -> Optional[nn.Linear]:
    """The model's output embedding where the fused head applies (a supported Hugging Face causal
    LM whose output embedding is a plain nn.Linear), else None."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model is None or model_type not in SUPPORTED_MODEL_TYPES:
        return None
    try:
        lin = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return lin if type(lin) is nn.Linear else None


class FusedHead:
    """The hooks that make `linear` (the model's output embedding) return a LazyLogits during a
    forward the fused head applies to (see the module note):

    scope: the context the loss's saved tensors are made in; keep_logits: whether the head keeps
    its logits for backward (else recomputes them); gate: whether this forward is one to fuse
    (the activation manager's: inside its forward()); on_backward: called when backward reaches
    the loss, before the fused backward runs (where the head's backward starts: the grad hooks on
    the head's outputs fire only once the fused backward gave h its gradient)."""

    def __init__(self, model: nn.Module, linear: nn.Linear, *, scope: Callable[[], ContextManager],
                 keep_logits: Callable[[], bool], gate: Callable[[], bool] = lambda: True,
                 on_backward: Optional[Callable[[], None]] = None):  # fmt: skip
        self.model, self.linear = model, linear
        self.scope, self.keep_logits, self.gate = scope, keep_logits, gate
        self.on_backward = on_backward
        self.armed = False  # the next call of `linear` in this forward returns a placeholder
        self._handles: list = []
        try:
            self._signature: Optional[inspect.Signature] = inspect.signature(model.forward)
        except (TypeError, ValueError):
            self._signature = None

    def install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._arm, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._disarm))
        self.linear.forward = self._forward  # (on the instance; remove() deletes it)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if vars(self.linear).get("forward") == self._forward:
            del self.linear.forward
        self.armed = False

    def _labels(self, args, kwargs):
        if "labels" in kwargs:
            return kwargs["labels"]
        if not args or self._signature is None:
            return None
        try:
            return self._signature.bind_partial(*args, **kwargs).arguments.get("labels")
        except TypeError:
            return None

    def _arm(self, module, args, kwargs):
        self.armed = bool(
            torch.is_grad_enabled()
            and module.training
            and self.gate()
            and self._labels(args, kwargs) is not None
        )
        return None

    def _disarm(self, module, args, output):
        self.armed = False
        return None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        if not self.armed or not torch.is_grad_enabled():
            return nn.Linear.forward(lin, x)
        self.armed = False  # (one placeholder a forward)
        dtype = compute_dtype(x, lin.weight)
        src = _Source(x, lin.weight, lin.bias, dtype, self.keep_logits(), self)
        return LazyLogits((*x.shape[:-1], lin.out_features), dtype, x.device, src)


__all__ = [
    "FusedHead",
    "FusedLinearCrossEntropy",
    "LazyLogits",
    "SUPPORTED_MODEL_TYPES",
    "chunk_rows",
    "fusable_head",
    "fused_loss",
]
