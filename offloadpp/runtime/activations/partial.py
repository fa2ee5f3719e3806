"""Selective recomputation's operator log (a partial unit's Segment carries one).

Note: partial (selective recomputation). A partial unit's Segment also carries an OpLog. While
its forward runs, a dispatch mode (Recorder) logs every operator in order; the outputs of the
operators expensive to run again (matmuls, attention: KEEP_OPS) are handed to `keep`, which
makes them records of the unit (kept, or swapped with the checkpoint as partial_host/partial_ssd
say); each random operator (tagged nondeterministic_seeded: dropout, in place or not) logs the
RNG state it drew from. In backward the forward runs again under a Replayer: the i-th kept or
random operator it meets must be the i-th logged one (a check raises otherwise; the cheap
operators are not logged, so a forward that builds a constant once and caches it still replays); a logged output is handed back (fetched like any
record) instead of running the operator, a random operator runs again from its own RNG state
(the skipped operators may have drawn from the RNG too: attention's dropout on CUDA), the rest
run. Dropout masks are therefore the forward's, bit for bit, without keeping them. A kept output changed in place before the unit's forward ended would be replayed
with the wrong bytes: the version counters are checked when the forward ends (and raise).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .records import ActivationError

KEEP_OPS = frozenset(
    getattr(torch.ops.aten, n)
    for n in (
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
    )
    if hasattr(torch.ops.aten, n)
)  # fmt: skip


def keeps_output(func) -> bool:
    """A partial unit keeps this operator's outputs (see the Note on partial)."""
    return func._overloadpacket in KEEP_OPS


def _random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class _Rng:
    """The RNG state a random operator drew from in forward (CPU, and its accelerator's: the
    device module's generator, torch.get_device_module)."""

    __slots__ = ("cpu", "dev", "device")

    def __init__(self, args, kwargs) -> None:
        dev = next((t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        dev = torch.device(kwargs.get("device") or "cpu") if dev is None else dev
        self.device = dev if dev.type != "cpu" else None
        self.cpu = torch.get_rng_state()
        self.dev = torch.get_device_module(dev.type).get_rng_state(dev) if self.device is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.get_device_module(self.device.type).set_rng_state(self.dev, self.device)


class OpLog:
    """A partial unit's logged operators in forward order: (operator, its outputs with each tensor
    replaced by what `keep` returned) for the kept ones, (operator, its RNG state) for the random
    ones; the other operators are not logged (they run again as they come)."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, Any]] = []
        self.kept: list[tuple[torch.Tensor, int]] = []  # (output, its version when kept)


class Recorder(TorchDispatchMode):
    """Logs a partial unit's forward (see the Note on partial); keep(t) -> what stands for t."""

    def __init__(self, unit: str, log: OpLog, keep: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.unit = unit
        self.log = log
        self.keep = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _random(func):  # replayed from the same RNG state (dropout masks are not kept)
            rng = _Rng(args, kwargs)
            self.log.ops.append((func, rng))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not keeps_output(func):
            return out
        if func._schema.is_mutable:
            raise ActivationError(
                f"unit {self.unit!r}: partial cannot replay the in-place operator {func} (use recompute)"
            )

        def kept(t):
            if not isinstance(t, torch.Tensor):
                return t
            self.log.kept.append((t, t._version))
            return self.keep(t)

        self.log.ops.append((func, tree_map(kept, out)))
        return out

    def check(self) -> None:
        for t, version in self.log.kept:
            if t._version != version:
                raise ActivationError(
                    f"unit {self.unit!r}: an operator's output kept for the partial recompute was changed in "
                    "place later in the unit's forward; use recompute for this unit"
                )
        self.log.kept.clear()


class Replayer(TorchDispatchMode):
    """Runs a partial unit's forward again, handing back the logged outputs (restore(x) -> the
    tensor x stands for)."""

    def __init__(self, unit: str, log: OpLog, restore: Callable[[Any], Any]) -> None:
        super().__init__()
        self.unit = unit
        self.log = log
        self.restore = restore
        self.i = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (_random(func) or keeps_output(func)):
            return func(*args, **(kwargs or {}))
        if self.i >= len(self.log.ops) or self.log.ops[self.i][0] is not func:
            want = self.log.ops[self.i][0] if self.i < len(self.log.ops) else "the end of its forward"
            raise ActivationError(
                f"unit {self.unit!r}: the partial recompute ran {func} as operator {self.i}, the forward "
                f"ran {want}; partial needs a forward that runs the same operators again (use recompute)"
            )
        out = self.log.ops[self.i][1]
        self.i += 1
        if type(out) is _Rng:
            out.restore()
            return func(*args, **(kwargs or {}))
        return tree_map(self.restore, out)
