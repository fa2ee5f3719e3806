"""Measuring a model: one profiling iteration with hooks per unit -> ModelProfile.

Units are the runtime's (find_units / layout_units), so names and sizes match the plan's.

Note: what is measured, and how.
  FLOPs      torch.utils.flop_counter.FlopCounterMode around one forward and one backward; the
             running total is read at each unit boundary and the difference charged to the unit.
  activation bytes  a saved_tensors_hooks pack hook charges every tensor autograd saves to the
             unit running, once per storage, parameters (and views of them) excluded: what the
             unit keeps alive from its forward to its backward, with the runtime's tanh-form
             GELU in place (offloadpp/runtime/activations/gelu.py: it saves only its input) and
             its Llama MLP (swiglu.py: its input, gate's and up's outputs).
  output bytes  the unit's output tensors (what stays if the unit is recomputed).
  time       `repeats` further iterations with only the boundary hooks: forward visit j runs
             from unit j's first module to unit j+1's (the last includes the loss), backward
             visit j from the gradient reaching unit j's outputs to it reaching unit j-1's (the
             first includes the loss's backward); the median per unit. The boundaries are where
             the runtime's visits start, so the times add up to what a step computes.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from typing import Callable, Optional, Sequence

from offloadpp.planner.model_profile import ModelProfile, UnitProfile


def _tensors(x) -> list:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


class _Recorder:
    """Boundary hooks: which unit runs now, and when each visit started."""

    def __init__(self, names: list[str], modules: dict, defs):
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.current = -1
        self.fwd_marks: list[tuple[int, float, float]] = []  # (unit, time, flops)
        self.bwd_marks: list[tuple[int, float, float]] = []
        self.bwd_seen: set[int] = set()
        self.flops: Optional[Callable[[], float]] = None
        self.out_bytes = [0] * len(names)
        self.handles = []
        for d in defs:
            i = self.index[d.name]
            for q in d.modules:
                m = modules[q]
                self.handles.append(m.register_forward_pre_hook(functools.partial(self._pre, i)))
                self.handles.append(m.register_forward_hook(functools.partial(self._post, i)))

    def _now_flops(self) -> float:
        return float(self.flops()) if self.flops is not None else 0.0

    def _pre(self, i: int, module, args):
        if i != self.current:
            self.current = i
            self.fwd_marks.append((i, time.perf_counter(), self._now_flops()))

    def _post(self, i: int, module, args, output):
        import torch

        outs = [t for t in _tensors(output) if t.requires_grad]
        self.out_bytes[i] += sum(t.numel() * t.element_size() for t in _tensors(output))
        if outs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                outs, functools.partial(self._pre_backward, i), mode="any"
            )

    def _pre_backward(self, i: int, grad) -> None:
        if i not in self.bwd_seen:
            self.bwd_seen.add(i)
            self.bwd_marks.append((i, time.perf_counter(), self._now_flops()))

    def reset(self) -> None:
        self.current = -1
        self.fwd_marks, self.bwd_marks, self.bwd_seen = [], [], set()
        self.out_bytes = [0] * len(self.names)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _spans(marks, end: float, n: int) -> list[float]:
    """Per unit, the sum of (next mark - this mark); the last mark runs to `end`."""
    out = [0.0] * n
    for k, (i, t, _) in enumerate(marks):
        nxt = marks[k + 1][1] if k + 1 < len(marks) else end
        out[i] += nxt - t
    return out


class ModelProfiler:
    """The hooks and the bookkeeping of profile_model, kept installed so that timing iterations
    can be repeated (the benchmarks interleave them with training steps).

        with ModelProfiler(model, batch) as prof:
            prof.count()              # FLOPs, saved bytes, output bytes (one iteration)
            prof.time(repeats=3)      # per-unit times, appended to prof.fwd_s / prof.bwd_s
            profile = prof.profile()  # medians so far
    """

    def __init__(self, model, batch: dict, *, units: Optional[Sequence[Sequence[str]]] = None,
                 compute_dtype: str = "fp32", loss_fn: Optional[Callable] = None, name: str = "",
                 runtime_layout: bool = False):  # fmt: skip
        import torch

        from offloadpp.runtime.activations.gelu import substitute_gelu
        from offloadpp.runtime.activations.head import KEEP_LOGITS, FusedHead, fusable_head
        from offloadpp.runtime.activations.loss import causal_lm, substitute_loss, uses_causal_lm_loss
        from offloadpp.runtime.activations.swiglu import substitute_swiglu
        from offloadpp.runtime.partition import find_units, layout_units

        self.model, self.batch, self.compute_dtype, self.name = model, batch, compute_dtype, name
        defs = find_units(model, tuple(tuple(u) for u in units) if units is not None else None)
        self.layouts = layout_units(model, defs)
        if runtime_layout:
            _flatten_like_runtime(self.layouts)
        self.n = n = len(defs)
        modules = dict(model.named_modules())
        self.rec = _Recorder([d.name for d in defs], modules, defs)
        # measure what the runtime saves: its GELU saving only its input
        # (offloadpp/runtime/activations/gelu.py)
        self.gelus = substitute_gelu(modules[q] for d in defs for q in d.modules)
        # and Llama's MLP saving its input, gate's and up's outputs only (swiglu.py)
        self.swiglus = substitute_swiglu(modules[q] for d in defs for q in d.modules)
        # and its loss saving the logits only (offloadpp/runtime/activations/loss.py), fused with
        # the head's matmul (head.py) where the runtime fuses them: the head's saved bytes are its
        # input and the logits (its policy keeping them), its FLOPs the matmul's, both charged to it
        self.loss = substitute_loss(model)
        lin = fusable_head(causal_lm(model)) if loss_fn is None and uses_causal_lm_loss(model) else None
        self.fused = (
            FusedHead(model, lin, scope=contextlib.nullcontext, mode=lambda: KEEP_LOGITS) if lin else None
        )
        if self.fused is not None:
            self.fused.install()
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.loss_of = loss_fn or (lambda out: out.loss if hasattr(out, "loss") else out[0])
        self.cuda = next(model.parameters()).device.type == "cuda"
        self.fflops, self.bflops = [0.0] * n, [0.0] * n
        self.saved, self.out_bytes = [0] * n, [0] * n
        self.fwd_s: list[list[float]] = [[] for _ in range(n)]
        self.bwd_s: list[list[float]] = [[] for _ in range(n)]
        self._torch = torch
        self._warm = False

    def __enter__(self) -> ModelProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        from offloadpp.runtime.activations.gelu import restore_gelu
        from offloadpp.runtime.activations.loss import restore_loss
        from offloadpp.runtime.activations.swiglu import restore_swiglu

        self.rec.remove()
        restore_gelu(self.gelus)
        restore_swiglu(self.swiglus)
        self.gelus, self.swiglus = [], []
        if self.fused is not None:
            self.fused.remove()
            self.fused = None
        restore_loss(self.loss)
        self.loss = None

    def _sync(self) -> None:
        if self.cuda:
            self._torch.accelerator.synchronize()

    def _iteration(self) -> tuple[float, float, float]:
        rec = self.rec
        rec.reset()
        self._sync()
        t0 = time.perf_counter()
        loss = self.loss_of(self.model(**self.batch))
        self._sync()
        t1 = time.perf_counter()
        rec.current = -1
        loss.backward()
        self._sync()
        t2 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        return t0, t1, t2

    def warm_up(self) -> None:
        if not self._warm:
            self._iteration()  # allocator, kernels, lazy init
            self._warm = True

    def count(self) -> None:
        """One iteration under FlopCounterMode and a saved-tensors hook (see the module note)."""
        from torch.utils.flop_counter import FlopCounterMode

        torch, rec, n = self._torch, self.rec, self.n
        self.warm_up()
        saved = [0] * n
        seen: list[set] = [set() for _ in range(n)]

        def pack(t):
            i = rec.current
            if i >= 0:
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in self.param_ptrs and ptr not in seen[i]:
                    seen[i].add(ptr)
                    saved[i] += st.nbytes()
            return t

        counter = FlopCounterMode(display=False)
        rec.flops = counter.get_total_flops
        rec.reset()
        try:
            with counter:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                    loss = self.loss_of(self.model(**self.batch))
                fwd_marks, fwd_total = list(rec.fwd_marks), counter.get_total_flops()
                rec.current = -1
                loss.backward()
                bwd_marks, bwd_total = list(rec.bwd_marks), counter.get_total_flops()
        finally:
            rec.flops = None
        self.out_bytes = list(rec.out_bytes)
        self.model.zero_grad(set_to_none=True)
        self.fflops, self.bflops = [0.0] * n, [0.0] * n
        for k, (i, _, f) in enumerate(fwd_marks):
            self.fflops[i] += (fwd_marks[k + 1][2] if k + 1 < len(fwd_marks) else fwd_total) - f
        for k, (i, _, f) in enumerate(bwd_marks):
            self.bflops[i] += (bwd_marks[k + 1][2] if k + 1 < len(bwd_marks) else bwd_total) - f
        if bwd_marks:  # the loss's backward ran before the first unit's mark: charge it to that unit
            self.bflops[bwd_marks[0][0]] += bwd_marks[0][2] - fwd_total
        self.saved = saved

    def time(self, repeats: int = 1) -> None:
        """`repeats` timed iterations with only the boundary hooks."""
        self.warm_up()
        for _ in range(repeats):
            t0, t1, t2 = self._iteration()
            for i, v in enumerate(_spans(self.rec.fwd_marks, t1, self.n)):
                self.fwd_s[i].append(v)
            marks = list(self.rec.bwd_marks)
            if marks:
                marks[0] = (marks[0][0], t1, 0.0)  # the loss's backward belongs to the first visit
            for i, v in enumerate(_spans(marks, t2, self.n)):
                self.bwd_s[i].append(v)

    def profile(self, last: Optional[int] = None) -> ModelProfile:
        """The profile from the counts and the median of the timed iterations (the last `last` only)."""
        torch = self._torch
        units = []
        for i, lay in enumerate(self.layouts):
            spec = lay.spec()
            f = self.fwd_s[i][-last:] if last else self.fwd_s[i]
            b = self.bwd_s[i][-last:] if last else self.bwd_s[i]
            units.append(
                UnitProfile(
                    name=spec.name,
                    numel=spec.numel,
                    frozen_numel=spec.frozen_numel,
                    frozen_dtype=spec.frozen_dtype,
                    forward_flops=int(self.fflops[i]),
                    backward_flops=int(self.bflops[i]),
                    activation_bytes=int(self.saved[i]),
                    output_bytes=int(self.out_bytes[i]),
                    borrows=spec.borrows,
                    backward_needs_weights=spec.backward_needs_weights,
                    forward_s=statistics.median(f) if f else None,
                    backward_s=statistics.median(b) if b else None,
                )
            )
        first = next(iter(self.batch.values()))
        mb, seq = (int(first.shape[0]), int(first.shape[1])) if getattr(first, "ndim", 0) >= 2 else (1, 1)
        return ModelProfile(
            model=self.name or type(self.model).__name__,
            micro_batch=mb,
            seq_len=seq,
            compute_dtype=self.compute_dtype,
            units=tuple(units),
            source="measured",
            measured_device="cuda" if self.cuda else "cpu",
            torch_threads=torch.get_num_threads(),
            gemms=_gemms_of(self.model, mb * seq),
        )


def _flatten_like_runtime(layouts) -> None:
    """Points each unit's parameters at views of one aligned flat buffer per unit, as the runtime
    lays them out (offloadpp.io.aligned_empty: 4 KiB aligned, huge pages from 2 MiB): GEMMs over
    few tokens are bound by reading the weights, and the layout changes how fast that goes."""
    import torch

    from offloadpp.io import aligned_empty
    from offloadpp.planner import flat_numel

    with torch.no_grad():
        for lay in layouts:
            for params, numel in (
                (lay.params, lay.numel),
                (lay.frozen, lay.frozen_numel),
            ):  # (docs/frozen.md)
                if not params:
                    continue
                p0 = params[0][0]
                if p0.device.type != "cpu":
                    return
                flat = aligned_empty(flat_numel(numel), dtype=p0.dtype, pin=False)
                for p, s in params:
                    view = flat[s.offset : s.offset + s.numel].view(s.shape)
                    view.copy_(p.detach())
                    p.data = view


def profile_model(
    model,
    batch: dict,
    *,
    units: Optional[Sequence[Sequence[str]]] = None,
    compute_dtype: str = "fp32",
    repeats: int = 3,
    loss_fn: Optional[Callable] = None,
    name: str = "",
    runtime_layout: bool = False,
) -> ModelProfile:
    """Profiles `model` on `batch` (keyword arguments of its forward; a "labels" entry makes
    Hugging Face models return the loss). `loss_fn(output) -> scalar` otherwise. The model runs
    where its parameters are; gradients are cleared afterwards. `runtime_layout`: first move the
    parameters into per-unit aligned flat buffers as the runtime does (changes the model)."""
    with ModelProfiler(
        model, batch, units=units, compute_dtype=compute_dtype, loss_fn=loss_fn, name=name
    ) as prof:
        prof.count()
        prof.time(max(1, repeats))
        return prof.profile()


def _gemms_of(model, tokens: int) -> tuple[tuple[int, int, int], ...]:
    """Distinct (tokens, in, out) shapes of the model's linear layers (nn.Linear, GPT-2's Conv1D)."""
    from torch import nn

    shapes = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Linear):
            shape = (tokens, m.in_features, m.out_features)
        elif type(m).__name__ == "Conv1D" and w is not None and w.ndim == 2:
            shape = (tokens, int(w.shape[0]), int(w.shape[1]))
        else:
            continue
        if shape not in shapes:
            shapes.append(shape)
    return tuple(shapes)
