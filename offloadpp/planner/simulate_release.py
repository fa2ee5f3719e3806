"""The replay's release within a recomputed unit (simulate_act.py's ActReplay takes it as a base):
a whole or nested recompute of a unit with pieces releases each piece's saved bytes as that
piece's backward ends, as the runtime does (runtime/activations/recompute.py, Note on release).

Pure (no torch). What it reads of the ActReplay: `units`, `policy`, `sim` (its costs),
`recompute_s` and `_recomputed`.
"""

from __future__ import annotations

from .activations import NESTED, RECOMPUTE
from .simulate_memo import per_unit


class Releasing:
    """ActReplay's release within a recomputed unit (the module docstring). Its methods but
    _releasing run only at the visits where the budget held a prefetch back
    (ActReplay.backward_parts) and between that unit's pieces: not remembered."""

    @per_unit
    def _releasing(self, unit: str) -> bool:
        """A whole or nested recompute of a unit with pieces releases each piece's saved bytes as
        that piece's backward ends (runtime/activations/recompute.py, Note on release), so the
        next units' activations come back while its earlier pieces' backward runs. Remembered:
        every part of every piecewise unit's backward asks it (_hold), and it reads only the
        unit's profile and policy."""
        u = self.units.get(unit)
        pol = self.policy(unit)
        return (u is not None and (pol in RECOMPUTE or pol in NESTED) and len(u.pieces) > 1
                and u.micro_batches == 1 and not u.logits and sum(p[0] for p in u.pieces) > 0)  # fmt: skip

    def _release_parts(self, unit: str) -> tuple[float, ...]:
        """A releasing unit's backward as shares of its work, its pieces last to first: each
        piece's share of the backward by what it saves (the last piece's its known share,
        ActUnit.last_piece_share), the recompute's whole forward in the first; a nested unit's
        second forward of each piece but the last in that piece's (nested.py, phase B)."""
        u = self.units[unit]
        saved = [p[0] for p in u.pieces]
        last = u.last_piece_share
        if not 0 < last < 1 or sum(saved[:-1]) <= 0:
            shares = [x / sum(saved) for x in saved]
        else:
            shares = [(1 - last) * x / sum(saved[:-1]) for x in saved[:-1]] + [last]
        costs = self.sim.costs
        bwd = costs.backward_s[unit] + costs.backward_visit_s
        again = self.recompute_s(unit)
        work = bwd + again
        if work <= 0:
            return (1.0,)
        once = min(again, costs.forward_s[unit] + costs.forward_visit_s)  # (phase A: the whole forward)
        parts = [x * bwd for x in shares]
        if sum(shares[:-1]) > 0:  # (phase B: the pieces but the last, again)
            parts[:-1] = [x + (again - once) * s / sum(shares[:-1]) for x, s in zip(parts[:-1], shares[:-1])]
        else:
            once = again
        parts[-1] += once
        return tuple(x / work for x in reversed(parts))

    def _left_after(self, unit: str, done: int) -> int:
        """What a releasing unit holds once its last `done` pieces' backward is done: a whole
        recompute all it recomputed but those pieces' saved bytes; a nested one its boundaries
        and the largest saved bytes of the pieces left (ActUnit.nested)."""
        u = self.units[unit]
        left = u.pieces[: len(u.pieces) - done]
        if self.policy(unit) in NESTED:
            if not left:
                return 0
            return sum(p[1] for p in u.pieces) + max(p[0] - p[1] for p in left)
        return max(0, self._recomputed(unit) - sum(p[0] for p in u.pieces[len(left) :]))


__all__ = ["Releasing"]
