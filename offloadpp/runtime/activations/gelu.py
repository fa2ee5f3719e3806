"""The tanh-form GELU written as a Python formula, made to save only its input.

Note: why. GPT-2's MLP uses Hugging Face's `gelu_new` (NewGELUActivation), the formula
0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in plain torch operators. Autograd saves what each
operator needs: the input (for the cube), the tanh's output, 0.5 x and 1 + tanh: four tensors at
the MLP's inner width where the function needs one. At GPT-3 13B, micro-batch 128 x 1024 tokens,
the three extra ones are 3 x 20480 x 2 bytes a token, 15 GiB in one block's MLP: even recomputing
that MLP on its own (a partial unit's piece) holds them at once, and the run was refused.

What is done: inside the units the runtime manages (ActivationManager.install, and the profiler,
so that measured profiles count what the runtime saves), each such module's class is swapped for
a subclass (still an instance of the original) whose forward is an autograd Function: forward
runs the module's own formula without recording it (the same operators in the same order: the
output is bit-identical) and saves only the input; backward runs the formula again on that input
under autograd and takes its gradient (the same operators and the same backward formulas:
bit-identical gradients, tests/test_gelu.py), holding the intermediates only for that moment,
in pieces of CHUNK_ELEMS elements when the input is larger (the per-element arithmetic is the
same; on the CPU a piece's boundary may move an element between a kernel's vectorised and scalar
paths, an ulp at most). An analytic derivative would need no more memory but rounds differently,
and Adam turns rounding noise in near-zero gradients into updates of order lr (tests/numerics.py).
The modules' class is restored by `restore_gelu` (the manager's remove()).

Formulas handled (Hugging Face's activations module, transformers.activations): NewGELUActivation (`gelu_new`),
FastGELUActivation (`gelu_fast`) and GELUTanh built with
use_gelu_tanh_python (`gelu_python_tanh`). torch's own `F.gelu` (`gelu`, `gelu_pytorch_tanh`)
saves only its input already. The analytic profile reads the config's `activation_function`
(planner/model_profile.py `MLP_SAVED`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .class_swap import ClassSwaps

# the backward re-runs the formula in pieces of at most this many elements: its intermediates
# then take 4 x 128 MiB (16-bit), not 4 x the input (5 GiB each at GPT-3 13B, micro-batch 128)
CHUNK_ELEMS = 1 << 26


class _TanhGelu(torch.autograd.Function):
    """forward: the module's own formula, saving x only; backward: the same formula run again
    on x under autograd (see the module note)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module, formula) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.module, ctx.formula = module, formula
        dev = x.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        return formula(module, x)  # grad mode is off in a Function's forward: nothing is saved

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        (x,) = ctx.saved_tensors
        dev, on, dtype = ctx.autocast

        def grad(xs: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
            xs = xs.detach().requires_grad_()
            # identity hooks innermost: these intermediates are not the forward's saved tensors
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=on):
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    y = ctx.formula(ctx.module, xs)
            return torch.autograd.grad(y, xs, gs)[0]

        if x.numel() <= CHUNK_ELEMS or not (x.is_contiguous() and g.is_contiguous()):
            return grad(x, g), None, None
        out = torch.empty_like(x)
        xf, gf, of = x.view(-1), g.view(-1), out.view(-1)
        for a in range(0, xf.numel(), CHUNK_ELEMS):
            of[a : a + CHUNK_ELEMS] = grad(xf[a : a + CHUNK_ELEMS], gf[a : a + CHUNK_ELEMS])
        return out, None, None


def _python_tanh(m: nn.Module) -> bool:
    act = getattr(m, "act", None)
    return getattr(act, "__name__", "") == "_gelu_tanh_python"


def _known() -> dict:
    """original class -> applies to this instance?"""
    try:
        from transformers import activations as hf
    except ImportError:  # no transformers: no Hugging Face modules to find
        return {}
    out = {}
    if hasattr(hf, "NewGELUActivation"):
        out[hf.NewGELUActivation] = lambda m: True
    if hasattr(hf, "FastGELUActivation"):
        out[hf.FastGELUActivation] = lambda m: True
    if hasattr(hf, "GELUTanh"):
        out[hf.GELUTanh] = _python_tanh
    return out


def _swapped_forward(formula):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and input.requires_grad):
            return formula(self, input)
        return _TanhGelu.apply(input, self, formula)

    return forward


_SWAPS = ClassSwaps(globals(), _swapped_forward)


def substitute_gelu(roots: Iterable[nn.Module]) -> list[nn.Module]:
    """Swaps the class of every tanh-form GELU module under `roots` (see the module note);
    returns the modules held (for restore_gelu)."""
    known = _known()
    return _SWAPS.hold(roots, lambda m: (f := known.get(type(m))) is not None and f(m))


def restore_gelu(modules: Iterable[nn.Module]) -> None:
    """Gives back what substitute_gelu returned; the last holder restores the original class."""
    _SWAPS.restore(modules)
