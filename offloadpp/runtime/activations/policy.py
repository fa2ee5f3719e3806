"""Activation policies: what happens, per unit, to the tensors autograd saves in forward.

    keep       stay on the device until backward uses them.
    host       copied to pinned host memory during forward, copied back ahead of backward.
    ssd        copied to host, written to SSD (TensorStore), read back ahead of backward.
    recompute  not stored: the unit's forward runs again in backward (non-reentrant
               checkpointing at unit granularity); only the unit's inputs are held.
    recompute_host, recompute_ssd
               recompute, with the inputs (the activation checkpoint) swapped as host/ssd swap
               saved tensors, and fetched back ahead of the recompute.
    partial, partial_host, partial_ssd
               selective recomputation (Korthikanti et al. 2022): the outputs of the operators
               expensive to run again (matmuls, attention) and of random ones (dropout) are kept
               (partial) or swapped with the checkpoint (partial_host, partial_ssd); backward
               runs the unit's forward again from the checkpoint, handing those outputs back
               instead of running their operators, so only the cheap ones (norms, activation
               functions, reshapes) are recomputed (recompute.py, Note on partial).
    auto       decided per unit (resolve_auto): keep what fits the budget, then host, then SSD.

The settings (policy, per-unit overrides, budget) are planner.ActivationSettings, defined once
with the rest of a run's settings; the plan carries each unit's resolved policy. resolve_auto is
pure (no torch).

Note: how auto ranks units. A swapped unit costs nothing when the copies hide behind compute:
the unit's time is proportional to its FLOPs, the copies to its activation bytes, so units with
many FLOPs per byte hide their swaps best and units with few hide them worst. Auto therefore
keeps units in ascending order of FLOPs per activation byte while the budget allows (ties: the
units run last in forward first, since backward needs them first and a swap-out followed at
once by a swap-in hides behind nothing). Of what is left, the units with the fewest FLOPs per
byte go to host memory (the faster tier) while the host budget allows; the rest go to SSD.
Room is reserved on the device for the swapped units' working set: the unit backward is using
plus one prefetched, 2 x the largest swapped unit (1 x with prefetch_units=0).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence


class ActPolicy(str, Enum):
    KEEP = "keep"
    HOST = "host"
    SSD = "ssd"
    RECOMPUTE = "recompute"
    RECOMPUTE_HOST = "recompute_host"
    RECOMPUTE_SSD = "recompute_ssd"
    PARTIAL = "partial"
    PARTIAL_HOST = "partial_host"
    PARTIAL_SSD = "partial_ssd"
    AUTO = "auto"

    @property
    def swaps(self) -> bool:
        return self is ActPolicy.HOST or self is ActPolicy.SSD

    @property
    def recomputes(self) -> bool:
        """Runs the unit's forward again in backward (wholly, or the cheap operators: partial)."""
        return self in _RECOMPUTING

    @property
    def partial(self) -> bool:
        return self in (ActPolicy.PARTIAL, ActPolicy.PARTIAL_HOST, ActPolicy.PARTIAL_SSD)

    @property
    def checkpoint(self) -> Optional[ActPolicy]:
        """Where a recomputing unit's inputs (and a partial unit's kept outputs) go (HOST, SSD),
        None where they stay."""
        return _CHECKPOINT.get(self)


_RECOMPUTING = frozenset(
    (ActPolicy.RECOMPUTE, ActPolicy.RECOMPUTE_HOST, ActPolicy.RECOMPUTE_SSD)
    + (ActPolicy.PARTIAL, ActPolicy.PARTIAL_HOST, ActPolicy.PARTIAL_SSD)
)
_CHECKPOINT = {
    ActPolicy.RECOMPUTE_HOST: ActPolicy.HOST,
    ActPolicy.RECOMPUTE_SSD: ActPolicy.SSD,
    ActPolicy.PARTIAL_HOST: ActPolicy.HOST,
    ActPolicy.PARTIAL_SSD: ActPolicy.SSD,
}


@dataclass(frozen=True)
class UnitActProfile:
    """What auto needs to know about a unit: its saved activation bytes and forward FLOPs."""

    name: str
    bytes: int
    flops: float


def resolve_auto(
    profiles: Sequence[UnitActProfile],
    requested: Sequence[ActPolicy],
    *,
    budget_bytes: Optional[int],
    host_budget_bytes: Optional[int],
    outside_bytes: int = 0,
    prefetch_units: int = 2,
) -> tuple[ActPolicy, ...]:
    """Concrete policies for units whose requested policy is AUTO (see the module Note).

    profiles and requested are in forward order; outside_bytes are saved tensors no unit owns
    (the loss), always kept. Explicit policies are left as they are.
    """
    if len(profiles) != len(requested):
        raise ValueError(f"{len(profiles)} profiles for {len(requested)} policies")
    out = list(requested)
    auto = [i for i, p in enumerate(requested) if p is ActPolicy.AUTO]
    if not auto:
        return tuple(out)
    fixed_keep = sum(profiles[i].bytes for i, p in enumerate(requested) if p is ActPolicy.KEEP)
    total_auto = sum(profiles[i].bytes for i in auto)
    if budget_bytes is None or outside_bytes + fixed_keep + total_auto <= budget_bytes:
        for i in auto:
            out[i] = ActPolicy.KEEP
        return tuple(out)

    def ratio(i: int) -> float:
        b = profiles[i].bytes
        return profiles[i].flops / b if b > 0 else 0.0

    # Ascending FLOPs per byte; among equals the later unit (needed sooner in backward) first.
    ranked = sorted(auto, key=lambda i: (ratio(i), -i))
    swapped_fixed = [profiles[i].bytes for i, p in enumerate(requested) if p.swaps]
    working = 2 if prefetch_units > 0 else 1
    kept = outside_bytes + fixed_keep
    keep_set: set[int] = set()
    for i in ranked:
        # Every other auto unit not kept so far may end up swapped: reserve for the largest.
        rest = [profiles[j].bytes for j in auto if j != i and j not in keep_set] + swapped_fixed
        reserve = working * max(rest, default=0)
        if kept + profiles[i].bytes + reserve <= budget_bytes:
            keep_set.add(i)
            kept += profiles[i].bytes
    host_left = host_budget_bytes
    for i in ranked:
        if i in keep_set:
            out[i] = ActPolicy.KEEP
        elif host_left is None or profiles[i].bytes <= host_left:
            out[i] = ActPolicy.HOST
            if host_left is not None:
                host_left -= profiles[i].bytes
        else:
            out[i] = ActPolicy.SSD
    return tuple(out)
