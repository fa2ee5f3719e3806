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

Note: outputs backward never reads. A kept output whose value reaches no tensor autograd saves
(a block's last projections, GPT-2's c_proj and a Llama's o_proj and down: their outputs only
flow on to the piece's output, and a recompute's outputs are thrown away, recompute.py) is not
kept: its bytes are neither held nor moved, and the recompute is handed zeros of its shape in its
place (one zero expanded: no bytes held). The Recorder follows what each kept output's value flows into (`_spread`: every other
operator's outputs carry what its tensor arguments carry, but those made from their arguments'
shapes only, `_SHAPE_ONLY`, and a random operator's boolean outputs, its draws: dropout's mask),
and keeps an output once autograd saves a tensor that carries it (`saved`, from the pack hook;
the record is made at the next operator, or when the forward ends, outside the hook), or once a
scalar is read from one (`.item()`: the forward may branch on it). The gradients are the same bit
for bit: the recompute's saved tensors are made from the same values (the random operators from
the same RNG states; a mask does not depend on what it masks). GPT-3 13B b128: 2 x width a token
less a block (10 x width moved, not 12), and on the data-sheet profile its forward reaches its
compute floor (planner/model_profile.py, docs/performance.md).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .records import ActivationError, storage_key

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


# operators whose outputs are made from their arguments' shapes, dtypes and devices only (see the
# Note on outputs backward never reads)
_SHAPE_ONLY = frozenset(
    getattr(torch.ops.aten, n)
    for n in ("empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_empty_strided", "new_zeros",
              "new_ones", "new_full", "rand_like", "randn_like", "randint_like")
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
    replaced by its _Kept) for the kept ones, (operator, its RNG state) for the random ones; the
    other operators are not logged (they run again as they come)."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, Any]] = []
        self.kept: list[_Kept] = []  # the kept operators' outputs, until the forward ends


class _Kept:
    """A kept operator's output: what `keep` returned once backward was found to need its value
    (`ref`), else only its shape, for the zeros the recompute is handed (see the Note on outputs
    backward never reads)."""

    __slots__ = ("tensor", "version", "ref", "wanted", "size", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor: Any = t
        self.version = t._version
        self.ref: Any = None
        self.wanted = False
        self.size, self.dtype, self.device = t.size(), t.dtype, t.device

    def again(self, restore: Callable[[Any], Any]) -> torch.Tensor:
        """What the recompute is handed in its place."""
        if self.wanted:
            return restore(self.ref)
        # (one zero seen at every index: no bytes of its size; whatever reads it makes its own)
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.size)


class Recorder(TorchDispatchMode):
    """Logs a partial unit's forward (see the Note on partial); keep(t) -> what stands for t."""

    def __init__(self, unit: str, log: OpLog, keep: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.unit = unit
        self.log = log
        self.keep = keep
        # a storage -> (its weak reference, the kept outputs its values come from)
        self.carries: dict[Any, tuple[Any, set[_Kept]]] = {}
        self.want: list[_Kept] = []  # found needed where no record can be made (in a pack hook)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.want:
            self._keep_wanted()
        if _random(func):  # replayed from the same RNG state (dropout masks are not kept)
            rng = _Rng(args, kwargs)
            self.log.ops.append((func, rng))
            out = func(*args, **kwargs)
            self._spread(func, (args, kwargs), out)
            return out
        out = func(*args, **kwargs)
        if not keeps_output(func):
            self._spread(func, (args, kwargs), out)
            return out
        if func._schema.is_mutable:
            raise ActivationError(
                f"unit {self.unit!r}: partial cannot replay the in-place operator {func} (use recompute)"
            )

        def kept(t):  # (its own values only: the Replayer hands it back without running the operator)
            if not isinstance(t, torch.Tensor):
                return t
            k = _Kept(t)
            self.log.kept.append(k)
            self._carry(t, {k})
            return k

        self.log.ops.append((func, tree_map(kept, out)))
        return out

    def _spread(self, func, args, out) -> None:
        """Its outputs carry what its tensor arguments carry (see the Note on outputs backward
        never reads)."""
        if not self.carries or func._overloadpacket in _SHAPE_ONLY:
            return
        src: set[_Kept] = set()
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor):
                src |= self._carried(t)
        if not src:
            return
        if func._schema.is_mutable:  # (changed in place: kept, so check() sees the change and raises)
            self._wanted(src)
            return
        draws = _random(func)
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor):
                if not (draws and o.dtype is torch.bool):
                    self._carry(o, src)
            elif isinstance(o, (bool, int, float, complex)):  # a value read: the forward may branch on it
                self._wanted(src)

    def _carried(self, t: torch.Tensor) -> set[_Kept]:
        if t.layout is not torch.strided:  # (no storage of its own to follow: see _carry)
            return set()
        weak = storage_key(t)[1]
        got = self.carries.get(weak)
        if got is None:
            return set()
        if got[0].expired():  # (a storage freed since: another one now has its address)
            del self.carries[weak]
            return set()
        return got[1]

    def _carry(self, t: torch.Tensor, ks: set[_Kept]) -> None:
        if t.layout is not torch.strided:  # (a sparse or nested output: kept rather than followed)
            self._wanted(ks)
            return
        weak = storage_key(t)[1]
        if weak in self.carries and not self.carries[weak][0].expired():
            self.carries[weak][1].update(ks)
        else:
            self.carries[weak] = (weak, set(ks))

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saves t (the pack hook): the kept outputs it carries are needed."""
        if self.carries and isinstance(t, torch.Tensor):
            self._wanted(self._carried(t))

    def _wanted(self, ks) -> None:
        for k in ks:
            if not k.wanted:
                k.wanted = True
                self.want.append(k)

    def _keep_wanted(self) -> None:
        want, self.want = self.want, []
        for k in want:
            if k.tensor._version != k.version:
                raise ActivationError(
                    f"unit {self.unit!r}: an operator's output kept for the partial recompute was changed in "
                    "place later in the unit's forward; use recompute for this unit"
                )
            k.ref = self.keep(k.tensor)

    def check(self) -> None:
        """At the forward's end (outside the mode): the needed outputs made records, checked
        unchanged; the others let go."""
        self._keep_wanted()
        for k in self.log.kept:
            if k.wanted and k.tensor._version != k.version:
                raise ActivationError(
                    f"unit {self.unit!r}: an operator's output kept for the partial recompute was changed in "
                    "place later in the unit's forward; use recompute for this unit"
                )
            k.tensor = None
        self.log.kept.clear()
        self.carries.clear()


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
        return tree_map(lambda k: k.again(self.restore) if type(k) is _Kept else k, out)
