"""The peaks of a plan's schedule without building it: many placements, one walk's structure.

Pure (no torch). The planner tries hundreds of placements per prefetch depth; building the
schedule for each (filling its gaps, keeping units across the step) walks every visit several
times. What a visit holds depends only on the plan's shape (units, depths, device, precision,
accumulation, deferral); the placements only decide how many bytes each held unit costs. So
the holds are found once per shape (schedule.holds on schedule.structure) and each placement is
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

from .plan import Plan, Tier
from .schedule import (
    _first_alive,
    build_schedule,
    clear_schedules,
    drain_device_bytes,
    fetch_host_bytes,
    held_weights_bytes,
    holds,
    kept_grad_bytes,
    kept_host_bytes,
    optim_host_bytes,
    structure,
)


def _shape_key(plan: Plan) -> tuple:
    return (plan.units, plan.device, plan.compute_dtype, plan.prefetch_depth, plan.optim_prefetch_depth,
            plan.accumulate_grads, plan.deferred_update, plan.speculative, plan.clipping, plan.ranks)  # fmt: skip


_HOLDS: dict[tuple, tuple] = {}
_HOLDS_MAX = 64


def _holds_for(plan: Plan) -> tuple:
    """schedule.holds of the plan's shape, found once per shape (the placements do not matter)."""
    key = _shape_key(plan)
    hs = _HOLDS.get(key)
    if hs is None:
        sched = structure(plan)
        sched = replace(sched, next_keep_until=_first_alive(sched, sched.next_keep))
        hs = tuple(holds(plan, sched))
        if len(_HOLDS) >= _HOLDS_MAX:
            _HOLDS.pop(next(iter(_HOLDS)))
        _HOLDS[key] = hs
    return hs


def clear_cache() -> None:
    """Forgets the holds, unit terms and schedules found so far (benchmarks time planning from
    nothing)."""
    _HOLDS.clear()
    _TERMS.clear()
    clear_schedules()


# (what schedule's fetch/optim/kept byte functions and Plan.unit_resident_host_bytes read of the
# plan, unit, placement) -> the unit's bytes in peak_bytes. The placements searched differ in a
# few units at a time: each unit's terms are priced once. (The plan's derived properties are in
# the key as read, not the fields they derive from: a property changed (a test patches
# grad_dtype) is a new key.)
_TERMS: dict[tuple, tuple[int, ...]] = {}
_TERMS_MAX = 1 << 16


def _shape_of(plan: Plan) -> tuple:
    return (plan.device, plan.compute_dtype, plan.grad_dtype, plan.persistent_grads, plan.separate_weights,
            plan.accumulate_grads, plan.deferred_update, plan.ranks)  # fmt: skip


def _terms(plan: Plan, shape: tuple, u, p) -> tuple[int, ...]:
    """(device weights, the trainable weights alone (held for the optimizer or the next forward:
    Holds.computing), fetching, optimizer window, kept gradients, kept shard, resident host);
    shape: _shape_of(plan)."""
    key = (shape, u, p)
    t = _TERMS.get(key)
    if t is None:
        cdt, dev = plan.compute_dtype, p.weights is Tier.DEVICE
        t = (0 if dev else u.weights_bytes(cdt), 0 if dev else held_weights_bytes(plan, u, False),
             fetch_host_bytes(plan, u, p),
             optim_host_bytes(plan, u, p), kept_grad_bytes(plan, u, p), kept_host_bytes(plan, u, p),
             plan.unit_resident_host_bytes(u, p))  # fmt: skip
        if len(_TERMS) >= _TERMS_MAX:
            _TERMS.clear()
        _TERMS[key] = t
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
    hs = _holds_for(plan)
    device_w = {}
    trainable_w = {}  # held for the optimizer or the next forward: no frozen segment (Holds.computing)
    ssd_w = {}
    ob = {}
    kb = {}
    sb = {}
    resident_host = 0
    shape = _shape_of(plan)
    for u, p in plan:
        (device_w[u.name], trainable_w[u.name], ssd_w[u.name], ob[u.name], kb[u.name], sb[u.name],
         rh) = _terms(plan, shape, u, p)  # fmt: skip
        resident_host += rh
    dev = host = 0
    for h in hs:
        d = h.grads
        for n in h.device:
            d += device_w[n] if n in h.computing else trainable_w[n]
        x = 0
        for n in h.window:
            x += ob[n]
        for n in h.fetching:
            x += ssd_w[n]
        for n in h.kept:
            x += kb[n]
        for n in h.kept_shards:
            x += sb[n]
        dev = d if d > dev else dev
        host = x if x > host else host
    # (schedule.drain_host_bytes(plan), from the terms at hand: the largest window's and the
    # resident host arrays)
    return dev + drain_device_bytes(plan), host + max(ob.values(), default=0) + resident_host


__all__ = ["clear_cache", "peak_bytes"]
