"""Backward's side of the ActivationManager (`ManagerBackward`, a mixin of manager.py's class):
entering each unit's backward, fetching the activations of the next units ahead of need within
the budget, in the order backward uses them, and releasing what backward consumed.

Note: the reserve. A piecewise unit (partial*, recompute_pieces*: manager.py, Note on pieces)
holds one piece's records and recomputed tensors at a time, so the next units' records can come
back while its later pieces are still to recompute: within the budget less what those pieces
will hold at their recomputes beyond what it holds now (`_pieces_reserve`), as the replay lets
them (planner/simulate_act.py: a partial unit counts the most its pieces left hold, the next
unit's first piece is fetched beside that). Fetched only once its last piece had recomputed,
they came back during that piece's backward alone: the replay's overlap was not the runtime's
(Llama 7B b32 on random profile 29: 18.24 s replayed, 19.60 s with the fetches held back; docs/
performance.md "The next block's records beside a block's pieces").

Note: release. A SavedStorage is released once every SavedRef to it was unpacked, at the next
unit boundary of backward (not at once: a custom Function may read ctx.saved_tensors twice within
one node), and whatever is left at end_backward. A second backward over the same graph
(retain_graph) is therefore refused with an error naming the unit.
"""

from __future__ import annotations

import torch

from offloadpp.planner.activations import TAIL_PIECES

from .recompute import Segment
from .records import RecState
from .states import SegState
from .units import ActPhase, UnitActivations


class ManagerBackward:
    """The manager's backward (manager.py's ActivationManager sets what it reads: `units`,
    `outside`, `swapper`, `config`, `budget`, `_order`, `_index`, `_consumed`, `_bw_unit`,
    `_in_backward`)."""

    def _drop_segment(self, seg: Segment) -> None:
        if seg.state is SegState.SAVED or seg.state is SegState.RECORDING:
            self.swapper.add_device(-seg.input_bytes)
        elif seg.state is SegState.RECOMPUTED:
            self.swapper.add_device(-seg.recomputed_bytes)
        seg.drop()

    def drain(self) -> None:
        """Waits until every swap-out started so far has left the device (and its SSD write is
        done). Backward does not need this; tests and benchmarks do."""
        sw = self.swapper
        sw.make_room(sw.device_bytes + 1, 0)  # waits for every job
        for rec in list(sw.writing):
            sw._finish_write(rec, block=True)
        sw.pump()

    def start_backward(self, stage: bool = True) -> None:
        """Optional: starts fetching the last units' activations before backward runs. stage:
        whether SSD reads run ahead of the device room (swap.py, Note on staging): not in a
        vertical window's backward (the engine's), where a unit's records are all G micro-batches'
        (G times the host memory read ahead), and where the replay does not stage them either: in
        the paper's clipped 175B G = 4 window staging made the window's k = 0 plan win, whose
        per-micro-batch loop is slower, and "auto" ran the window horizontally (962 s against
        447.6 s)."""
        self._stage = stage
        self._in_backward = True
        self._index.clear()
        self.swapper.pump()
        self._prefetch()

    def _enter_backward(self, unit: UnitActivations) -> None:
        if not self._in_backward:
            self.start_backward()
        if unit.phase is not ActPhase.FORWARD or unit is self.outside:
            return
        self.swapper.pump()
        self._release_consumed()
        if self._bw_unit is not None:
            self._bw_unit.phase = ActPhase.DONE
        unit.phase = ActPhase.BACKWARD
        self._bw_unit = unit
        self._stage_next(unit)
        self._prefetch()

    def _release_consumed(self) -> None:
        for rec in self._consumed:
            self.swapper.release(rec)
        self._consumed.clear()

    def _stage_next(self, cur: UnitActivations) -> None:
        """The SSD records of the units a prefetch tries next (the next prefetch_units in backward
        order, up to the first that will recompute) start their read into host memory now,
        whatever the device room (swap.py, Note on staging; the replay's _stage_after)."""
        for j in range(1, self.config.prefetch_units + 1 if self._stage else 1):
            if cur.position - j < 0:
                break
            u = self._order[cur.position - j]
            for rec in u.records[: u.fetch_cursor]:
                self.swapper.stage(rec)
            if any(seg.state is SegState.SAVED for seg in u.segments):
                break

    def _prefetch(self) -> None:
        """Fetches the unit backward runs (whatever the budget), then the next prefetch_units
        units in backward order while they fit the budget, each in its reverse pack order."""
        cur = self._bw_unit
        start = cur.position if cur is not None else len(self._order)
        reserve = 0
        if cur is not None:
            todo = [seg for seg in cur.segments if seg.state is SegState.SAVED]
            # pieces: the records of the piece to recompute next (and of the one before it, within
            # the budget), not the whole unit's (see the Note on pieces); a source evicted once the
            # argument derived from it was made (saves.py `_evict_source`) comes back first, within
            # the budget less what the pieces still to recompute will hold (the one recomputing
            # now among them), or at its own piece's recompute
            self._evicted = [r for r in self._evicted if r.state is RecState.HOST]
            own = self._pieces_reserve(cur) if self._evicted else 0
            if not self._evicted:
                self._fetch_unit(cur, force=True, floor=self._fetch_floor(cur))
            elif not self._fetch_unit(cur, force=False, floor=self._fetch_floor(cur), reserve=own):
                return
            if cur.policy.piecewise and len(todo) > 1:
                self._fetch_unit(cur, force=False, floor=self._fetch_floor(cur, 2), reserve=own)
            if todo and not cur.policy.piecewise:
                # its recompute is still to come and will hold all it saves: the units after it
                # are fetched once that is counted (_unpack_recomputed), within what is left
                return
            if todo:  # (pieces: beside the pieces still to recompute, see the Note on the reserve)
                reserve = self._pieces_reserve(cur)
        for j in range(1, self.config.prefetch_units + 1):
            if start - j < 0 or not self._fetch_unit(
                self._order[start - j],
                force=False,
                floor=self._fetch_floor(self._order[start - j]),
                reserve=reserve,
            ):
                break
            if any(seg.state is SegState.SAVED for seg in self._order[start - j].segments):
                break  # it will hold all it recomputes: nothing beyond it now (its checkpoint is fetched)

    @staticmethod
    def _fetch_floor(u: UnitActivations, pieces: int = 1) -> int:
        """The first of u's records its next `pieces` recomputes need: a piecewise unit's pieces are
        fetched piece by piece (see the Note on pieces), any other unit's records all at once."""
        todo = [seg for seg in u.segments if seg.state is SegState.SAVED]
        if u.policy.tail:  # (its last pieces' records are on the device: the next swapped ones)
            pieces += max(0, len(todo) - max(0, len(u.segments) - TAIL_PIECES))
        if not u.policy.piecewise or len(todo) <= pieces:
            return 0
        k = len(todo) - pieces
        # a piece whose argument is made again from the previous piece's checkpoint (a block's
        # MLP, from the second norm's; a tail's attention, from the first norm's) cannot start
        # its recompute before that checkpoint is back (recompute.py, Note on derived
        # checkpoints): fetched with the piece's own records (a recompute_pieces piece has none),
        # not left to the budget's room, as the replay counts it (simulate_act.py `_fetch`)
        while k > 0 and todo[k].derived:
            k -= 1
        return todo[k].first_record

    @staticmethod
    def _pieces_reserve(u: UnitActivations) -> int:
        """What a piecewise unit's pieces still to recompute will hold at their recomputes beyond
        what it holds now (see the Note on the reserve): at piece k's, what the pieces before it
        hold then (their records on the device, kept ones all along, and their arguments), its
        own records and the previous piece's (fetched one piece ahead), and what its forward
        saved besides (Segment.forward_bytes); the pieces after it released theirs by then."""
        bounds = [seg.first_record for seg in u.segments] + [len(u.records)]
        own = [[r for r in u.records[a:b] if r.unit is u] for a, b in zip(bounds, bounds[1:])]
        now = sum(r.held_device for recs in own for r in recs)
        for seg in u.segments:  # (as _drop_segment counts them)
            if seg.state is SegState.SAVED:
                now += seg.input_bytes
            elif seg.state is SegState.RECOMPUTED:
                now += seg.recomputed_bytes
        top = before = 0  # (before: what the pieces before k hold at its recompute, but k - 1's records)
        for k, seg in enumerate(u.segments):
            # (a derived argument's source leaves the device once the argument is made: saves.py
            # `_evict_source`; one on the device since its forward, a tail's, stays)
            fetched = sum(
                r.nbytes
                for j in (k - 1, k)
                if j >= 0
                for r in own[j]
                if r.state is not RecState.RELEASED
                and not (j < k and seg.derived and r.source and r.state is not RecState.DEVICE)
            )
            if seg.state is SegState.SAVED:
                top = max(top, before + fetched + seg.forward_bytes)  # (its arguments among them)
            if k:
                before += sum(r.held_device for r in own[k - 1])
            before += seg.input_bytes if seg.state is SegState.SAVED else 0
        return max(0, top - now)

    def _fetch_unit(self, u: UnitActivations, force: bool, floor: int = 0, reserve: int = 0) -> bool:
        """Fetches u's records from the last not asked for down to index `floor`, in reverse
        pack order; False when the budget (less `reserve`) stopped it (never with force)."""
        sw = self.swapper
        while u.fetch_cursor > floor:
            rec = u.records[u.fetch_cursor - 1]
            s = rec.state
            if s in (RecState.HOST, RecState.WRITING, RecState.ON_SSD, RecState.STAGING) or (
                s is RecState.MOVING_OUT and not rec.want_in
            ):
                extra = 0 if s is RecState.MOVING_OUT else rec.nbytes
                if not force and self.budget is not None and sw.device_bytes + extra + reserve > self.budget:
                    return False
                sw.fetch(rec)
            u.fetch_cursor -= 1
        return True

    def end_backward(self) -> None:
        """Releases everything of this step; the next forward starts clean."""
        self._consumed.clear()
        self._evicted.clear()
        for u in self.units + [self.outside]:
            for rec in u.records:
                self.swapper.release(rec)
            for seg in u.segments:
                self._drop_segment(seg)
            u.reset()
        self.swapper.sweep_cache()
        self._order.clear()
        self._index.clear()
        self._bw_unit = None
        self._in_backward = False

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.start_backward()
        try:
            loss.backward(**kwargs)
        finally:
            self.end_backward()
