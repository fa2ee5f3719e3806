"""Activation policies: what happens, per unit, to the tensors autograd saves in forward.

    keep       stay on the device until backward uses them.
    host       copied to pinned host memory during forward, copied back ahead of backward.
    ssd        copied to host, written to SSD (TensorStore), read back ahead of backward.
    recompute  not stored: the unit's forward runs again in backward (non-reentrant
               checkpointing at unit granularity); only the unit's inputs are held.
    auto       decided per unit (resolve_auto): keep what fits the budget, then host, then SSD.

ActivationConfig is the component's own frozen config (DESIGN.md, convention 6); resolve_auto is
pure (no torch), so the planner can call it too.

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
from typing import Literal, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

PolicyName = Literal["keep", "host", "ssd", "recompute", "auto"]


class ActPolicy(str, Enum):
    KEEP = "keep"
    HOST = "host"
    SSD = "ssd"
    RECOMPUTE = "recompute"
    AUTO = "auto"

    @property
    def swaps(self) -> bool:
        return self is ActPolicy.HOST or self is ActPolicy.SSD


class ActivationConfig(BaseModel):
    """How the ActivationManager treats saved activations.

    policy: the policy of every unit not named in unit_policies.
    unit_policies: per-unit overrides, by unit name (unknown names are refused when the manager
        learns the units).
    budget_bytes: device bytes for activations (None: unlimited). Forward waits for swap-outs
        when it would exceed it; backward prefetches only within it; auto keeps within it.
    host_budget_bytes: host bytes auto may fill with swapped activations before using SSD
        (None: unlimited, so auto never picks SSD).
    prefetch_units: backward fetches the activations of this many units ahead of the one it runs.
    min_swap_bytes: storages smaller than this are kept (an I/O costs more than they save).
    key_prefix: prefix of the TensorStore keys of swapped activations.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: PolicyName = "keep"
    unit_policies: Mapping[str, PolicyName] = {}
    budget_bytes: Optional[int] = Field(None, gt=0)
    host_budget_bytes: Optional[int] = Field(None, gt=0)
    prefetch_units: int = Field(2, ge=0)
    min_swap_bytes: int = Field(64 << 10, ge=0)
    key_prefix: str = "act"

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v or "/" in v:
            raise ValueError(f"key_prefix must be a non-empty name without '/', got {v!r}")
        return v

    def policy_for(self, unit: str) -> ActPolicy:
        return ActPolicy(self.unit_policies.get(unit, self.policy))

    def check_units(self, names: Sequence[str]) -> None:
        unknown = sorted(set(self.unit_policies) - set(names))
        if unknown:
            raise ValueError(
                f"ActivationConfig.unit_policies names units the model does not have: {unknown}; units are {list(names)}"
            )


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


def plan_policies(
    units: Sequence,
    plan_policies: Sequence[str],
    policy: str,
    overrides: Optional[Mapping[str, str]],
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The activation policy of each unit for a Plan (units: UnitSpecs in forward order): the
    plan's own if it names them, else the config's `policy` and per-unit `overrides`. A unit whose
    backward fetches none of its weights (embedding lookups) cannot run its forward again:
    `recompute` becomes `keep` there. Returns (policies, notes)."""
    names = [u.name for u in units]
    unknown = sorted(set(overrides or {}) - set(names))
    if unknown:
        raise ValueError(
            f"activation_overrides names units the model does not have: {unknown}; units are {names}"
        )
    chosen = tuple(plan_policies) or tuple((overrides or {}).get(n, policy) for n in names)
    out, notes = [], []
    for u, p in zip(units, chosen):
        if p == "recompute" and not u.backward_needs_weights:
            notes.append(
                f"unit {u.name!r}: its backward reads no weights, so it cannot recompute: activations kept"
            )
            p = "keep"
        out.append(p)
    return tuple(out), tuple(notes)
