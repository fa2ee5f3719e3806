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

Note: nested (recompute_nested*). A block's whole recompute holds everything the block saves at
once (a GPT-2 block: 16-18 x width values a token); where that does not fit the device, partial
moves 12x the checkpoint's bytes. Nested keeps the one checkpoint and pays a forward instead. Its
pieces are the root's direct children that hold parameters (a block's norms, attention, MLP).
The first unpack runs the root's forward again (phase A) under a pack hook that keeps what the
root's own operators save and, inside a piece, keeps nothing: each piece's call is logged as a
_Piece (its arguments, detached with requires_grad as they were: the boundaries; its RNG
state; the range of saved-tensor indices it fills), and its saved tensors are measured while the
piece runs and dropped when it ends. An unpack whose index lies in a piece's range runs that
piece's forward again (phase B), from its arguments and RNG state, collecting its saved tensors
into the range; the piece's arguments are then dropped. Backward of the block thus holds the
boundaries and one piece's saved tensors, in the order autograd runs the pieces (last to first).
A piece whose argument is the previous piece's output (a block's attention and MLP take the
norms' outputs) holds no boundary for it: its recompute makes it again by running the previous
piece without grad from that piece's own arguments and RNG state (the same operators on the same
bytes), as partial derives its checkpoints; a block then holds two boundaries, not four.
The last piece (the forward marks where its call began, `last_piece_start`) is the one backward
needs first: phase A keeps what it saves instead of running it again (a GPT-2 block's MLP, about
two thirds of its FLOPs), so the price is the forward of the other pieces, not of the whole unit.
Why not torch.utils.checkpoint nested inside the recompute: the graph backward runs is the
forward's, whose saved tensors are this segment's RecomputeRefs by index; a checkpoint opened in
the recompute would own the graph the recompute builds, which is thrown away. This is torch's
non-reentrant scheme (a recompute filling saved-tensor slots by index, RNG state forked and
restored) applied once more, one level down, to the slots of one piece. DeepSpeed's
activation checkpointing (reentrant, runtime/activation_checkpointing) has no nesting. The
accounting counts, from phase A, the boundaries and the largest piece's saved bytes (what the
block's backward holds at most), so backward's prefetch of the next units leaves that room.

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


class _Piece:
    """One call of a nested unit's piece in the recompute (see the Note on nested): its
    arguments (detached, requires_grad as they were), RNG state, and saved-tensor range."""

    __slots__ = (
        "module",
        "args",
        "kwargs",
        "rng_cpu",
        "rng_dev",
        "start",
        "end",
        "nbytes",
        "taken",
        "state",
        "kept",
        "output",
        "version",
    )

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict, seg: Segment, start: int):
        self.module = module
        prev = seg.pieces[-1] if seg.pieces else None

        def arg(x):
            if prev is not None and prev.derives(x):  # (see the Note on nested: derived arguments)
                return _FromPrev(prev, x.requires_grad)
            return _boundary(x)

        self.args, self.kwargs = tree_map(arg, (args, kwargs))
        self.rng_cpu, self.rng_dev = _rng_states(seg.device)
        self.start = start
        self.end = -1
        self.nbytes = 0  # what its saved tensors take (measured in phase A)
        self.taken = 0
        self.state = SegState.SAVED
        # the unit's last piece, which backward needs first: its saved tensors are kept from the
        # unit's recompute instead of being made again (see the Note on nested)
        self.kept = start == seg.last_piece_start
        self.output: Optional[weakref.ref] = None  # its output tensor, while the next piece may take it
        self.version = -1

    def derives(self, x: Any) -> bool:
        """x is this piece's output, unchanged since, and its arguments are still held: the next
        piece's argument x can be made again from them instead of being held."""
        return (
            isinstance(x, torch.Tensor)
            and self.args is not None
            and self.output is not None
            and self.output() is x
            and x._version == self.version
        )


class _FromPrev:
    """A nested piece's argument that is the previous piece's output: made again from that
    piece's arguments when needed (see the Note on nested)."""

    __slots__ = ("piece", "requires_grad")

    def __init__(self, piece: _Piece, requires_grad: bool):
        self.piece = piece
        self.requires_grad = requires_grad


def _boundary(x):
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().requires_grad_(x.requires_grad) if x.requires_grad else x.detach()


def _rng_states(device: torch.device):
    dev = torch.get_device_module(device.type).get_rng_state(device) if device.type != "cpu" else None
    return torch.get_rng_state(), dev


@contextlib.contextmanager
def _rng_from(device: torch.device, cpu: torch.Tensor, dev: Optional[torch.Tensor]):
    """Runs with the RNG state (cpu, dev); the global RNG is left as it was."""
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.get_device_module(device.type).set_rng_state(dev, device)
        yield


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
        # nested: the modules whose calls are pieces, then each call's _Piece (see the Note on nested)
        self.piece_modules: tuple[torch.nn.Module, ...] = ()
        self.pieces: list[_Piece] = []
        self.last_piece_start = -1  # the saved-tensor index the last piece's call started at, in forward
        self.piece_depth = 0  # (forward: inside a piece's call)
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

    def recompute(self, measure: Callable[..., int], restore: Optional[Callable] = None) -> None:
        """restore: maps an argument leaf to the tensor it stands for (a swapped checkpoint's
        SavedRef comes back as its tensor); leaves that are not swapped come back as they are.
        measure(tensors, exclude=()): the device bytes of tensors' activations, exclude's left out."""
        if restore is not None:
            self.args, self.kwargs = tree_map(restore, (self.args, self.kwargs))
        collected: list[Optional[torch.Tensor]] = []
        inside: list[_Piece] = []  # nested: the piece running (its saved tensors, measured, dropped)
        in_piece: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> int:
            # Detached (as torch.utils.checkpoint does): the recomputed graph is thrown away, and a
            # tensor still pointing into it would tie that graph, through the forward graph's
            # saved RecomputeRefs, into a cycle Python's collector cannot see.
            if inside:
                in_piece.append(t)
                collected.append(t.detach() if inside[-1].kept else None)
            else:
                collected.append(t.detach())
            return len(collected) - 1

        with contextlib.ExitStack() as hooks:
            for m in self.piece_modules:
                hooks.enter_context(_piece_hooks(m, self, inside, in_piece, collected, measure))
            self._run_again(collect, restore)
        if len(collected) != self.count:
            raise ActivationError(
                f"unit {self.unit!r}: its forward saved {self.count} tensors for backward, the recompute "
                f"{len(collected)}; recompute needs a forward that saves the same tensors when run again "
                "(use another activation policy for this unit)"
            )
        self.tensors = collected
        kept = [p for p in self.pieces if p.kept]
        boundaries = [
            t
            for i, t in enumerate(collected)
            if t is not None and not any(p.start <= i < p.end for p in kept)
        ]
        boundaries += [
            t for p in self.pieces for t in tree_leaves((p.args, p.kwargs)) if isinstance(t, torch.Tensor)
        ]
        # nested: the largest piece's saved tensors counted from here on (see the Note on nested)
        self.recomputed_bytes = measure(boundaries) + max((p.nbytes for p in self.pieces), default=0)
        for p in kept:
            p.args = p.kwargs = None
        self.args = self.kwargs = None  # the inputs are no longer needed
        self.log = None
        self.state = SegState.RECOMPUTED

    def _run_again(self, collect: Callable, restore: Optional[Callable]) -> None:
        def never(_: Any):
            raise ActivationError(f"unit {self.unit!r}: the recomputed graph was used for backward")

        with _rng_from(self.device, self.rng_cpu, self.rng_dev):
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
        if self.log is not None and ctxs[-1].i != len(self.log.ops):
            raise ActivationError(
                f"unit {self.unit!r}: its forward ran {len(self.log.ops)} kept or random operators, the partial recompute "
                f"{ctxs[-1].i}; partial needs a forward that runs the same operators again (use recompute)"
            )

    def piece_at(self, index: int) -> Optional[_Piece]:
        """The nested piece whose saved tensors include `index` and are still to be recomputed."""
        for p in self.pieces:
            if p.start <= index < p.end:
                return p if p.state is SegState.SAVED else None
        return None

    def recompute_piece(self, p: _Piece) -> None:
        """Phase B (see the Note on nested): the piece's forward again, from its arguments and RNG
        state, its saved tensors into its range."""
        collected: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> int:
            collected.append(t.detach())  # (detached: see recompute)
            return len(collected) - 1

        def never(_: Any):
            raise ActivationError(f"unit {self.unit!r}: the recomputed graph was used for backward")

        args, kwargs = tree_map(self._piece_arg, (p.args, p.kwargs))
        with _rng_from(self.device, p.rng_cpu, p.rng_dev), contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(collect, never))
            for c in self._autocasts():
                stack.enter_context(c)
            try:
                p.module(*args, **kwargs)
            except Exception as e:
                raise ActivationError(
                    f"unit {self.unit!r}: recomputing its piece {type(p.module).__name__} in backward failed: {e}"
                ) from e
        if len(collected) != p.end - p.start:
            raise ActivationError(
                f"unit {self.unit!r}: its piece {type(p.module).__name__} saved {p.end - p.start} tensors in the "
                f"unit's recompute, {len(collected)} when run again; recompute_nested needs pieces that save the "
                "same tensors when run again (use recompute for this unit)"
            )
        self.tensors[p.start : p.end] = collected
        p.args = p.kwargs = None
        p.state = SegState.RECOMPUTED

    def _piece_arg(self, x: Any) -> Any:
        """A piece's argument for its recompute: a derived one made again (the previous piece run
        without grad from its own arguments and RNG state: the same operators on the same bytes
        give the same tensor), the others as held."""
        if type(x) is not _FromPrev:
            return x
        prev = x.piece
        if prev.args is None:
            raise ActivationError(
                f"unit {self.unit!r}: a piece's argument was to be made again after the piece before it was "
                "recomputed (use recompute for this unit)"
            )
        args, kwargs = tree_map(self._piece_arg, (prev.args, prev.kwargs))
        with (
            _rng_from(self.device, prev.rng_cpu, prev.rng_dev),
            torch.no_grad(),
            contextlib.ExitStack() as stack,
        ):
            for c in self._autocasts():
                stack.enter_context(c)
            t = prev.module(*args, **kwargs)
        return t.requires_grad_(True) if x.requires_grad else t

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
        for p in self.pieces:
            if p.start <= index < p.end:
                p.taken += 1
                if p.taken >= p.end - p.start:
                    p.state = SegState.DONE
        return t

    @property
    def finished(self) -> bool:
        return self.state is SegState.RECOMPUTED and self.taken >= self.count

    def drop(self) -> None:
        self.tensors = None
        self.args = self.kwargs = None
        self.log = None
        self.output = None
        self.pieces = []
        self.state = SegState.DONE


@contextlib.contextmanager
def _piece_hooks(module, seg: Segment, inside: list, in_piece: list, collected: list, measure: Callable):
    """Phase A's hooks on one piece module (see the Note on nested): a call not inside another
    piece is logged as a _Piece; what it saves is measured when it ends, and dropped."""

    def pre(mod, args, kwargs):
        if inside:  # (a piece called inside another is part of it)
            inside.append(inside[-1])
            return None
        p = _Piece(mod, args, kwargs, seg, len(collected))
        seg.pieces.append(p)
        inside.append(p)
        return None

    def post(mod, args, kwargs, output):
        p = inside.pop()
        if inside:
            return None
        p.end = len(collected)
        leaves = [t for t in tree_leaves((p.args, p.kwargs)) if isinstance(t, torch.Tensor)]
        p.nbytes = measure(in_piece, exclude=leaves)
        in_piece.clear()
        if isinstance(output, torch.Tensor):  # (the next piece may take it: _Piece.derives)
            p.output, p.version = weakref.ref(output), output._version
        if p.end == p.start:  # saved nothing: never recomputed
            p.args = p.kwargs = None
            p.state = SegState.DONE
        elif p.kept:  # its saved tensors are collected already
            p.state = SegState.RECOMPUTED
        return None

    handles = (
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True),
    )
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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
