"""The replay's first fetch of a swapped piecewise unit as the runtime takes it (simulate_act.py's
ActReplay takes it as a base): record by record, last first, while each fits the budget, the
rest as room comes (runtime/activations/backward.py `_fetch_unit`, called at every unpack); and a
record whose SSD read was fetched copied up once that read ends (swap.py `_advance_in`, at the
pump), not when backward reaches its unit.

Note: why it matters. At b128 a Llama 7B block's first fetch (its MLP's three records, 6.4 GiB,
and the second norm's checkpoint, 1 GiB) did not fit beside the block before's attention piece
(6.0 GiB of a 10.6 GiB room), but two of the MLP's records did. Counted piece by piece, none of it
came back until that block's last piece (a norm, 7% of its backward), and every block waited on
the link for it; the partial_ssd blocks' reads, fetched then, crossed the link only at their
backward. Random profile 4's Llama b128: 0.44 s a block, 1.056x the time per token of b64; now
0.03 s, 1.005x (docs/performance.md, issue 36 session 9). At b64 all of it fits beside the
attention piece, as before.

Pure (no torch). What it reads of the ActReplay: `sim`, `budget`, `device_bytes` and `_add`,
`ready`, `reading`, `first_left`, `_memos`, and its sizes (`_window_chunks`, `_swapped_pieces`,
`_swapped_parts`, `units`, `_tail`, `_tail_credit`).
"""

from __future__ import annotations

import functools

from .desim import done_by, when
from .simulate_memo import per_unit


class Fetching:
    """ActReplay's first fetch, record by record (the module docstring)."""

    @functools.partial(per_unit, shared=False)
    def _first_records(self, unit: str) -> tuple[int, ...]:
        """What backward's first fetch of a piecewise unit brings, in the order the runtime's
        `_fetch_unit` takes it (last first): its last piece's records and those of the pieces its
        arguments are made from (a partial block's MLP waits for the second norm's checkpoint as
        a recompute_pieces block's does, runtime backward.py `_fetch_floor`); its other pieces
        come back during its backward. Record by record where the profile knows a piece's
        records (ActReplay._swapped_parts), piece by piece otherwise (a vertical window's
        micro-batches, its last micro-batch's first). () for a unit fetched whole. (Remembered
        per replay: a function of the unit and its policy.)"""
        chunks = self._window_chunks(unit) or self._swapped_pieces(unit)
        if not chunks:
            return ()
        k = len(chunks) - 1
        u = self.units.get(unit)
        if u is not None and u.pieces:
            while k > 0 and u.pieces[k % len(u.pieces)][1] == 0:  # (a window's: per micro-batch)
                k -= 1
        parts = () if self._window_chunks(unit) else self._swapped_parts(unit)
        if len(parts) == len(chunks):  # (a piece's records sum to its bytes: ActUnit.piece_kept)
            return tuple(r for piece in reversed(parts[k:]) for r in reversed(piece))
        return tuple(reversed(chunks[k:]))

    def _fetch_left(self, unit: str, force: bool) -> bool:
        """The rest of a partial unit's first fetch, where the budget had room for its last
        records only (ActReplay._fetch): record by record as room comes, all of it at its
        backward's start. Its backward waits for all; a copy up at its backward (h2d: read from
        SSD, not yet copied up) moves all."""
        left = self.first_left[unit]
        take = left
        if not force and self.budget is not None and self.device_bytes + left > self.budget:
            recs = self._first_records(unit)
            take = last_first(recs, sum(recs) - left, self.budget - self.device_bytes)
            if take <= 0:
                return False
        if take < left:
            self.first_left[unit] = left - take
        else:
            del self.first_left[unit]
        sim = self.sim
        done, h2d, n = self.ready[unit]
        if not h2d and sim.cuda:  # (the link is in order: this copy ends after the first part's)
            done = sim.h2d.submit(sim.t, take, False)
            if self._tail(unit):
                done = max(sim.t, done - self._tail_credit(unit))
        self._add(take)
        self.ready[unit] = (done, h2d, n + take)
        return take == left

    def _copy_up_read(self) -> None:
        """The fetched units whose SSD read has ended start their copy up at the read's end (the
        link is in order: nothing was queued there since, or the copy goes behind it), as the
        runtime's pump starts it (swap.py `_advance_in`: READING, then `_into_device`), not at
        their backward. Checked where a prefetch is tried (ActReplay.before_backward,
        next_piece)."""
        sim = self.sim
        for name in [n for n in self.reading if done_by((self.ready[n][0],), sim.t)]:
            del self.reading[name]
            got, _, n = self.ready[name]
            done = sim.h2d.submit(when(got), n, write=False)
            if self._tail(name):  # (see ActReplay._tail_credit)
                done = max(sim.t, done - self._tail_credit(name))
            self.ready[name] = (done, False, n)


def last_first(recs: tuple[int, ...], fetched: int, room: int) -> int:
    """Of `recs` (a first fetch's records, in fetch order), the bytes after the first `fetched`
    that come back into `room`, one record at a time while the next fits."""
    got = seen = 0
    for r in recs:
        if seen < fetched:
            seen += r
            continue
        if got + r > room:
            break
        got += r
    return got


__all__ = ["Fetching", "last_first"]
