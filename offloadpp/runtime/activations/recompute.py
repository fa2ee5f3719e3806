"""Recompute at unit granularity (non-reentrant checkpointing), and the FLOP counter of the probe.

Note: how a recompute segment works. One call of a recompute unit's root module is a Segment.
In forward, every tensor autograd saves inside it is replaced by a RecomputeRef (segment, index)
and not kept; the segment keeps the call's arguments and the RNG (and autocast) state. The
first unpack in backward runs the root module's forward again, from those arguments, with that
RNG state, under hooks that collect what it saves, in order; each unpack then takes its tensor
by index (and drops it). That is torch.utils.checkpoint's non-reentrant scheme, at unit
granularity and without changing the module. The forward must save the same tensors in the same
order when run again (a check raises otherwise). Parameters are collected like any tensor: the
recompute runs during the unit's backward visit, when the runtime has its weights bound.

Note: swapped checkpoints (recompute_host, recompute_ssd). The manager replaces each tensor
argument by a SavedRef to a swapped record before the Segment is made, so the segment holds no
device bytes between forward and backward; the record is fetched back ahead of the recompute
like any swapped record, and `restore` rebuilds the argument (with requires_grad as it was) just
before the forward runs again. The bytes are the same bytes, so the recompute is as exact.

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

Note: derived checkpoints. A piece's tensor argument that is the output of the piece just before
it, where that piece ran no kept and no random operator (a norm: its Segment logged nothing), is
neither kept nor moved: the argument becomes a DerivedRef, and the recompute gets it by running
that piece's forward again, without grad, from its own checkpoint (which its own recompute, later
in backward, still needs, so it is read without being unpacked), and only while it is unchanged
(its version counter: a root that changes it in place before the next piece keeps it as a
checkpoint). A transformer block's attention
and MLP take the two norms' outputs: a GPT-2 block moves 12 x width values a token, not 14. The
norm runs the same operators on the same bytes, so the argument is the forward's, bit for bit.

Note: KV caches. Hugging Face models hand each block a cache object (even in training) that the
block appends its keys and values to: running the block again would append them twice and
change the cache the caller gets back. The recompute therefore passes None for a cache argument
(recognised by its interface, `update` and `get_seq_length`), as Hugging Face's own gradient
checkpointing does; in training from scratch that computes the same tensors. A cache that held a
prefix for the block would change them: every recomputed tensor's shape and dtype are checked
against the forward's, so that case raises instead of computing wrong gradients.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from .records import ActivationError


class SegState(enum.Enum):
    RECORDING = "recording"  # its forward is running
    SAVED = "saved"  # forward done: arguments and RNG state held, nothing else
    RECOMPUTED = "recomputed"  # backward ran it again; its saved tensors wait to be unpacked
    DONE = "done"  # every saved tensor was unpacked, or backward ended


class RecomputeRef:
    __slots__ = ("seg", "index", "size", "dtype")

    def __init__(self, seg: Segment, index: int, t: torch.Tensor):
        self.seg = seg
        self.index = index
        self.size = t.size()
        self.dtype = t.dtype


class CheckpointRef:
    """A recomputing unit's tensor argument while it is swapped (see the Note on swapped
    checkpoints): the record's SavedRef, and whether the argument required grad."""

    __slots__ = ("ref", "requires_grad")

    def __init__(self, ref, requires_grad: bool):
        self.ref = ref
        self.requires_grad = requires_grad


class DerivedRef:
    """A piece's argument while it is the previous piece's output (see the Note on derived
    checkpoints): that piece's Segment, and whether the argument required grad."""

    __slots__ = ("seg", "requires_grad")

    def __init__(self, seg: Segment, requires_grad: bool):
        self.seg = seg
        self.requires_grad = requires_grad


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


class Segment:
    def __init__(
        self, unit: str, fn: Callable, args: tuple, kwargs: dict, device: torch.device, input_bytes: int
    ):
        self.unit = unit
        self.owner: object = None  # the manager's UnitActivations
        self.fn = fn
        self.args: Optional[tuple] = tuple(_without_cache(a) for a in args)
        self.kwargs: Optional[dict] = {k: _without_cache(v) for k, v in kwargs.items()}
        self.device = device
        self.input_bytes = input_bytes  # accounted on the device until the recompute ran
        self.rng_cpu = torch.get_rng_state()
        self.rng_dev = (
            torch.get_device_module(device.type).get_rng_state(device) if device.type != "cpu" else None
        )
        self.autocast = [
            (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in {"cpu", device.type}
        ]
        self.count = 0
        self.tensors: Optional[list[Optional[torch.Tensor]]] = None
        self.taken = 0
        self.recomputed_bytes = 0  # accounted from the recompute until DONE
        self.log: Optional[OpLog] = None  # partial: the forward's operators (see the Note on partial)
        self.first_record = 0  # the unit's records from this index on were made in or after this segment
        # a piece's output tensor (see the Note on derived checkpoints)
        self.output: Optional[weakref.ref] = None
        self.output_version = -1
        self.state = SegState.RECORDING

    def pack(self, t: torch.Tensor) -> RecomputeRef:
        ref = RecomputeRef(self, self.count, t)
        self.count += 1
        return ref

    def close(self, output: Any = None) -> None:
        self.state = SegState.SAVED
        self.output = weakref.ref(output) if isinstance(output, torch.Tensor) else None
        self.output_version = output._version if isinstance(output, torch.Tensor) else -1

    def derives(self, x: Any) -> bool:
        """x is this closed piece's output, and the piece ran no kept nor random operator: the
        next piece's argument x can be derived (see the Note on derived checkpoints)."""
        return (
            self.state is SegState.SAVED
            and self.output is not None
            and self.output() is x
            and x._version == self.output_version  # (not changed in place since)
            and self.log is not None
            and not self.log.ops
        )

    def output_again(self, restore: Callable) -> torch.Tensor:
        """Its forward run again without grad, from its arguments (restore: an argument leaf ->
        the tensor it stands for): a derived argument of the next piece."""
        if self.state is not SegState.SAVED:
            raise ActivationError(
                f"unit {self.unit!r}: a piece's argument was derived after the piece before it was recomputed"
            )
        args, kwargs = tree_map(restore, (self.args, self.kwargs))
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for c in self._autocasts():
                stack.enter_context(c)
            return self.fn(*args, **kwargs)

    def _autocasts(self) -> list:
        """The forward's autocast state, as contexts to run its piece again under."""
        return [torch.autocast(dt, dtype=dtype, enabled=on) for dt, on, dtype in self.autocast]

    def recompute(
        self, measure: Callable[[list[torch.Tensor]], int], restore: Optional[Callable] = None
    ) -> None:
        """restore: maps an argument leaf to the tensor it stands for (a swapped checkpoint's
        SavedRef comes back as its tensor); leaves that are not swapped come back as they are."""
        if restore is not None:
            self.args, self.kwargs = tree_map(restore, (self.args, self.kwargs))
        collected: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> int:
            # Detached (as torch.utils.checkpoint does): the recomputed graph is thrown away, and a
            # tensor still pointing into it would tie that graph, through the forward graph's
            # saved RecomputeRefs, into a cycle Python's collector cannot see.
            collected.append(t.detach())
            return len(collected) - 1

        def never(_: Any):
            raise ActivationError(f"unit {self.unit!r}: the recomputed graph was used for backward")

        devices = [self.device] if self.device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"):
            torch.set_rng_state(self.rng_cpu)
            if self.rng_dev is not None:
                torch.get_device_module(self.device.type).set_rng_state(self.rng_dev, self.device)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(collect, never):
                ctxs = self._autocasts()
                if self.log is not None:
                    ctxs.append(Replayer(self.unit, self.log, restore or (lambda x: x)))
                for c in ctxs:
                    c.__enter__()
                try:
                    self.fn(*self.args, **self.kwargs)
                except ActivationError:
                    raise
                except Exception as e:
                    raise ActivationError(
                        f"unit {self.unit!r}: recomputing its forward in backward failed: {e} (a KV cache "
                        "holding a prefix cannot be replayed; use another activation policy for this unit)"
                    ) from e
                finally:
                    for c in reversed(ctxs):
                        c.__exit__(None, None, None)
        if len(collected) != self.count:
            raise ActivationError(
                f"unit {self.unit!r}: its forward saved {self.count} tensors for backward, the recompute "
                f"{len(collected)}; recompute needs a forward that saves the same tensors when run again "
                "(use another activation policy for this unit)"
            )
        if self.log is not None and ctxs[-1].i != len(self.log.ops):
            raise ActivationError(
                f"unit {self.unit!r}: its forward ran {len(self.log.ops)} kept or random operators, the partial recompute "
                f"{ctxs[-1].i}; partial needs a forward that runs the same operators again (use recompute)"
            )
        self.tensors = list(collected)
        self.recomputed_bytes = measure(collected)
        self.args = self.kwargs = None  # the inputs are no longer needed
        self.log = None
        self.state = SegState.RECOMPUTED

    def take(self, ref: RecomputeRef) -> torch.Tensor:
        index = ref.index
        t = self.tensors[index] if self.tensors is not None else None
        if t is None:
            raise ActivationError(
                f"unit {self.unit!r}: a recomputed saved tensor was unpacked twice (retain_graph or a "
                "custom Function reading ctx.saved_tensors twice is not supported with recompute)"
            )
        if t.size() != ref.size or t.dtype != ref.dtype:
            raise ActivationError(
                f"unit {self.unit!r}: saved tensor {index} was {tuple(ref.size)} {ref.dtype} in forward but "
                f"{tuple(t.size())} {t.dtype} when recomputed (a KV cache holding a prefix, or a forward that "
                "depends on state it changes); use another activation policy for this unit"
            )
        self.tensors[index] = None
        self.taken += 1
        return t

    @property
    def finished(self) -> bool:
        return self.state is SegState.RECOMPUTED and self.taken >= self.count

    def drop(self) -> None:
        self.tensors = None
        self.args = self.kwargs = None
        self.log = None
        self.output = None
        self.state = SegState.DONE


def _without_cache(x):
    """None for a KV cache argument, the argument otherwise (see the Note on caches)."""
    if isinstance(x, torch.Tensor) or not (hasattr(x, "update") and hasattr(x, "get_seq_length")):
        return x
    return None


class FlopCounter(TorchDispatchMode):
    """Counts FLOPs of the operators torch.utils.flop_counter knows (matmuls, convolutions,
    attention on CUDA); used once, in the forward that profiles units for `auto`."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out
