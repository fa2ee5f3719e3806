"""A vertical window's gradients summed over its micro-batches in fp32 (16-bit compute).

Note: why not autograd's sum. In a vertical window one backward runs over the G micro-batches'
graphs (runtime/window.py's Note), so a parameter's G gradients meet in its one AccumulateGrad
node, and the engine adds them in that node's input buffer before the node runs: in the
parameter's dtype. With bf16 or fp16 compute that is a sum rounded to 16 bits at every
micro-batch, where the horizontal window (forward/backward/step per micro-batch) adds each
micro-batch's 16-bit gradient into the unit's fp32 gradient buffer (runtime/jobs.py), as torch's
mixed-precision recipe keeps `param.grad` of an fp32 master. With fp16 a 16-bit sum can also
overflow where no micro-batch's gradient does, and skip a step the horizontal window takes.

How. Before the window's backward, `GradSums` walks the G graphs from their losses and puts a
post-hook on every node with an edge into a trainable parameter's AccumulateGrad (a matmul's
backward, a transpose's, the fused head's). The hook takes that edge's gradient (one
micro-batch's, exactly as the horizontal window's backward makes it) out of the node's outputs,
keeps it on the device as it is (16 bits) in the parameter's list (`Unit.summed`), and returns
None in its place, so nothing reaches AccumulateGrad. When a parameter's last edge has
delivered, the executor counts its gradient as its post-accumulate-grad hook would (which it
ignores for the parameters summed here); when the unit's gradients are complete it is handed to
the optimizer (`Unit.take_grads`), which sums each parameter's kept gradients (`sum_window`) in
fp32, in the order they arrived, rounded once to the dtype the window keeps its gradients in
(Plan.window_grad_dtype: the compute dtype with one rank, its Note says what that changes) on
the device, so they leave it, and reach their home, in 16 bits, as the planner counts them (an
accelerator keeps one fp32 sum instead, added into as each arrives: see the next Note). A
parameter used more than once in a micro-batch (an output projection tied to the embedding)
has its edges of that micro-batch summed in its own dtype first, as that micro-batch's
AccumulateGrad sums them horizontally. Only the order of the fp32 additions differs from the
horizontal window's (the last micro-batch first); on the tests' GPT-2 the sums come out equal to
the last bit, so a window's rounded sums are the horizontal window's fp32 sums rounded once
(tests/test_window.py).

Note: why the gradients are kept and summed once. Adding each micro-batch's 16-bit gradient into
an fp32 sum as it arrives (`to(float32)`, then `add_`) moves about 10 bytes per element per
micro-batch through memory, on backward's own thread: on the CPU device that was 2.2 s of a 6.8 s
backward of a 12-layer GPT-2 window of 8 (docs/performance.md). Kept until the unit is complete,
the G gradients are read once and the rounded sum written once by one SIMD pass over all the
unit's parameters (offloadpp.optim.sum_parts_, csrc/adam: 2G + 2 bytes an element; 14x faster
than the adds at 50M elements x 8, `scripts/grad_sums.py`), with the same additions in the same
order, so the same bits. The price is memory: the device holds the unit's G 16-bit gradients
in its backward visit instead of one fp32 sum, which the planner counts
(planner/holds.py `visit_grad_bytes`) and the CPU device's pool is charged with as they are
kept (as optimizer._charge_grads charges the sums). Where the kernel does not apply (mixed
dtypes, a gradient not laid out densely) the same additions run in torch. On an accelerator
(`Device.copies`: CUDA, the stand-in) the adds are cheap (about 22 ms a window at GPT-2 1.31B)
and a large model's unit (a 175B layer: 1.8G parameters) has no room for G 16-bit copies of
its gradients beside its weights, so there each gradient is added into one fp32 sum as it
arrives, the same additions in the same order, and each parameter's sum is rounded once its last
edge has delivered: the unit holds 4 bytes a parameter in its backward visit (the planner's
count), not its fp32 sums beside their rounding (6).

Cost: the walk visits every node of the G graphs once per window, in Python (a 12-layer GPT-2
window of 8 micro-batches has 6,124 nodes: 0.1 s on the 2-core development VM under load, 16 us a
node, beside a window of seconds), one hook call per tapped node in backward. fp32 compute
needs none of this: autograd's sum is fp32 already.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator, Optional

import torch

from offloadpp.optim.kernels import HALF_DTYPES, HAVE_SUM_PARTS, sum_parts_

log = logging.getLogger("offloadpp.runtime")
_warned_stale = False


class GradSums:
    """Sums each trainable parameter's gradients over a vertical window in fp32 (the Note)."""

    def __init__(self, executor, units) -> None:
        self._executor = executor
        self._units = units
        # id(parameter) -> (unit, index in unit.params, parameter), trainable parameters only
        self._where = {
            id(p): (u, i, p) for u in units for i, (p, _) in enumerate(u.params) if p.requires_grad
        }
        self._left: dict[int, int] = {}  # edges into each parameter's AccumulateGrad yet to run
        self._parts: dict[tuple[int, int], int] = {}  # the same by (parameter, micro-batch)
        self._partial: dict[tuple[int, int], torch.Tensor] = {}  # 16-bit sums of those run so far
        # kept and summed once where the device is the CPU's (the Note); an accelerator adds each
        # into an fp32 sum as it arrives (cheap there, and G 16-bit copies of a unit's gradients
        # would not fit beside a large model's unit): Unit.summed then holds [the fp32 sum]
        self._keep = not executor.optimizer.device.copies

    @contextlib.contextmanager
    def summing(self, losses: list) -> Iterator[None]:
        """Within: one backward over `losses` sums each parameter's gradients in fp32."""
        handles = [
            node.register_hook(functools.partial(self._hook, outs))
            for node, outs in self._taps(losses).items()
        ]
        self._executor.summed = frozenset(self._left)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._executor.summed = frozenset()
            self._left.clear()
            self._parts.clear()
            self._partial.clear()
            for u in self._units:
                u.summed.clear()  # (taken by the optimizer unless backward failed)

    def _taps(self, losses: list) -> dict:
        """{node: [(output index, id(parameter), micro-batch)]} for each node of the losses'
        graphs with an edge into a trainable parameter's AccumulateGrad; counts the edges per
        parameter and per parameter and micro-batch."""
        taps: dict = {}
        seen = set()
        for m, loss in enumerate(losses):
            stack = [loss.grad_fn] if loss.grad_fn is not None else []
            while stack:
                node = stack.pop()
                if node in seen:
                    continue
                seen.add(node)
                for k, (nxt, _) in enumerate(node.next_functions):
                    if nxt is None:
                        continue
                    var = getattr(nxt, "variable", None)  # (AccumulateGrad's parameter)
                    if var is None:
                        stack.append(nxt)
                    elif id(var) in self._where:
                        pid = id(var)
                        taps.setdefault(node, []).append((k, pid, m))
                        self._left[pid] = self._left.get(pid, 0) + 1
                        self._parts[pid, m] = self._parts.get((pid, m), 0) + 1
        return taps

    def _charge(self, g: torch.Tensor) -> None:
        """On the CPU device a kept gradient is the device's memory outside its pool: charged to
        it until dropped (optimizer._charge_grads' Note), so backward waits at the budget."""
        pool = self._executor.optimizer.grad_pool
        if pool is not None:
            pool.charge_until_dropped((g,))

    def _hook(self, outs: list, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        grads = list(grad_inputs)
        for k, pid, m in outs:
            g, grads[k] = grads[k], None
            u, i, _ = self._where[pid]
            part = (pid, m)
            self._parts[part] -= 1
            if part in self._partial:
                g = self._partial.pop(part) if g is None else self._partial.pop(part) + g
            if self._parts[part] > 0:
                # a parameter used more than once in a micro-batch (tied embeddings): its edges
                # summed in its own dtype first, as that micro-batch's AccumulateGrad would (held
                # until its last edge: planner/schedule.py tied_partial_bytes counts them)
                if g is not None:
                    self._partial[part] = g
                    if self._keep:
                        self._charge(g)
            elif g is not None:
                kept = u.summed.get(i)
                if kept is None:
                    u.summed[i] = [g if self._keep else g.to(torch.float32, copy=True)]
                elif self._keep:
                    kept.append(g)  # (summed once the unit is complete: the Note)
                else:
                    kept[0].add_(g)
                if self._keep:
                    self._charge(g)
            self._left[pid] -= 1
            if self._left[pid] == 0:
                if not self._keep and i in u.summed:
                    # its sum complete: rounded now, so that the unit holds 4 bytes a parameter
                    # (fp32 sums of those still in progress, 16-bit ones of those done) rather than
                    # every fp32 sum beside its rounding at the unit's end (the same bits)
                    u.summed[i] = [u.summed[i][0].to(u.grads.dtype)]
                self._executor.param_grad_done(u)
        return tuple(grads)


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill its memory without gaps or overlap, in some order of its dimensions
    (a transposed gradient is; a slice is not)."""
    if t.is_contiguous():
        return True
    expect = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda x: x[1]):
        if stride != expect:
            return False
        expect *= size
    return True


def _fused(parts: list) -> Optional[torch.Tensor]:
    """parts[0] as the kernel's layout, where every part can be summed by it element for element
    in memory order: the CPU, one 16-bit dtype, the same shape and strides, dense."""
    global _warned_stale
    first = parts[0]
    if not HAVE_SUM_PARTS and first.device.type == "cpu" and not _warned_stale:
        _warned_stale = True
        log.warning(
            "offloadpp: the native extension offloadpp._C predates sum_parts_ (built before it was added): "
            "vertical windows sum their gradients with torch, the same bits several times slower; rebuild it "
            "(python setup.py build_ext --inplace, or make setup)"
        )
    if (
        not HAVE_SUM_PARTS
        or first.device.type != "cpu"
        or first.dtype not in HALF_DTYPES
        or not _dense(first)
    ):
        return None
    for t in parts[1:]:
        if (
            t.device != first.device
            or t.dtype != first.dtype
            or t.shape != first.shape
            or t.stride() != first.stride()
        ):
            return None
    return first


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-d view, in memory order."""
    return t if t.is_contiguous() and t.dim() == 1 else t.as_strided((t.numel(),), (1,))


def sum_window(parts_of: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each list's tensors added in fp32 in their order and rounded once to `dtype`: one kernel
    pass over all of them where it applies (the Note), else torch's adds (the same bits)."""
    out: list[Optional[torch.Tensor]] = [None] * len(parts_of)
    by_dtype: dict[torch.dtype, list] = {}
    for j, parts in enumerate(parts_of):
        if len(parts) == 1 and parts[0].dtype == dtype:
            out[j] = parts[0]  # (an accelerator's sum, rounded at the parameter's last edge)
            continue
        first = _fused(parts)
        if first is None:
            s = parts[0].to(torch.float32, copy=len(parts) > 1)  # (one part: rounded from fp32 below)
            for g in parts[1:]:
                s.add_(g)
            out[j] = s.to(dtype)  # (the sum itself where it is fp32)
            continue
        o = torch.empty_like(first, dtype=dtype)  # (a dense input's strides: the parts' layout)
        out[j] = o
        by_dtype.setdefault(first.dtype, []).append((_flat(o), [_flat(t) for t in parts]))
    for pairs in by_dtype.values():
        sum_parts_(pairs)
    return out  # type: ignore[return-value]
