"""The fused head: a causal LM's output projection and loss computed chunk by chunk, in forward
and in backward, so that neither the whole logits' gradient nor (where the head recomputes) the
whole logits ever exist.

Note: why. At GPT-3 13B, micro-batch 128, the logits (tokens x vocabulary in 16-bit) are 12.3 GiB,
and autograd's path makes their whole gradient in backward as well (another 12.3 GiB). Fused,
backward takes each chunk's gradient and applies it to the matmul at once: grad_h of the chunk's
rows, and the chunk's share of grad_W (and grad_b), summed. What stays from forward to backward is
the head's policy's business (docs/activations.md, "The fused head"): the logits (kept, or swapped
to host/SSD like any saved tensor) where the head keeps, only the norm's output h where it
recomputes (each chunk's logits are computed again from h and W), or, where its policy is
`grad_in_forward`, the gradients themselves (see the Note on gradients in forward).

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

Note: gradients in forward (the head's policy `grad_in_forward`; the approach of fused linear
cross-entropy kernels, e.g. Liger-Kernel's). The loss is a scalar, so its gradient w.r.t. h, W
and b is the gradient the loss's backward receives (g: the loss scale and 1/G of accumulation)
times the gradient of the loss itself. Forward computes the latter chunk by chunk right after
each chunk's loss, with autograd's formulas at an incoming gradient of 1: grad_h's rows (in the
compute dtype, held until backward), grad_W and grad_b summed in fp32; backward only multiplies
them by g. Neither the logits nor h are held, nor computed again: the head holds grad_h (tokens x
width) and the fp32 grad_W from its forward to its backward, and its backward runs no matmul (all
its FLOPs ran in forward). A power-of-two g (loss scales, 1/2, 1/4...) commutes with every
rounding on the way, so the gradients equal the keep policy's bit for bit (barring subnormals);
another g rounds once more. In fp16 a chunk's logits' gradient at g = 1 (about 1 / tokens, times
probabilities) would underflow where the loss scale exists to lift it: each chunk's is scaled by
the largest power of two that keeps its fp16 products below half of fp16's range (from max|W|
and the chunk's max|h|) before the cast and the matmuls, and the scale is taken back out in
backward (grad_W, grad_b: in fp32, as each chunk is added). fp16 gradients are then the keep
policy's to fp16 rounding, not bit for bit: which small values fall below fp16's normal range
depends on the scale, the loss scale's for the keep policy, this one here. What is held is
made in the head's scope like any saved tensor, as the head's kept records: a forward never
followed by its backward leaves them to the step's end like any unit's (end_backward), and a
dropped graph drops them. Only the fused head's unit can take this policy (the manager refuses it
elsewhere), and only where the head is fused: without labels, in eval or no_grad the real head
runs and the unit keeps what it saves.
"""

from __future__ import annotations

import inspect
from typing import Callable, ContextManager, Mapping, Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from offloadpp.planner.activations import LOSS_CHUNK_ELEMS

from .policy import ActPolicy
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


# what the head holds from its forward to its backward (FusedHead's `mode`): its logits, only h
# (the logits computed again in backward), or the gradients made in forward (Note on gradients in
# forward)
KEEP_LOGITS, RECOMPUTE_LOGITS, GRAD_IN_FORWARD = "keep", "recompute", "grad_in_forward"
MODES = (KEEP_LOGITS, RECOMPUTE_LOGITS, GRAD_IN_FORWARD)


class _Source:
    """What a placeholder stands for: the head's input, weight and bias, the dtype of its
    logits, what the head holds for backward (`mode`: MODES), whether its loss is made with
    grad enabled, and the FusedHead that made it (its scope and backward callback)."""

    __slots__ = ("h", "weight", "bias", "dtype", "mode", "grad", "head")

    def __init__(self, h, weight, bias, dtype, mode: str, head: FusedHead):
        if mode not in MODES:
            raise ValueError(f"the fused head's mode must be one of {MODES}, got {mode!r}")
        self.h, self.weight, self.bias = h, weight, bias
        self.dtype, self.mode, self.head = dtype, mode, head
        self.grad = True


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
    by the count or `divisor` (see the module note). `src` says the dtype and what the head holds
    for backward: the logits, only h (the logits computed again), or the gradients made in
    forward (the Note on gradients in forward)."""

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
        ctx.mode = src.mode
        total = (target != ignore_index).sum().float()  # (nll_loss's total weight)
        keep = src.mode == KEEP_LOGITS
        grads = _Grads(ctx, rows, weight, bias, src) if src.mode == GRAD_IN_FORWARD else None
        with torch.autocast(h.device.type, enabled=False):
            w, b = weight.to(dt), (bias.to(dt) if bias is not None else None)
            logits = torch.empty(n, vocab, dtype=dt, device=h.device) if keep else None
            loss = 0
            for c, (a, e) in enumerate(_chunks(n, vocab)):
                x = _linear(rows[a:e], w, b, out=logits[a:e] if logits is not None else None)
                xf = x.float()
                loss = loss + torch.nn.functional.cross_entropy(
                    xf, target[a:e], ignore_index=ignore_index, reduction="sum"
                )
                del x
                if grads is not None:
                    grads.add(c, a, e, xf, target[a:e], w, total)
                del xf
            loss = loss / total if divisor is None else loss / divisor
        if grads is not None:  # (the gradients at g = 1; neither h nor W is needed again)
            ctx.save_for_backward(*grads.held())
            return loss
        ctx.target, ctx.total = target, total  # (integers, kept on the device like the caller's labels)
        ctx.save_for_backward(hs, weight, bias, logits)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        if ctx.mode == GRAD_IN_FORWARD:
            return _Grads.scaled(ctx, g)
        h, weight, bias, logits = ctx.saved_tensors  # (weight: its current data, the runtime's)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dt, target = ctx.dtype, ctx.target
        g, red = _incoming(g, ctx.divisor)
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
                x = (logits[a:e] if ctx.mode == KEEP_LOGITS else _linear(hc, w, b)).float()
                gx = _logits_grad(x, target[a:e], g, red, ctx.ignore_index, ctx.total).to(dt)
                del x
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


def _incoming(g: torch.Tensor, divisor):
    """The loss's incoming gradient as nll_loss_backward takes it, and its reduction: loss / n is
    DivBackward's grad / n, then a sum's; the mean's division is nll_loss's own."""
    return (g / divisor, _SUM) if divisor is not None else (g, _MEAN)


def _logits_grad(x: torch.Tensor, target, g, red: int, ignore_index: int, total) -> torch.Tensor:
    """A chunk's logits' gradient in fp32 from its fp32 logits `x`, by autograd's own formulas
    (row by row bit-identical to autograd's)."""
    lsm = torch.log_softmax(x, 1)
    gn = torch.ops.aten.nll_loss_backward(g, lsm, target, None, red, ignore_index, total)
    return torch.ops.aten._log_softmax_backward_data(gn, lsm, 1, torch.float32)


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """max|t| as an fp32 device scalar, without a temporary of t's size (W's is 0.48 GiB at 13B)."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(hi.float(), -lo.float())


class _Grads:
    """The gradients a `grad_in_forward` head makes in forward at an incoming gradient of 1 (the
    Note on gradients in forward): grad_h's rows in the compute dtype, grad_W and grad_b summed
    in fp32, and in fp16 each chunk's power-of-two scale (kept in grad_h's rows until backward)."""

    def __init__(self, ctx, rows: torch.Tensor, weight, bias, src: _Source):
        need_h, need_w, need_b = (bool(x) and src.grad for x in ctx.needs_input_grad[:3])
        self.ctx, self.rows, self.dt = ctx, rows, src.dtype
        dev = rows.device
        self.one, self.red = _incoming(torch.ones((), dtype=torch.float32, device=dev), ctx.divisor)
        self.gh = torch.empty(rows.shape, dtype=self.dt, device=dev) if need_h else None
        self.gw = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
        self.gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_b else None
        self.any = need_h or need_w or need_b
        # fp16: per chunk, the power of two its logits' gradient was scaled by (see the Note)
        self.scales = [] if self.dt == torch.float16 and self.any else None
        self.w_top: Optional[torch.Tensor] = None  # max|W| (fp16), found at the first chunk
        ctx.chunk_rows = [] if self.scales is not None else None
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None

    def add(self, c: int, a: int, e: int, xf: torch.Tensor, target, w: torch.Tensor, total) -> None:
        """Chunk c (rows a:e, its fp32 logits `xf`): its rows of grad_h, its share of grad_W and
        grad_b, as the keep policy's backward makes them at g = 1."""
        if not self.any:
            return
        gx = _logits_grad(xf, target, self.one, self.red, self.ctx.ignore_index, total)
        inv = None
        hc = self.rows[a:e]
        if self.scales is not None:  # (no sync: the scale stays a device scalar)
            scale = self._fp16_scale(gx, hc, w)
            gx.mul_(scale)
            inv = scale.reciprocal()
            self.scales.append(inv)
            self.ctx.chunk_rows.append((a, e))
        gx = gx.to(self.dt)
        if self.gh is not None:
            torch.mm(gx, w, out=self.gh[a:e])
        if self.gw is not None:
            if self.dt == torch.float32:  # (the keep policy's backward, at g = 1)
                torch.addmm(self.gw, gx.t(), hc, out=self.gw)
            elif inv is None:
                self.gw.add_(torch.mm(gx.t(), hc))
            else:  # (the chunk's scale out again, exact: a power of two, in fp32)
                self.gw.add_(torch.mm(gx.t(), hc).float().mul_(inv))
        if self.gb is not None:
            part = gx.sum(0)
            self.gb.add_(part.float().mul_(inv) if inv is not None else part)

    def _fp16_scale(self, gx: torch.Tensor, hc: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The largest power of two that leaves the chunk's fp16 products below 2^14 (half of
        fp16's range): a row of grad_h is at most 2 max|gx| max|W| (a row of the logits' gradient
        sums to 0, its absolute values to at most twice its largest), the chunk's grad_W and grad_b
        at most rows x max|gx| x max(max|h|, 1). As large as that allows, so that as few values
        as may be fall below fp16's normal range."""
        if self.w_top is None:
            self.w_top = _abs_max(w)
        tiny = torch.finfo(torch.float32).tiny
        top = _abs_max(gx).clamp_min(tiny)
        rows = max(1, hc.shape[0])
        room = torch.minimum(
            2.0**13 / self.w_top.clamp_min(tiny), 2.0**14 / (rows * _abs_max(hc).clamp_min(1.0))
        )
        return torch.exp2(torch.floor(torch.log2(room / top)).clamp(-120, 120))

    def held(self) -> tuple:
        """What backward needs: grad_h, grad_W, grad_b and the fp16 chunks' scales (None where not
        made)."""
        scales = torch.stack(self.scales) if self.scales else None
        return self.gh, self.gw, self.gb, scales

    @staticmethod
    def scaled(ctx, g: torch.Tensor) -> tuple:
        """The held gradients times the incoming gradient g, in place (grad_h in its dtype, grad_W
        and grad_b in fp32, then cast to the parameters' dtypes once)."""
        gh, gw, gb, scales = ctx.saved_tensors
        g = g.float()
        if gh is not None:
            if scales is None:
                gh.mul_(g)
            else:  # (each chunk's own factor: g over its scale, exact for a power-of-two g)
                for (a, e), f in zip(ctx.chunk_rows, scales * g):
                    gh[a:e].mul_(f)
            gh = gh.to(ctx.h_dtype).view(ctx.h_shape)
        if gw is not None:
            gw = gw.mul_(g).to(ctx.weight_dtype)
        if gb is not None:
            gb = gb.mul_(g).to(ctx.bias_dtype)
        return gh, gw, gb, None, None, None, None


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
    src.grad = torch.is_grad_enabled()  # (a Function's forward sees it off, its needs_input_grad not)
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


def head_mode(policy: ActPolicy) -> str:
    """What the fused head holds for backward under its unit's policy (MODES): the logits (keep,
    host, ssd, partial*: the logits are its matmul's output), h only (recompute*), or the
    gradients made in forward (grad_in_forward)."""
    if policy is ActPolicy.GRAD_IN_FORWARD:
        return GRAD_IN_FORWARD
    return KEEP_LOGITS if policy.partial or not policy.recomputes else RECOMPUTE_LOGITS


def refuse_grad_in_forward(requested: Mapping[str, ActPolicy], head_unit: Optional[str]) -> None:
    """grad_in_forward is the fused head's policy (the Note on gradients in forward): an
    ActivationError for any other unit that asks for it (`requested`: unit -> policy), and for
    every one where no head is fused (`head_unit` None)."""
    bad = [n for n, p in requested.items() if p is ActPolicy.GRAD_IN_FORWARD and n != head_unit]
    if not bad:
        return
    where = (
        f"only the fused head's unit {head_unit!r} can take it"
        if head_unit is not None
        else "no head is fused here (it needs activations.fused_loss and a supported Hugging Face causal LM "
        "whose output embedding a unit owns)"
    )
    raise ActivationError(f"units {bad} have the activation policy 'grad_in_forward': {where}")


class FusedHead:
    """The hooks that make `linear` (the model's output embedding) return a LazyLogits during a
    forward the fused head applies to (see the module note):

    scope: the context the loss's saved tensors are made in; mode: what the head holds for
    backward (MODES: its logits, only h, or the gradients made in forward); gate: whether this forward is one to fuse
    (the activation manager's: inside its forward()); on_backward: called when backward reaches
    the loss, before the fused backward runs (where the head's backward starts: the grad hooks on
    the head's outputs fire only once the fused backward gave h its gradient)."""

    def __init__(self, model: nn.Module, linear: nn.Linear, *, scope: Callable[[], ContextManager],
                 mode: Callable[[], str], gate: Callable[[], bool] = lambda: True,
                 on_backward: Optional[Callable[[], None]] = None):  # fmt: skip
        self.model, self.linear = model, linear
        self.scope, self.mode, self.gate = scope, mode, gate
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
        src = _Source(x, lin.weight, lin.bias, dtype, self.mode(), self)
        return LazyLogits((*x.shape[:-1], lin.out_features), dtype, x.device, src)


__all__ = [
    "GRAD_IN_FORWARD",
    "KEEP_LOGITS",
    "MODES",
    "RECOMPUTE_LOGITS",
    "FusedHead",
    "FusedLinearCrossEntropy",
    "LazyLogits",
    "SUPPORTED_MODEL_TYPES",
    "chunk_rows",
    "fusable_head",
    "fused_loss",
    "head_mode",
    "refuse_grad_in_forward",
]
