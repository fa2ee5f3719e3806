"""The gated MLP of Llama-shaped models, made to save its input and the two projections' outputs only.

Note: why. Hugging Face's LlamaMLP computes down_proj(act_fn(gate_proj(x)) * up_proj(x)); autograd
saves x (for both projections, one storage), gate_proj's output (for the activation), act_fn's
output and up_proj's output (for the product) and the product (for down_proj): four tensors at
the inner width. At Llama 7B, micro-batch 64 x 1024 tokens, that is 4 x 1.34 GiB in one block's
MLP (5.88 GiB with x): partial_host and the nested recompute peak at 6.88 GiB in a 7.04 GiB room
and no second weight buffer fits (docs/performance.md, "The last micro-batch cliffs"). The
activation's output and the product are cheap to make again from gate's and up's outputs:
saving only x, gate and up, the MLP holds 3.19 GiB there.

What is done: inside the units the runtime manages (ActivationManager.install, and the profiler,
so that measured profiles count what the runtime saves), each such module's class is swapped for
a subclass (still an instance of the original) whose forward runs gate_proj and up_proj as they
are (they save x, under autograd as before) and the rest, act_fn(gate) * up and down_proj's
linear, as an autograd Function: forward runs the module's own act_fn, the product and
F.linear(h, W, b) (what nn.Linear runs) without recording and saves gate, up and W (a parameter:
the runtime hands it back rebound, never swapped). Backward makes the product again, takes
down_proj's gradients with the operators autograd's linear backward runs (grad_W = g^T @ h,
grad_h = g @ W, grad_b = the sum of g's rows: the same matmuls on the same layouts, bit-identical)
and then runs act_fn(gate) * up again under autograd, in pieces of about CHUNK_ELEMS elements
(whole rows), to take gate's and up's gradients with autograd's own formulas (bit-identical:
tests/test_swiglu.py). No matmul runs twice: the FLOPs are autograd's. An analytic derivative of
the activation would round differently (gelu.py's Note says why that matters).

Where it applies: a module whose class's forward has LlamaMLP's code (the same bytecode and
names: MistralMLP, Qwen2MLP, Qwen3MLP, GemmaMLP... are copies of it), with any act_fn of the
config (the module's own is called). Per call it falls back to the original forward (everything
saved as before) where down_proj is not exactly an nn.Linear without hooks (peft's LoRA wrapping
down_proj, quantized linears, hooks that rebind the weight: their forward is not F.linear on
`weight`), where act_fn has hooks of its own (its forward is called directly, without the module
call's hooks, as gelu.py calls its formula: global module hooks such as FlopCounterMode's module
tracker would see a module run inside backward and hook a leaf), under autocast (the casts' gradients are autograd's business), and where no gradient
is recorded. gate_proj and up_proj may be anything (peft-wrapped or not): they run as they are.
The modules' class is restored by `restore_swiglu` (the manager's remove()). The analytic profile
counts the same (planner/model_profile.py: x and two tensors at the inner width in a Llama MLP).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .class_swap import ClassSwaps

# backward runs act_fn(gate) * up again under autograd on pieces of whole rows of at most about
# this many elements: its intermediates then take a few x 128 MiB (16-bit), not a few x the inner
# width's whole tensor (1.34 GiB each at Llama 7B, micro-batch 64)
CHUNK_ELEMS = 1 << 26


class _GatedDown(torch.autograd.Function):
    """down_proj(act(gate) * up) saving gate, up and W only (see the module note)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, act):
        ctx.save_for_backward(gate, up, weight)
        ctx.act = act
        return F.linear(act(gate) * up, weight, bias)  # grad mode is off here: nothing is saved

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_w, need_b = ctx.needs_input_grad[:4]
        width = gate.shape[-1]
        g2 = g.reshape(-1, g.shape[-1])  # (the 2-d view the linear's matmul had, as autograd makes it)
        gw = gb = gh = None
        if need_w:
            h = ctx.act(gate) * up
            gw = g2.t().mm(h.reshape(-1, width))  # (MmBackward's mat2 gradient, then the transpose's)
            del h
        if need_b:
            gb = g2.sum(0)
        if need_gate or need_up:
            gh = g2.mm(weight).view(gate.shape)
            gh = _gated_grads(ctx.act, gate, up, gh, need_gate, need_up)
        return (gh[0] if gh else None), (gh[1] if gh else None), gw, gb, None


def _gated_grads(act, gate, up, gh, need_gate: bool, need_up: bool) -> tuple:
    """gate's and up's gradients from h's, act(gate) * up run again under autograd in pieces of
    whole rows (elementwise: a piece's values are the whole's)."""

    def grad(gs, us, hs):
        gs = gs.detach().requires_grad_(need_gate)
        us = us.detach().requires_grad_(need_up)
        # identity hooks innermost: these intermediates are not the forward's saved tensors
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = act(gs) * us
        wrt = [t for t, need in ((gs, need_gate), (us, need_up)) if need]
        got = iter(torch.autograd.grad(y, wrt, hs))
        return (next(got) if need_gate else None), (next(got) if need_up else None)

    width = gate.shape[-1]
    rows = max(1, CHUNK_ELEMS // max(width, 1))
    if gate.numel() <= CHUNK_ELEMS or not (gate.is_contiguous() and up.is_contiguous()):
        return grad(gate, up, gh)
    outs = [torch.empty_like(gate) if need else None for need in (need_gate, need_up)]
    g2, u2, h2 = gate.view(-1, width), up.view(-1, width), gh.view(-1, width)
    o2 = [o.view(-1, width) if o is not None else None for o in outs]
    for a in range(0, g2.shape[0], rows):
        for o, piece in zip(o2, grad(g2[a : a + rows], u2[a : a + rows], h2[a : a + rows])):
            if o is not None:
                o[a : a + rows] = piece
    return tuple(outs)


def _hooked(m) -> bool:
    return isinstance(m, nn.Module) and bool(m._forward_pre_hooks or m._forward_hooks)


def _plain(down: nn.Module, act) -> bool:
    """down_proj runs F.linear(h, weight, bias) and nothing else, and neither it nor act_fn has
    hooks of its own (act_fn's forward is called directly, as gelu.py calls its formula: global
    module hooks such as FlopCounterMode's module tracker must not see it run in backward)."""
    return type(down) is nn.Linear and not (_hooked(down) or _hooked(act))


def _forward_of(act):
    """act_fn's forward without the module call's hooks."""
    return act.forward if isinstance(act, nn.Module) else act


def _swapped_forward(original):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        dev = x.device.type
        if not (torch.is_grad_enabled() and _plain(down, self.act_fn)) or (
            torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
        ):
            return original(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        w, b = down.weight, down.bias
        if not (
            gate.requires_grad or up.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
        ):
            return down(self.act_fn(gate) * up)
        return _GatedDown.apply(gate, up, w, b, _forward_of(self.act_fn))

    return forward


_SWAPS = ClassSwaps(globals(), _swapped_forward)


_REFERENCE: list = []  # LlamaMLP.forward's code object, once looked up (None: no transformers)


def _reference_code() -> Optional[object]:
    if not _REFERENCE:
        try:
            from transformers.models.llama.modeling_llama import LlamaMLP
        except ImportError:  # no transformers: no Hugging Face modules to find
            _REFERENCE.append(None)
        else:
            _REFERENCE.append(LlamaMLP.forward.__code__)
    return _REFERENCE[0]


def _is_gated_mlp(m: nn.Module) -> bool:
    """m's class runs LlamaMLP's forward (its copies in other model families included)."""
    if not all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    code = getattr(getattr(type(m), "forward", None), "__code__", None)
    ref = _reference_code()
    if code is None or ref is None:
        return False
    same = ("co_code", "co_names", "co_consts", "co_varnames", "co_argcount")
    return all(getattr(code, a) == getattr(ref, a) for a in same)


def substitute_swiglu(roots: Iterable[nn.Module]) -> list[nn.Module]:
    """Swaps the class of every LlamaMLP-shaped module under `roots` (see the module note);
    returns the modules held (for restore_swiglu)."""
    return _SWAPS.hold(roots, _is_gated_mlp)


def restore_swiglu(modules: Iterable[nn.Module]) -> None:
    """Gives back what substitute_swiglu returned; the last holder restores the original class."""
    _SWAPS.restore(modules)
