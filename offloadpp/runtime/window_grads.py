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
adds it into the parameter's fp32 sum on the device (`Unit.summed`), and returns None in its
place, so nothing reaches AccumulateGrad. When a parameter's last edge has delivered, the
executor counts its gradient as its post-accumulate-grad hook would (which it ignores for the
parameters summed here), and the unit, its gradients complete, is handed to the optimizer with
the fp32 sums (`Unit.take_grads`), each rounded once to the dtype the window keeps its gradients
in (Plan.window_grad_dtype: the compute dtype with one rank, its Note says what that changes) on
the device, so they leave it, and reach their home, in 16 bits, as the planner counts them. A
parameter used more than once in a micro-batch (an output projection tied to the embedding)
has its edges of that micro-batch summed in its own dtype first, as that micro-batch's
AccumulateGrad sums them horizontally. Only the order of the fp32 additions differs from the
horizontal window's (the last micro-batch first); on the tests' GPT-2 the sums come out equal to
the last bit, so a window's rounded sums are the horizontal window's fp32 sums rounded once
(tests/test_window.py).

Cost: the walk visits every node of the G graphs once per window, in Python (a 12-layer GPT-2
window of 8 micro-batches has 6,124 nodes: 0.1 s on the 2-core development VM under load, 16 us a
node, beside a window of seconds), one hook call per tapped node in backward, and the device
holds one fp32 sum per parameter of the unit in backward. fp32 compute
needs none of this: autograd's sum is fp32 already.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch


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
                # summed in its own dtype first, as that micro-batch's AccumulateGrad would
                if g is not None:
                    self._partial[part] = g
            elif g is not None:
                s = u.summed.get(i)
                if s is None:
                    u.summed[i] = g.to(torch.float32, copy=True)
                else:
                    s.add_(g)
            self._left[pid] -= 1
            if self._left[pid] == 0:
                self._executor.param_grad_done(u)
        return tuple(grads)
