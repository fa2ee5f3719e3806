"""The balance of a mix of partial and recompute: the best mix's split moved a unit at a time.
Pure (no torch).

Note: why a walk. A partial unit moves its kept outputs over the link (about 12x a checkpoint's
bytes) and runs little again; a recomputing unit moves its checkpoint and runs its forward again.
So along the share of partial units the step falls with the compute until the link takes over,
and the best share is where the two balance. The candidates (act_candidates.py) offer the mixes
in quarter steps only: each costs a replay, and every placement and room gets its own. A quarter
step over 32 blocks is 8 blocks, wide of the balance (issue 36, random profile 17, Llama 7B bf16
b64: "partial 50%" 10.374 s, 1.052x the time per token of b32; 12 of the 20 blocks the room
leaves recomputing partial: 10.249 s, 1.039x). The balance depends on the overlap of the link's
queue with compute in forward and in backward, which only the replay tells, so the best
candidate's mix (on its own placement) is moved one unit at a time towards more partial units,
and if that is not faster towards fewer, while each move is faster: a curve that falls to the
balance and rises past it. The quarter steps bracket the balance (the best mix's neighbours in
MIXES are slower), so the walk goes at most a quarter of the units either way (MIX_STEP); moves
that change no unit's policy (a unit the room keeps, or pins, either way) cost no replay. On the
sweep's points it costs 2-4 replays where the best is a mix, none elsewhere.
"""

from __future__ import annotations

import math
from typing import Callable

from .act_candidates import MIXES, ActChoice, ActPlanner

MIX_STEP = MIXES[0]  # the spacing of the mixes offered: the walk goes at most this share of the units


def balance(acts: ActPlanner, lead: ActChoice, room: int, lead_s: float,
            replay: Callable[[ActChoice], float]) -> list[ActChoice]:  # fmt: skip
    """The mixes tried around `lead` (estimated `lead_s`), in the order replayed: its split moved
    one unit at a time towards more partial units while each move is faster, else towards fewer
    (the module Note); [] where `lead` is no mix. replay(choice) -> its estimated step time."""
    m = lead.mix
    if m is None:
        return []
    reach = math.ceil(MIX_STEP * m.of)
    seen, tried, best_s = {lead.policies}, [], lead_s
    for way in (1, -1):
        moved = False
        for n in range(m.partial + way, m.partial + way * (reach + 1), way):
            c = acts.remix(lead, n, room)
            if c is None:
                break
            if c.policies in seen:
                continue  # (the same policies: no replay)
            seen.add(c.policies)
            tried.append(c)
            s = replay(c)
            if s >= best_s:
                break
            best_s, moved = s, True
        if moved:
            break
    return tried


__all__ = ["MIX_STEP", "balance"]
