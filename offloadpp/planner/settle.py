"""The candidates a search need not replay: their lower bound settles them (search.py's steps 1-3).

Note: settling. The search replays a candidate (cost.replay, ~15 ms for 13B) to learn its
estimate, but most of what it replays cannot be chosen: the robust pick looks only at the
candidates within NOMINAL_GIVE of the best estimate (robust_pick.py), and a candidate's
estimate is never below its lower bound (cost.lower_bound). So a candidate whose bound is beyond
NOMINAL_GIVE of the best so far (the final best is no slower) is settled: left unreplayed,
where its estimate would be read only by the pick. Step 1's estimates are also read by step 2
(search._tops: the placements whose other activation choices are replayed), so there a
candidate is settled only where its bound also proves it outside _tops' choice (outside_tops).
Step 3 (the best's choice on the fills it was not replayed with) reads which (placement, choice)
pairs were replayed: the settled ones count as replayed there (their bound answered it). A
vertical window's candidates are read past its pick (decide.loop_candidates: each one faster
than the horizontal plan is asked whether its loop holds), so a window's search settles none.
What settling saves is the replays of the choices that lose by more than their bound can hide
(issue 36's sweep, random profile 16, 13B bf16 b8: 108 replays -> 58; profile 2 b16: 118 -> 58;
none where the bounds are far below the replays, profile 8's: there waits set the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


def activation_room(plan):
    """A candidate's activation room, as search._tops tells rooms apart (None: no budgets)."""
    return plan.budgets.activation_bytes if plan.budgets is not None else None


@dataclass
class Settled:
    """What one search settled: (label, plan, ActChoice) per candidate left unreplayed."""

    on: bool  # False: every candidate is replayed (a vertical window's search)
    give: float  # the robust pick's NOMINAL_GIVE
    left: list = field(default_factory=list)
    # (plan, its bound, its ActChoice, the bound that settles) -> a bound no less, still below
    # every replay of the plan with those activations (certain_io.tight_bound): asked only where
    # the first cannot settle
    tighten: Optional[Callable] = None

    def cannot_win(self, lb: float, best_s: float) -> bool:
        """A candidate of bound `lb` cannot be within `give` of the search's best (no more than
        best_s, the best so far)."""
        return self.on and lb > best_s * (1 + self.give)

    def settles(self, lb: float, label: str, plan, choice, best_s: float, tops=None) -> bool:
        """Whether the candidate is settled (then remembered); `tops`: (replayed candidates, n,
        extra) where _tops(candidates, n, extra) will read its estimate (step 1)."""
        if not self.cannot_win(lb, best_s):
            if self.tighten is None or not self.on:
                return False
            lb = self.tighten(plan, lb, choice, best_s * (1 + self.give))
            if not self.cannot_win(lb, best_s):
                return False
        if tops is not None and not outside_tops(lb, plan, *tops):
            return False
        self.left.append((label, plan, choice))
        return True

    def pairs(self) -> set:
        """(id(plan), choice label) of every settled candidate."""
        return {(id(plan), c.label) for _, plan, c in self.left}


def outside_tops(lb: float, plan, cands: list, n: int, extra: int) -> bool:
    """Whether a candidate of `plan` whose estimate is at least `lb` is left out of
    search._tops(sorted candidates, n, extra) whatever else is replayed: n candidates are
    strictly faster (it is not among the first n), and extra is 0 or a faster one has its room
    (in _tops' walk that room is taken before it comes, or the extras are full). More candidates
    only keep this true."""
    below = [c for c in cands if c.estimate.step_s < lb]
    if len(below) < n:
        return False
    if extra == 0:
        return True
    return plan.budgets is not None and any(
        c.plan.budgets is not None and activation_room(c.plan) == activation_room(plan) for c in below
    )


__all__ = ["Settled", "activation_room", "outside_tops"]
