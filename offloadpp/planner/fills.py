"""The placements the planner tries at one pair of prefetch depths: greedy by the SSD bytes each
kept array saves per byte it takes, the default policy's fill, and the fills a person would try
by hand (search.py's Note has the list). Pure (no torch).

Every candidate is checked against the budgets with planner.peaks (the schedule's peaks without
building the schedule); fills take the longest prefix that fits by bisection, then go on one by
one until MAX_MISSES misses in a row.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .default import _keep_what_fits
from .peaks import peak_bytes
from .plan import Plan, PlanError, Tier, fmt_bytes
from .request import Request
from .schedule import build_schedule, grads_order
from .spec import Budgets


def _fits(plan: Plan, req: Request) -> bool:
    dev, host = peak_bytes(plan)
    return dev <= req.budgets.device_bytes and host <= req.budgets.host_bytes


def _upgrades(plan: Plan, traffic: dict) -> list[tuple[float, int, str, str]]:
    """(value per byte, forward index, unit, what) for every array that could stay in memory."""
    out = []
    cpu = plan.device == "cpu"
    cdt = plan.compute_dtype

    def per(moved: float, nbytes: int) -> float:  # (an empty array: a unit without trainable parameters)
        return (moved + 1) / max(nbytes, 1)

    for i, (u, _) in enumerate(plan):
        master = traffic.get(f"{u.name}.master", 0)
        moments = traffic.get(f"{u.name}.exp_avg", 0) + traffic.get(f"{u.name}.exp_avg_sq", 0)
        weights = traffic.get(f"{u.name}.weights", 0)
        # weights resident on the CPU device keep the frozen segment there too (Plan.frozen_home)
        frozen = traffic.get(f"{u.name}.frozen", 0) if cpu else 0
        frozen_bytes = u.frozen_bytes(cdt) if cpu else 0
        if plan.separate_weights:
            out.append((per(weights + frozen, u.weights_bytes(cdt)), i, u.name, "weights@device"))
            out.append((per(weights, u.weights_bytes(cdt)), i, u.name, "weights@host"))
            out.append((per(master, u.master_bytes), i, u.name, "master@host"))
        else:
            dev = per(master + frozen, u.master_bytes + frozen_bytes)  # (frozen: 0 but on the CPU device)
            out.append((dev, i, u.name, "master@device" if cpu else "weights@device"))
            out.append((per(master, u.master_bytes), i, u.name, "master@host"))
        out.append((per(moments, u.moments_bytes), i, u.name, "moments@host"))
        if plan.persistent_grads:
            out.append((per(traffic.get(f"{u.name}.grads", 0), plan.grad_bytes(u)), i, u.name, "grads@host"))
    out.sort(key=lambda x: (-x[0], x[1]))
    return out


def _upgraded(plan: Plan, p, what: str):
    """Placement `p` with one more array kept in memory, or None if that does not apply."""
    cpu = plan.device == "cpu"
    sep = plan.separate_weights
    if what == "master@device":  # CPU device, fp32: the weights are the master
        if p.weights is Tier.DEVICE:
            return None
        new = replace(p, weights=Tier.DEVICE, master=Tier.HOST)
    elif what == "weights@device":
        if p.weights is Tier.DEVICE:
            return None
        new = replace(p, weights=Tier.DEVICE)
        if cpu and not sep:
            new = replace(new, master=Tier.HOST)
    elif what == "weights@host":
        if p.weights is not Tier.SSD:
            return None
        new = replace(p, weights=Tier.HOST)
    elif what == "master@host":
        if p.master is Tier.HOST:
            return None
        new = replace(p, master=Tier.HOST)
        if not sep and p.weights is not Tier.DEVICE:
            new = replace(new, weights=Tier.HOST)
    elif what == "moments@host":
        if p.moments is Tier.HOST:
            return None
        new = replace(p, moments=Tier.HOST)
    elif what == "grads@host":
        if not plan.persistent_grads or p.grads is Tier.HOST:
            return None
        new = replace(p, grads=Tier.HOST)
    else:
        raise ValueError(what)
    try:
        plan._check_placement(new)  # (a placement is valid or not on its own)
    except PlanError:
        return None
    return new


def _apply(plan: Plan, unit: str, what: str) -> Optional[Plan]:
    """The plan with one more array kept in memory, or None if that does not apply."""
    idx = [u.name for u in plan.units].index(unit)
    new = _upgraded(plan, plan.placements[idx], what)
    if new is None:
        return None
    placements = list(plan.placements)
    placements[idx] = new
    return replace(plan, placements=tuple(placements))


MAX_MISSES = 6  # a fill stops after this many arrays in a row did not fit


def _take(base: Plan, steps: list[tuple[tuple[str, str], ...]], req: Request) -> Plan:
    """Applies `steps` in order (each the first of its (unit, what) alternatives that fits) while
    the budgets allow. The longest prefix that fits with first alternatives is found by bisection
    (keeping more never shrinks the peaks much), then steps go one by one, up to MAX_MISSES
    misses in a row: O(log n) schedule walks where a plain loop takes n."""

    index = {u.name: i for i, u in enumerate(base.units)}

    def prefix(n: int) -> Plan:
        placements = list(base.placements)
        for step in steps[:n]:
            unit, what = step[0]
            new = _upgraded(base, placements[index[unit]], what)
            if new is not None:
                placements[index[unit]] = new
        return replace(base, placements=tuple(placements))

    lo, hi = 0, len(steps)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(prefix(mid), req):
            lo = mid
        else:
            hi = mid - 1
    plan, misses = prefix(lo), 0
    for step in steps[lo:]:
        for unit, what in step:
            nxt = _apply(plan, unit, what)
            if nxt is not None and _fits(nxt, req):
                plan, misses = nxt, -1
                break
        misses += 1
        if misses >= MAX_MISSES:
            break
    return _persistent_grads(plan, req)


def _greedy(base: Plan, traffic: dict, req: Request) -> Plan:
    return _take(base, [((unit, what),) for _, _, unit, what in _upgrades(base, traffic)], req)


def _ordered_fill(base: Plan, order: list[str], arrays: tuple[str, ...], req: Request) -> Plan:
    """Keeps `arrays` of the units in `order` (all of the first array's units, then the next
    array's) while the budgets allow: the fills a person tuning by hand would try."""
    masters = ("master@device", "master@host") if base.device == "cpu" else ("master@host",)
    steps = [
        tuple((u, w) for w in (masters if what == "master" else (what,))) for what in arrays for u in order
    ]
    return _take(base, steps, req)


FILLS = (
    ("forward, master first", False, ("master", "moments@host")),
    ("forward, moments first", False, ("moments@host", "master")),
    ("backward, master first", True, ("master", "moments@host")),
)


def _persistent_grads(plan: Plan, req: Request) -> Plan:
    """Gradients kept between micro-batches or for a deferred update: in host memory as far as
    the budgets allow, unit by unit in grads_order (those kept already stay)."""
    if not plan.persistent_grads:
        return plan
    host = replace(plan, placements=tuple(replace(p, grads=Tier.HOST) for p in plan.placements))
    if _fits(host, req):
        return host
    for name in grads_order(plan):
        nxt = _apply(plan, name, "grads@host")
        if nxt is not None and _fits(nxt, req):
            plan = nxt
    return plan


def _traffic(plan: Plan) -> dict[str, int]:
    """SSD bytes per step per key of the streaming plan (every array read and written once per
    step, the weights read at every fetch the schedule makes): the value of keeping each."""
    sched = build_schedule(plan)
    fetches = {u.name: 0 for u in plan.units}
    prev: frozenset = frozenset()
    for alive in sched.alive:
        for n in alive - prev:
            fetches[n] += 1
        prev = alive
    out = {}
    cdt = plan.compute_dtype
    for u in plan.units:
        f = fetches[u.name]
        frozen = u.frozen_bytes(cdt)  # read at every fetch, never written (docs/frozen.md)
        if plan.separate_weights:
            out[f"{u.name}.weights"] = (f + 1) * (u.weights_bytes(cdt) - frozen)
            out[f"{u.name}.master"] = 2 * u.master_bytes
        else:
            out[f"{u.name}.master"] = (f + 1) * u.master_bytes
        out[f"{u.name}.exp_avg"] = out[f"{u.name}.exp_avg_sq"] = u.moments_bytes
        if frozen:
            out[f"{u.name}.frozen"] = f * frozen
    if plan.persistent_grads:  # written once per micro-batch and read back, but where kept (grads_order)
        kept = set(grads_order(plan)[-(plan.optim_prefetch_depth + 1) :]) if plan.deferred_update else set()
        for u in plan.units:
            out[f"{u.name}.grads"] = 0 if u.name in kept else 2 * plan.grad_bytes(u)
    return out


def _placements(base: Plan, req: Request, reserve: int) -> dict:
    """The placements to try at the depths of `base`: greedy, the default fill and FILLS, with
    `reserve` device bytes set aside for the activations (placements -> how)."""
    rq = replace(req, budgets=Budgets(req.budgets.device_bytes - reserve, req.budgets.host_bytes),
                 count_activations=False)  # fmt: skip
    dev0, host0 = peak_bytes(base)
    if dev0 > rq.budgets.device_bytes:
        return {}
    tag = f" (activations {fmt_bytes(reserve)})" if reserve else ""
    tried = {base.placements: "stream"}
    tried.setdefault(_greedy(base, _traffic(base), rq).placements, "greedy" + tag)
    dflt = _keep_what_fits(base, rq.budgets.device_bytes - dev0, rq.budgets.host_bytes - host0)
    if _fits(dflt, rq):
        tried.setdefault(_persistent_grads(dflt, rq).placements, "default fill" + tag)
    names = [u.name for u in base.units]
    for label, backward, arrays in FILLS:
        filled = _ordered_fill(base, names[::-1] if backward else names, arrays, rq)
        tried.setdefault(filled.placements, label + tag)
    return tried
