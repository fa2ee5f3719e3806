"""The peaks of a plan's schedule without building it: many placements, one walk's structure.

Pure (no torch). The planner tries hundreds of placements per prefetch depth; building the
schedule for each (filling its gaps, keeping units across the step) walks every visit several
times. What a visit holds depends only on the plan's shape (units, depths, device, precision,
accumulation, deferral); the placements only decide how many bytes each held unit costs. So
the holds are found once per shape (holds.holds on schedule.structure) and each placement is
priced over them.

Note: why the unfilled schedule's peaks are the schedule's. Filling gaps (schedule._fill_gaps)
and keeping units across the step boundary (schedule._keep_across) add a unit to a visit only
where that raises neither peak, so build_schedule's peaks are those of the schedule before
either (tests/test_plan.py checks equality over random placements). One exception: with
deferred updates on the CPU device with fp32 compute, the units _keep_across adds are counted
at backward visits it does not check (schedule._walk counts the kept units there for the update
phase after backward); such plans (small, CPU) are priced by building their schedule.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .holds import (
    alias_master,
    fetch_host_bytes,
    held_weights_bytes,
    holds,
    kept_grad_bytes,
    kept_host_bytes,
    optim_host_bytes,
)
from .plan import Plan, Tier
from .schedule import _first_alive, build_schedule, clear_schedules, structure


def _shape_key(plan: Plan) -> tuple:
    # (micro_batches: a vertical window's backward visits hold each micro-batch's gradients,
    # holds.visit_grad_bytes)
    return (plan.units, plan.device, plan.compute_dtype, plan.prefetch_depth, plan.optim_prefetch_depth,
            plan.accumulate_grads, plan.deferred_update, plan.speculative, plan.clipping, plan.ranks,
            plan.micro_batches)  # fmt: skip


_HOLDS: dict[tuple, tuple] = {}
_HOLDS_MAX = 64


def _holds_for(plan: Plan) -> tuple[tuple, tuple]:
    """holds.holds of the plan's shape, found once per shape (the placements do not matter),
    as (device rows, host rows) over the units' indices: (grads, computing, others) and (window,
    fetching, kept, kept shards). The two peaks are maxima over the visits, each on its own: rows
    equal to another are priced once (_Priced)."""
    key = _shape_key(plan)
    rows = _HOLDS.get(key)
    if rows is None:
        sched = structure(plan)
        sched = replace(sched, next_keep_until=_first_alive(sched, sched.next_keep))
        index = {u.name: i for i, u in enumerate(plan.units)}

        def ix(names) -> tuple[int, ...]:
            return tuple(sorted(index[n] for n in names))

        dev, host = set(), set()
        for h in holds(plan, sched):
            dev.add((h.grads, ix(h.device & h.computing), ix(h.device - h.computing)))
            host.add((ix(h.window), ix(h.fetching), ix(h.kept), ix(h.kept_shards)))
        rows = (tuple(dev), tuple(host))
        if len(_HOLDS) >= _HOLDS_MAX:
            _HOLDS.pop(next(iter(_HOLDS)))
        _HOLDS[key] = rows
    return rows


def clear_cache() -> None:
    """Forgets the holds, unit terms, schedules and activation sizes found so far (benchmarks time
    planning from nothing)."""
    from .certain_io import clear_certain  # (the settling's certain bytes)
    from .simulate_memo import clear_shared  # (the replay's memos)

    clear_shared()
    clear_certain()
    _HOLDS.clear()
    _TERMS.clear()
    _LAST.clear()
    clear_schedules()


# (what schedule's fetch/optim/kept byte functions and Plan.unit_resident_host_bytes read of the
# plan, unit, placement) -> the unit's bytes in peak_bytes. The placements searched differ in a
# few units at a time: each unit's terms are priced once. (The plan's derived properties are in
# the key as read, not the fields they derive from: a property changed (a test patches
# grad_dtype) is a new key.)
_TERMS: dict[tuple, tuple] = {}
_TERMS_MAX = 1 << 16


def _shape_of(plan: Plan) -> tuple:
    return (plan.device, plan.compute_dtype, plan.grad_dtype, plan.persistent_grads, plan.separate_weights,
            plan.accumulate_grads, plan.deferred_update, plan.ranks)  # fmt: skip


def _terms(plan: Plan, shape: tuple, u, p) -> tuple[int, ...]:
    """(device weights, the trainable weights alone (held for the optimizer or the next forward:
    Holds.computing), fetching, optimizer window, kept gradients, kept shard, resident host,
    resident device weights, a master on SSD (holds.drain_device_bytes' two parts));
    shape: _shape_of(plan)."""
    # (keyed by the unit's identity, the unit held in the entry so its id is not reused while it
    # is there: hashing a UnitSpec's every field, thousands of times a search, cost more than the
    # pricing; and by the placement's tiers, by identity too (Tier's members are singletons;
    # hashing an Enum is a Python call): a fill makes equal placements anew again and again)
    key = (shape, id(u), p.unit, id(p.weights), id(p.master), id(p.moments), id(p.grads))
    e = _TERMS.get(key)
    t = e[1] if e is not None and e[0] is u else None
    if t is None:
        cdt, dev = plan.compute_dtype, p.weights is Tier.DEVICE
        t = (0 if dev else u.weights_bytes(cdt), 0 if dev else held_weights_bytes(plan, u, False),
             fetch_host_bytes(plan, u, p),
             optim_host_bytes(plan, u, p), kept_grad_bytes(plan, u, p), kept_host_bytes(plan, u, p),
             plan.unit_resident_host_bytes(u, p), u.weights_bytes(cdt) if dev else 0,
             u.master_bytes if p.master is Tier.SSD else 0)  # fmt: skip
        if len(_TERMS) >= _TERMS_MAX:
            _TERMS.clear()
        _TERMS[key] = (u, t)
    return t


def peak_bytes(plan: Plan) -> tuple[int, int]:
    """(device, host) peak bytes of the runtime's buffers: build_schedule(plan)'s peaks."""
    if (
        plan.deferred_update
        and plan.fill_gaps
        and plan.device == "cpu"
        and not plan.separate_weights
        and plan.ranks == 1
    ):
        s = build_schedule(plan)
        return s.peak_device_bytes, s.peak_host_bytes
    shape = _shape_of(plan)
    small = (plan.device, plan.compute_dtype, plan.prefetch_depth, plan.optim_prefetch_depth, plan.accumulate_grads,
             plan.deferred_update, plan.speculative, plan.clipping, plan.ranks, plan.micro_batches, shape)  # fmt: skip
    last = _LAST.get(small)
    if last is None or last.units is not plan.units:
        last = _LAST[small] = _Priced(plan, shape)
    else:
        last.move_to(plan, shape)
    if last.peaks is None:  # (else the terms did not change since the last plan priced)
        # (holds.drain_device_bytes(plan) and drain_host_bytes(plan), from the terms at hand:
        # the largest master on SSD where the weights alias it, the resident device weights; the
        # largest window's and the resident host arrays)
        drain = max((t[8] for t in last.terms), default=0) if alias_master(plan) else 0
        last.peaks = (max(last.dev, default=0) + drain + last.resident_device,
                      max(last.host, default=0) + max((t[3] for t in last.terms), default=0) + last.resident_host)  # fmt: skip
    return last.peaks


# Which of a row's parts reads which unit term (_terms' order): device rows (computing, others),
# host rows (window, fetching, kept, kept shards)
_DEV_TERM = (0, 1)
_HOST_TERM = (3, 2, 4, 5)


class _Priced:
    """The last plan priced at one shape: its placements, their unit terms and every row's sum.
    Note: the placements a search prices one after another differ in a few units (a fill adds
    one array at a time); the next is priced by moving the sums of the rows the changed units
    are in, not by summing every row again (integers: the same peaks to the byte)."""

    def __init__(self, plan: Plan, shape: tuple) -> None:
        dev_rows, host_rows = _holds_for(plan)
        n = len(plan.units)
        self.units = plan.units
        self.placements = plan.placements
        self.terms = [_terms(plan, shape, u, p) for u, p in plan]
        # unit index -> [(row, term index)], once per appearance
        self.dev_in: list[list] = [[] for _ in range(n)]
        self.host_in: list[list] = [[] for _ in range(n)]
        self.dev = []
        for r, (grads, *parts) in enumerate(dev_rows):
            total = grads
            for part, k in zip(parts, _DEV_TERM):
                for i in part:
                    self.dev_in[i].append((r, k))
                    total += self.terms[i][k]
            self.dev.append(total)
        self.host = []
        for r, parts in enumerate(host_rows):
            total = 0
            for part, k in zip(parts, _HOST_TERM):
                for i in part:
                    self.host_in[i].append((r, k))
                    total += self.terms[i][k]
            self.host.append(total)
        self.resident_host = sum(t[6] for t in self.terms)
        self.resident_device = sum(t[7] for t in self.terms)
        self.peaks: Optional[tuple[int, int]] = None  # (peak_bytes' answer, until a term changes)

    def move_to(self, plan: Plan, shape: tuple) -> None:
        old = self.placements
        if old is plan.placements:
            return
        units = plan.units
        for i, p in enumerate(plan.placements):
            if p is old[i]:
                continue
            before, after = self.terms[i], _terms(plan, shape, units[i], p)
            if after is before or after == before:
                continue
            self.peaks = None
            for r, k in self.dev_in[i]:
                self.dev[r] += after[k] - before[k]
            for r, k in self.host_in[i]:
                self.host[r] += after[k] - before[k]
            self.resident_host += after[6] - before[6]
            self.resident_device += after[7] - before[7]
            self.terms[i] = after
        self.placements = plan.placements


_LAST: dict[tuple, _Priced] = {}


__all__ = ["clear_cache", "peak_bytes"]
