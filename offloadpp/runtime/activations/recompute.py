"""Recompute at unit granularity (non-reentrant checkpointing): a recompute unit's Segment.
Its partial operator log is in partial.py, its nested pieces in nested.py.

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

Note: derived checkpoints. A piece's tensor argument that is the output of the piece just before
it, where that piece ran no kept and no random operator (a norm: its Segment logged nothing), is
neither kept nor moved: the argument becomes a DerivedRef, and the recompute gets it by running
that piece's forward again, without grad, from its own checkpoint and RNG state (a recompute_pieces
piece logs no operator: it is derived whatever it runs, as nested.py's FromPrev is) (which its own recompute, later
in backward, still needs, so it is read without being unpacked), and only while it is unchanged
(its version counter: a root that changes it in place before the next piece keeps it as a
checkpoint). A transformer block's attention
and MLP take the two norms' outputs: a GPT-2 block moves 12 x width values a token, not 14. The
norm runs the same operators on the same bytes, so the argument is the forward's, bit for bit.

Note: release. A recomputed block's backward runs its pieces (the root's children that hold
parameters: norms, attention, MLP) last to first, and each piece's saved tensors are taken by
then. A whole recompute records each piece's call's range of saved-tensor indices while it runs
again, and the bytes of the storages only that call's tensors use; once every tensor of the range
was taken those bytes leave the manager's account (`take`, `freed`). A nested one holds its
boundaries and the largest saved bytes of the pieces not done (nested.py). Until the block's end
the account held all of it, and a block that fills the budget left the next blocks' checkpoints
to be fetched only after its backward, in series with the compute (random profile 1, Llama 7B
b128: 4.4 s of an 18.1 s backward). A tensor is taken as autograd runs the node that saved it, so
the bytes leave the account as that node starts: one node's tensors early, as the unpacked
SavedRefs' records are released at the next unit (backward.py, Note on release) one unit late.

Note: release within a piece. A swapped piece of a piecewise unit (partial_host, partial_ssd,
recompute_pieces_host/ssd; not a tail's) releases each storage its saved tensors are on once
backward is done with it: every tensor on it taken, and none left on it but the runtime's own,
as autograd drops a node's unpacked tensors once the node ran (`sweep`, at each unpack that
follows; a tensor handed to a node is held there until it ran, so the account never leaves a
storage a node is still reading, and a record's host buffer goes back to its pool only then).
Its recomputed bytes leave the account; a record's storage (a kept output fetched back) is
released by the manager (saves.py `_release_done`): where it has device memory of its own (on
the CPU device the record's storage is its pooled host buffer, never held by the record alone).
Held until the piece's end instead, a Llama attention's rotated q/k, v, output and statistics,
which its backward is done with a third of the way in, kept the next block's records from
coming back during it (random profile 8, Llama 7B b128: 1.137x the time per token of b64;
planner/activations.py, Note on the release within a piece).

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
import weakref
from typing import Any, Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map

from .nested import FromPrev, Piece, piece_hooks
from .partial import OpLog, Replayer
from .records import ActivationError
from .states import SegState, rng_from

# how many references a storage has (torch's own; private, so a torch without it releases no
# record early: a record then waits for the next unit, as before the Note on release within a piece)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


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
        # a piece's (manager.py, Note on pieces): the bytes its forward saved that are neither
        # records nor weights, what its recompute will hold again (backward.py, Note on the reserve)
        self.forward_bytes = 0
        self.seen: Optional[set] = set()  # (forward: the storages counted in forward_bytes)
        self.log: Optional[OpLog] = None  # partial: the forward's operators (see the Note on partial)
        self.first_record = 0  # the unit's records from this index on were made in or after this segment
        # nested: the modules whose calls are pieces, then each call's Piece (see the Note on nested)
        self.piece_modules: tuple[torch.nn.Module, ...] = ()
        self.pieces: list[Piece] = []
        # a whole recompute: the modules whose calls' saved bytes are released as each call's
        # backward ends, and per call (start, end, bytes, taken) (see the Note on release)
        self.release_modules: tuple[torch.nn.Module, ...] = ()
        self.releases: list[list[int]] = []
        self.boundary_bytes = 0  # nested: its boundaries' bytes, held until the segment is done
        # a swapped piece's (see the Note on release within a piece): its saved tensors' storages
        # released once the nodes that read them are done; per storage the indices not taken
        # yet and its recomputed bytes (0: a record's, the manager releases it)
        self.release_storages = False
        self._keys: list = []
        self._pending: dict = {}
        self._bytes: dict = {}
        self.freed = 0  # bytes released by `take` since the manager last took them off its account
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
        self.seen = None
        self.output = weakref.ref(output) if isinstance(output, torch.Tensor) else None
        self.output_version = output._version if isinstance(output, torch.Tensor) else -1

    def derives(self, x: Any) -> bool:
        """x is this closed piece's output, and the piece ran no kept nor random operator (a
        recompute_pieces piece: logs none, runs whole from its RNG state): the next piece's
        argument x can be derived (see the Note on derived checkpoints)."""
        return (
            self.state is SegState.SAVED
            and self.output is not None
            and self.output() is x
            and x._version == self.output_version  # (not changed in place since)
            and (self.log is None or not self.log.ops)
        )

    @property
    def derived(self) -> bool:
        """An argument of this piece is the previous piece's output, made again when needed."""
        return any(type(x) is DerivedRef for x in tree_leaves((self.args, self.kwargs)))

    def output_again(self, restore: Callable) -> torch.Tensor:
        """Its forward run again without grad, from its arguments (restore: an argument leaf ->
        the tensor it stands for): a derived argument of the next piece."""
        if self.state is not SegState.SAVED:
            raise ActivationError(
                f"unit {self.unit!r}: a piece's argument was derived after the piece before it was recomputed"
            )
        args, kwargs = tree_map(restore, (self.args, self.kwargs))
        # (from its RNG state: a recompute_pieces piece may draw from it, as it did in forward)
        with (
            rng_from(self.device, self.rng_cpu, self.rng_dev),
            torch.no_grad(),
            contextlib.ExitStack() as stack,
        ):
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
        inside: list[Piece] = []  # nested: the piece running (its saved tensors, measured, dropped)
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

        ranges: list[list[int]] = []  # a whole recompute's release modules' calls: [start, end]
        with contextlib.ExitStack() as hooks:
            for m in self.piece_modules:
                hooks.enter_context(piece_hooks(m, self, inside, in_piece, collected, measure))
            for m in self.release_modules if not self.piece_modules else ():
                hooks.enter_context(_call_ranges(m, ranges, collected))
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
        self.boundary_bytes = measure(boundaries)
        self.recomputed_bytes = self.boundary_bytes + max((p.nbytes for p in self.pieces), default=0)
        for start, end in ranges:  # (each call's own storages: released when its tensors are taken)
            inside_ = collected[start:end]
            outside = collected[:start] + collected[end:]
            if end > start:
                self.releases.append(
                    [start, end, measure(inside_, exclude=[t for t in outside if t is not None]), 0]
                )
        if self.release_storages and not self.pieces:
            self._track(collected, measure)
        for p in kept:
            p.args = p.kwargs = None
        self.args = self.kwargs = None  # the inputs are no longer needed
        self.log = None
        self.state = SegState.RECOMPUTED

    def _run_again(self, collect: Callable, restore: Optional[Callable]) -> None:
        def never(_: Any):
            raise ActivationError(f"unit {self.unit!r}: the recomputed graph was used for backward")

        with rng_from(self.device, self.rng_cpu, self.rng_dev):
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

    def piece_at(self, index: int) -> Optional[Piece]:
        """The nested piece whose saved tensors include `index` and are still to be recomputed."""
        for p in self.pieces:
            if p.start <= index < p.end:
                return p if p.state is SegState.SAVED else None
        return None

    def recompute_piece(self, p: Piece) -> None:
        """Phase B (see the Note on nested): the piece's forward again, from its arguments and RNG
        state, its saved tensors into its range."""
        collected: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> int:
            collected.append(t.detach())  # (detached: see recompute)
            return len(collected) - 1

        def never(_: Any):
            raise ActivationError(f"unit {self.unit!r}: the recomputed graph was used for backward")

        args, kwargs = tree_map(self._piece_arg, (p.args, p.kwargs))
        with rng_from(self.device, p.rng_cpu, p.rng_dev), contextlib.ExitStack() as stack:
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
        if type(x) is not FromPrev:
            return x
        prev = x.piece
        if prev.args is None:
            raise ActivationError(
                f"unit {self.unit!r}: a piece's argument was to be made again after the piece before it was "
                "recomputed (use recompute for this unit)"
            )
        args, kwargs = tree_map(self._piece_arg, (prev.args, prev.kwargs))
        with (
            rng_from(self.device, prev.rng_cpu, prev.rng_dev),
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
        if self._keys:
            self._pending[self._keys[index]] -= 1
        for p in self.pieces:
            if p.start <= index < p.end:
                p.taken += 1
                if p.taken >= p.end - p.start:
                    p.state = SegState.DONE
                    self._release(self.boundary_bytes + max((q.nbytes for q in self.pieces
                                                             if q.state is not SegState.DONE), default=0))  # fmt: skip
        for r in self.releases:
            if r[0] <= index < r[1]:
                r[3] += 1
                if r[3] >= r[1] - r[0]:
                    self._release(self.recomputed_bytes - r[2])
        return t

    def _track(self, collected: list, measure: Callable[..., int]) -> None:
        """Per storage of the recomputed saved tensors: the indices that read it, and its bytes
        where the segment counts them (recomputed; a record's the manager's)."""
        self._keys = [StorageWeakRef(t.untyped_storage()) if t is not None else None for t in collected]
        for t, key in zip(collected, self._keys):
            if key is None:
                continue
            if key not in self._pending:
                self._pending[key] = 0
                self._bytes[key] = measure([t])
            self._pending[key] += 1

    def sweep(self) -> list:
        """The storages backward is done with since the last sweep (see the Note on release within
        a piece): every tensor on them taken, and no tensor on them left but the runtime's own (a
        node holds what it unpacked until it ran): a recomputed storage gone, a record's held by
        its SavedStorage alone (its `storage`: one reference). Their recomputed bytes leave the
        account (`freed`); the records' storages among them are returned, for the manager to
        release."""
        records = []
        for key, n in list(self._pending.items()) if self._pending else ():
            if n:
                continue
            nbytes = self._bytes[key]
            if (
                (not key.expired())
                if nbytes
                else (_storage_use_count is None or _storage_use_count(key.cdata) > 1)
            ):
                continue  # (still read)
            del self._pending[key], self._bytes[key]
            if nbytes:
                self._release(self.recomputed_bytes - nbytes)
            else:
                records.append(key)
        return records

    def _release(self, now: int) -> None:
        """The segment holds `now` bytes from here on, where that is less (see the Note on release)."""
        if now < self.recomputed_bytes:
            self.freed += self.recomputed_bytes - now
            self.recomputed_bytes = now

    @property
    def finished(self) -> bool:
        return self.state is SegState.RECOMPUTED and self.taken >= self.count

    def drop(self) -> None:
        self.tensors = None
        self._keys, self._pending, self._bytes = [], {}, {}
        self.releases = []
        self.args = self.kwargs = None
        self.log = None
        self.output = None
        self.pieces = []
        self.state = SegState.DONE


@contextlib.contextmanager
def _call_ranges(module: torch.nn.Module, ranges: list, collected: list):
    """Records each call of `module` not inside another of its calls as [start, end] of the
    saved-tensor indices it fills (see the Note on release)."""
    depth, call = [0], [[0, -1]]

    def pre(mod, args):
        if not depth[0]:
            call[0] = [len(collected), -1]
            ranges.append(call[0])
        depth[0] += 1

    def post(mod, args, output):
        depth[0] -= 1
        if not depth[0]:
            call[0][1] = len(collected)

    handles = (module.register_forward_pre_hook(pre), module.register_forward_hook(post))
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
