"""A piecewise unit's backward in the replay, part by part (simulate_act.py's ActReplay takes it
as a base): its pieces last to first, each split where it releases bytes before its end, and
what the unit holds at each part (runtime/activations/recompute.py, Notes on release), so the
room freed lets the next units' activations come back as the runtime's does.

Pure (no torch). What it reads of the ActReplay: `sim`, `units`, `counted`, `device_bytes`,
`held_back`, `reading`, `policy`, `_given`, its sizes (`forward_parts`, `_sub_parts`, `_piece_shares`,
`_piece_bytes`, `_window_chunks`), Releasing's `_releasing`, `_release_parts`, `_left_after`,
Fetching's `_copy_up_read`, and `_prefetch_after`.
"""

from __future__ import annotations

from .activations import LAST, RELEASES_REPLAYED, piece_peaks
from .simulate_memo import per_unit


class PieceByPiece:
    """ActReplay's backward of a piecewise unit, part by part (the module docstring)."""

    def backward_parts(self, unit: str) -> tuple[float, ...]:
        """backward_parts_of, but a releasing unit's pieces only where the budget held a
        prefetch back at its backward's start (_prefetch_after): elsewhere what they release
        brings nothing back sooner, and each part costs the replay a visit's work."""
        if self.held_back and self._releasing(unit):
            return self._release_parts(unit)
        if self.sim.cuda:  # (pieces that release bytes before they end: split there, see _marks)
            shares = self._marks(unit)[0]
            if shares:
                return shares
        return self.backward_parts_of(unit)

    @per_unit
    def backward_parts_of(self, unit: str) -> tuple[float, ...]:
        """The unit's backward as shares of its compute: one, or a partial unit's pieces last to
        first (their shares as in forward_parts), between which `next_piece` releases what the
        pieces done held."""
        if self._window_chunks(unit) or self._sub_parts(unit):  # (a window's: the micro-batches together)
            pieces = self._piece_bytes(unit)
            return tuple(reversed(self._work_shares(unit))) if sum(pieces) > 0 else (1.0,)
        return tuple(share for share, _ in reversed(self.forward_parts(unit)))

    @per_unit
    def _work_shares(self, unit: str) -> tuple[float, ...]:
        """The pieces' shares of the unit's backward work (its backward and its recompute), forward
        order: their shares of its forward (_piece_shares), but where a partial_last unit's recompute
        runs in its pieces but the last (planner/activations.py, Note on the last piece), whose
        backward alone is then counted against the others' backward and forward again. (From the
        shares alone, backward twice a piece's forward as the profiles count it, so that they are
        sizes the replays share: simulate_memo.per_unit.)"""
        shares = self._piece_shares(unit)
        if self._given.get(unit) not in LAST or len(shares) < 2 or not 0 < shares[-1] < 1:
            return shares
        work = [3 * s for s in shares[:-1]] + [2 * shares[-1]]
        return tuple(w / sum(work) for w in work)

    def next_piece(self, unit: str, part: int) -> None:
        """Part `part` of a partial unit's backward (backward_parts) starts: its pieces before it
        are done (the last ones in forward order), or its piece released what its backward is
        done with (_marks): it now holds the most any piece left holds (backward_bytes piece by
        piece), and the room freed lets the next units' activations come back, as the runtime
        releases a piece's records at the next piece's recompute, and a swapped piece's storages
        once the nodes that read them are done."""
        self._hold(unit, part)
        if self.reading:
            self._copy_up_read()
        self._prefetch_after(unit)

    def _hold(self, unit: str, part: int) -> None:
        """A partial unit at part `part` of its backward, its pieces before it done and the
        current one's recompute run, holds the most any piece left holds (piece_peaks), the one
        now running without its kept outputs autograd did not save where they were fetched back
        (released once its recompute ran: runtime/activations/saves.py `_release_replayed`;
        planner/activations.py, Note on the release) and without what it released since (_marks)."""
        if self._releasing(unit):  # (its parts are its pieces)
            now = min(self.counted[unit], self._left_after(unit, part))
        else:
            nows = self._left_peaks(unit)
            marks = self._marks(unit)[1] if self.sim.cuda else ()
            now = nows.get((part, bool(marks)))
            if now is None:
                u = self.units[unit]
                done, freed = marks[part] if marks else (part, 0)
                left = piece_peaks(u, self.policy(unit))[: len(u.pieces) - done]
                if left and self.policy(unit) in RELEASES_REPLAYED:
                    left[-1] -= u.pieces[len(left) - 1][3] + freed
                now = nows[(part, bool(marks))] = max(left) if left else 0
        self.device_bytes -= self.counted[unit] - now
        self.counted[unit] = now

    @per_unit
    def _left_peaks(self, unit: str) -> dict[int, int]:
        """next_piece's bytes held at each part of the unit's backward, by (part, split at its
        releases: _marks): filled as asked (a function of the unit and its policy alone, as the
        other sizes here)."""
        return {}

    @per_unit
    def _marks(self, unit: str) -> tuple[tuple[float, ...], tuple[tuple[int, int], ...]]:
        """A swapped piecewise unit whose pieces release bytes before their backward ends
        (ActUnit.piece_freed; planner/activations.py, Note on the release within a piece): its
        backward's parts, pieces last to first and each split where it releases, as (their shares
        of its compute, per part (the pieces done before it, the bytes its piece released by its
        start)); ((), ()) for any other unit (and a vertical window's, a tail's: their parts are
        their pieces). On CUDA only (backward_parts): on the CPU device a fetched record is a host
        buffer, which the runtime releases only at the next unit."""
        u = self.units.get(unit)
        if (
            u is None
            or not u.piece_freed
            or self.policy(unit) not in RELEASES_REPLAYED
            or not self._sub_parts(unit)
        ):
            return (), ()
        shares: list[float] = []
        marks: list[tuple[int, int]] = []
        for i, share in enumerate(reversed(self._work_shares(unit))):
            freed, at0 = 0, 0.0
            for at, nbytes in u.piece_freed[len(u.pieces) - 1 - i]:
                if at >= 1.0:
                    break  # (at its end: the next piece's start releases it)
                if at > at0:
                    shares.append(share * (at - at0))
                    marks.append((i, freed))
                    at0 = at
                freed += nbytes
            shares.append(share * (1.0 - at0))
            marks.append((i, freed))
        return tuple(shares), tuple(marks)
