"""The saved-tensor hooks' side of the ActivationManager (`ManagerSaves`, a mixin of manager.py's
class): `pack` turns each tensor autograd saves into a record of the unit running (kept or
swapped as its policy says: records.py, swap.py) or a recompute segment's reference; `unpack`
brings it back in backward, running a recompute (recompute.py, nested.py) where the reference
is one. A recomputing unit's arguments become checkpoints here (`_checkpoint`) and come back
through `_restore`. The manager's Notes (manager.py) say when each applies."""

from __future__ import annotations

import functools
import time
from typing import Sequence

import torch
from torch.autograd.profiler import record_function
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from .policy import ActPolicy
from .recompute import CheckpointRef, DerivedRef, RecomputeRef, Segment
from .records import (
    ActivationError,
    ParamIndex,
    ParamView,
    RecState,
    SavedRef,
    SavedStorage,
    storage_key,
    swappable,
)
from .states import SegState
from .units import UnitActivations


class ManagerSaves:
    def _checkpoint(self, unit: UnitActivations, x):
        """A recomputing unit's argument: a tensor activation becomes a swapped record's
        CheckpointRef (weights, buffers and small tensors stay as they are)."""
        if (
            not isinstance(x, torch.Tensor)
            or not swappable(x, self.device)
            or unit.params.match(x) is not None
        ):
            return x
        if self._all.match(x) is not None:
            return x
        return CheckpointRef(self._record(unit, x, unit.policy.checkpoint), x.requires_grad)

    def _restore(self, ckpt: list, x):
        """The argument a CheckpointRef stands for, or a partial unit's kept output a SavedRef
        stands for, back on the device (waited for if in flight)."""
        if type(x) is SavedRef:
            t = self._unpack_saved(x, enter=False)
            ckpt.append(t)
            return t
        if type(x) is DerivedRef:  # (not in ckpt: no record counts it, the recompute's bytes do)
            t = x.seg.output_again(self._peek)
            self._evict_source(x.seg, t)
            return t.requires_grad_(x.requires_grad) if x.requires_grad else t
        if type(x) is not CheckpointRef:
            return x
        # (not entering the backward of the unit that saved the storage first: arguments such as
        # Llama's rotary tables are shared by every block, and the first saver's backward is
        # still to come; entering it would release what this unit just unpacked)
        t = self._unpack_saved(x.ref, enter=False)
        ckpt.append(t)
        return t.detach().requires_grad_(x.requires_grad) if x.requires_grad else t

    def _mark_sources(self, unit: UnitActivations, prev: Segment) -> None:
        """Forward: the next piece's argument is derived from `prev`'s output, so prev's swapped
        checkpoints are its sources (SavedStorage.source): see `_evict_source`."""
        for x in tree_leaves((prev.args, prev.kwargs)):
            if type(x) is CheckpointRef and x.ref.rec.unit is unit and x.ref.rec.policy is not ActPolicy.KEEP:
                x.ref.rec.source = True

    def _evict_source(self, seg: Segment, made: torch.Tensor) -> None:
        """Note: the derived argument's source. A swapped piece's argument made again from the
        previous piece's checkpoint (recompute.py, Note on derived checkpoints) needs that
        checkpoint back first; the previous piece's own recompute needs it again later (a norm's
        backward reads its input), but nothing between does. So, once the argument is made, the
        checkpoint leaves the device again without a copy (its host buffer was kept since the
        copy up: Swapper.evict), and comes back within the budget (backward.py `_prefetch`), or
        at that recompute: the piece's recompute holds what it makes and not the checkpoint
        beside it (a GPT-3 13B block's MLP at b64: 5.625 GiB, not 6.25), for one more copy up
        (planner/activations.py, Note on the derived argument's source)."""
        for x in tree_leaves((seg.args, seg.kwargs)):
            rec = x.ref.rec if type(x) is CheckpointRef else None
            if (rec is None or not rec.source or rec.storage is None
                    or made.untyped_storage().data_ptr() == rec.storage.data_ptr()):  # fmt: skip
                continue  # (an argument the output is a view of stays)
            if self.swapper.evict(rec):
                u = rec.unit
                at = next(i for i, r in enumerate(u.records) if r is rec)
                u.fetch_cursor = max(u.fetch_cursor, at + 1)  # (asked for again: _fetch_unit)
                self._evicted.append(rec)

    def _peek(self, x):
        """An argument of a piece run again to derive the next piece's (see the Note on derived
        checkpoints in recompute.py): a swapped checkpoint is brought back and read, not
        unpacked (the piece's own recompute unpacks it later in backward)."""
        if type(x) is DerivedRef:
            return x.seg.output_again(self._peek)
        if type(x) is not CheckpointRef:
            return x
        rec = x.ref.rec
        if rec.state is RecState.RELEASED:
            raise ActivationError(f"unit {rec.owner!r}: a checkpoint was read after backward released it")
        if rec.state is not RecState.READY and rec.state is not RecState.DEVICE:
            self.swapper.wait_ready(rec)
        return x.ref.view()

    # ---- pack / unpack -------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        unit, seg = self._stack[-1] if self._stack else (self.outside, None)
        policy = unit.policy
        if type(seg) is Segment:  # everything, weights too: the recompute saves them again, in this order
            if seg.log is not None and self._recorders:  # (partial.py, Note on outputs backward never reads)
                self._recorders[-1].saved(t)
            if unit.policy.piecewise:
                seg.forward_bytes += self._piece_saved_bytes(unit, seg, t)
            return seg.pack(t)
        if seg is not None:  # the fused head's saves (_head_scope)
            policy = seg
        if self._ext is not None:
            h = self._ext[0](t)
            if h is not t:
                self.param_refs += 1
                return h
        m = (unit.params if unit is not self.outside else self._all).match(t)
        if m is not None:
            self.param_refs += 1
            return m
        if not swappable(t, self.device):
            return t
        return self._record(unit, t, policy)

    def _piece_saved_bytes(self, unit: UnitActivations, seg: Segment, t: torch.Tensor) -> int:
        """The bytes t adds to what a piece's recompute will hold (Segment.forward_bytes): a device
        activation's storage, once, unless it is a record (the piece's checkpoint, a kept output:
        counted as records, and left out of the recompute's measure as they are, `_measure`'s
        exclude) or a weight."""
        if seg.seen is None or not swappable(t, self.device) or unit.params.match(t) is not None:
            return 0
        st, weak = storage_key(t)
        rec = self._index.get(weak)
        if (
            rec is not None and rec.version == t._version and rec.state is not RecState.RELEASED
        ) or weak in seg.seen:
            return 0
        seg.seen.add(weak)
        return st.nbytes()

    def _record(self, unit: UnitActivations, t: torch.Tensor, policy: ActPolicy) -> SavedRef:
        """t saved into a record of `unit` (a new one, or the one holding its storage already):
        swapped as `policy` says where it swaps and the storage is large enough, else kept."""
        sw = self.swapper
        sw.pump()
        st, weak = storage_key(t)
        rec = self._index.get(weak)
        if rec is None or rec.version != t._version or rec.state is RecState.RELEASED:
            policy = policy if policy.swaps and st.nbytes() >= self.config.min_swap_bytes else ActPolicy.KEEP
            rec = SavedStorage(unit, policy, st, weak, t._version)
            sw.make_room(rec.nbytes, self.budget)
            sw.hold(rec)
            if policy.swaps and unit.policy.tail and unit.held_back:
                unit.held_back[-1].append(rec)  # (swapped once TAIL_PIECES more pieces opened)
            elif policy.swaps:
                sw.swap_out(rec)
            self._index[weak] = rec
            unit.saved_bytes += rec.nbytes
            self.saved_bytes += rec.nbytes
            unit.records.append(rec)
        else:
            self.dedup_hits += 1
            if all(r is not rec for r in unit.records):  # a storage saved by several units is in each list
                unit.records.append(rec)
        unit.fetch_cursor = len(unit.records)
        rec.refs += 1
        return SavedRef(rec, t)

    def unpack(self, h):
        tp = type(h)
        if tp is SavedRef:
            return self._unpack_saved(h)
        if tp is RecomputeRef:
            return self._unpack_recomputed(h)
        if tp is ParamView:
            return h.unpack()
        if self._ext is not None and tp is self._ext[2]:
            return self._ext[1](h)
        return h

    def _unpack_saved(self, h: SavedRef, enter: bool = True) -> torch.Tensor:
        rec = h.rec
        if rec.state is RecState.RELEASED:
            raise ActivationError(
                f"unit {rec.owner!r}: a saved activation was unpacked after backward released it "
                "(a second backward through the same graph, retain_graph=True, is not supported)"
            )
        if enter:
            self._enter_backward(rec.unit)
        if rec.state is not RecState.READY and rec.state is not RecState.DEVICE:
            if not rec.want_in and rec.state in (
                RecState.HOST,
                RecState.WRITING,
                RecState.ON_SSD,
                RecState.MOVING_OUT,
            ):
                self.fetch_misses += 1
            self.swapper.wait_ready(rec)
        t = h.view()
        rec.unpacked += 1
        if rec.consumed:
            self._consumed.append(rec)
        self.swapper.pump()
        self._release_done(self._bw_unit)
        self._prefetch()
        return t

    def _unpack_recomputed(self, h: RecomputeRef) -> torch.Tensor:
        seg = h.seg
        unit = seg.owner
        self._enter_backward(unit)
        if seg.state is SegState.SAVED:
            if (
                unit.policy.piecewise and len(unit.segments) > 1
            ):  # a piece: the later pieces' records are done with
                self._release_consumed()
            logged = seg.log is not None  # (a partial piece's: the recompute drops its log)
            t0 = time.perf_counter()
            with record_function("offloadpp::act_recompute"):
                unit.params.rebuild(unit.roots)  # the runtime may have rebound the weights
                ckpt: list[torch.Tensor] = []  # a swapped checkpoint, back: its record counts it
                seg.recompute(lambda ts, exclude=(): self._measure(ts, unit.params, exclude=ckpt + list(exclude)),
                              restore=functools.partial(self._restore, ckpt))  # fmt: skip
            self.recompute_s += time.perf_counter() - t0
            self.swapper.add_device(seg.recomputed_bytes - seg.input_bytes)
            if logged and unit.policy.checkpoint is not None and not unit.policy.tail:
                self._release_replayed(unit, seg)
            self._prefetch()  # (held back until the recompute was counted)
        elif seg.state is SegState.DONE:
            raise ActivationError(
                f"unit {seg.unit!r}: a recomputed activation was unpacked after backward released it"
            )
        piece = seg.piece_at(h.index) if seg.pieces else None
        if piece is not None:  # nested: this piece's saved tensors (counted since the recompute)
            t0 = time.perf_counter()
            with record_function("offloadpp::act_recompute_piece"):
                unit.params.rebuild(unit.roots)
                seg.recompute_piece(piece)
            self.recompute_s += time.perf_counter() - t0
        t = seg.take(h)
        if self._release_done(unit):
            self._prefetch()
        freed, seg.freed = seg.freed, 0
        if freed:  # a piece's saved tensors were all taken: its bytes go (recompute.py, Note on release)
            self.swapper.add_device(-freed)
        if seg.finished:
            self._drop_segment(seg)
        elif freed:  # (the next units may come back in the room it left)
            self._prefetch()
        return t

    def _release_done(self, unit) -> bool:
        """A swapped piece's storages backward is done with leave the account (recompute.py, Note
        on release within a piece): its recomputed bytes, and the records fetched back on them;
        True where bytes left."""
        if unit is None:
            return False
        left = 0
        for i, seg in enumerate(unit.segments):
            if not seg.release_storages or seg.state is not SegState.RECOMPUTED:
                continue
            done = set(seg.sweep())
            if seg.freed:
                left += seg.freed
                self.swapper.add_device(-seg.freed)
                seg.freed = 0
            if not done:
                continue
            # (the piece's own records: made in its forward, read by no piece backward runs later)
            end = unit.segments[i + 1].first_record if i + 1 < len(unit.segments) else len(unit.records)
            for rec in unit.records[seg.first_record : end]:
                if (rec.unit is unit and rec.state is RecState.READY and rec.consumed
                        and StorageWeakRef(rec.storage) in done):  # fmt: skip
                    self.swapper.release(rec)
                    left += rec.nbytes
        return left > 0

    def _release_replayed(self, unit: UnitActivations, seg: Segment) -> None:
        """A swapped partial piece's kept outputs that its recompute read and its backward does not
        (autograd saved them nowhere: o_proj's and down's outputs, a Llama's q and k before the
        rotation) are released once the recompute ran, not at the next piece's (manager.py, Note
        on pieces): the piece's backward holds what it saved, not the planner's `partial_extra`
        as well (planner/activations.py piece_peaks, Note on the release). Only records fetched
        back (their storage is the record's own) whose every reference was read and whose
        storage no recomputed tensor holds."""
        i = next(k for k, s in enumerate(unit.segments) if s is seg)
        end = unit.segments[i + 1].first_record if i + 1 < len(unit.segments) else len(unit.records)
        held = {storage_key(t)[1] for t in seg.tensors or () if t is not None}
        for rec in unit.records[seg.first_record : end]:
            if (
                rec.unit is unit
                and rec.state is RecState.READY
                and rec.consumed
                and StorageWeakRef(rec.storage) not in held
            ):
                self.swapper.release(rec)

    def _measure(self, tensors, params: ParamIndex, exclude: Sequence[torch.Tensor] = ()) -> int:
        """Bytes of the distinct storages among `tensors` that are activations on the device
        (those of `exclude` left out: counted elsewhere)."""
        seen = {storage_key(t)[1] for t in exclude}
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and swappable(t, self.device) and params.match(t) is None:
                _, weak = storage_key(t)
                if weak not in seen:
                    seen.add(weak)
                    total += t.untyped_storage().nbytes()
        return total
