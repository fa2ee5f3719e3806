"""What the memory left after streaming keeps: ONE rule for the default plan (default.py) and the
search's fills (fills.py). Every array that could stay in memory is ranked by the SSD bytes per
step it saves per byte it holds, and taken in that order while the schedule's peaks fit the
budgets (DESIGN.md, "Bytes per step"). Pure (no torch).

Note: what an array kept in memory saves a step (`saved_bytes`, counted on the streaming plan).
  - master (fp32 compute: it is the weights too): read at every fetch the schedule makes and
    written by the update. With deferred updates applied at the next visit (decide.lazy_runtime)
    that is backward's read and the next forward's, which the pending update shares, and one
    write: 3 bytes a step per byte held (2 for the units the schedule keeps across a turn).
  - moments: read and written by the update: 2 per byte.
  - gradients that persist (deferred update, accumulation): written by backward and read back
    by the update: 2 per byte; nothing for the q+1 units whose gradients the optimizer's window
    holds anyway (schedule.grads_order puts those last).
  - 16-bit compute weights: read at every fetch.
Ties (equal bytes saved per byte) go to the device before the host for the same array (the
device's room is no use to the optimizer's arrays), then to gradients before moments (the
smaller array: the room is spent at a finer grain), then by unit: gradients in grads_order (the
units the next forward's pending updates read first), the rest in forward order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from .peaks import peak_bytes
from .plan import Plan, PlanError, Tier, fmt_bytes
from .schedule import cached_schedule, grads_order

# What a fill can keep (a (unit, what) step); for ties see the module Note.
ARRAYS = ("weights@device", "master@device", "weights@host", "master@host", "grads@host", "moments@host")
MAX_MISSES = 6  # a fill stops after this many arrays in a row did not fit


def fits(plan: Plan, device_bytes: int, host_bytes: int) -> bool:
    """The plan's schedule peaks (planner.peaks) are within the two budgets."""
    dev, host = peak_bytes(plan)
    return dev <= device_bytes and host <= host_bytes


def saved_bytes(plan: Plan, fetched: bool = True) -> dict[str, int]:
    """SSD bytes per step per key (`<unit>.<array>`) of the streaming plan `plan`: what keeping
    that array in memory saves (the module Note). fetched=False: without the fetches the
    schedule makes (its weights and masters count none: for a caller that reads neither)."""
    fetches = {u.name: 0 for u in plan.units}
    if fetched:
        sched = cached_schedule(plan)  # (each fill at these depths starts from the same streaming plan)
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
    if plan.persistent_grads:  # written once per micro-batch and read back, but where the window holds them
        kept = set(grads_order(plan)[-(plan.optim_prefetch_depth + 1) :]) if plan.deferred_update else set()
        for u in plan.units:
            out[f"{u.name}.grads"] = 0 if u.name in kept else 2 * plan.grad_bytes(u)
    return out


def ranked(plan: Plan, arrays: Sequence[str] = ARRAYS) -> list[tuple[float, tuple[tuple[str, str], ...]]]:
    """(SSD bytes saved per byte held, alternatives) for every array of `arrays` that could stay in
    memory, best first (the module Note's order). The alternatives are one array's homes, the
    device's first: (unit, what) pairs, of which a fill takes the first that fits."""
    # (the schedule's fetches count for the weights and masters only: a fill of the gradients,
    # fills.py's last, builds no schedule of the plan it fills)
    saved = saved_bytes(plan, fetched=any(a.split("@")[0] in ("master", "weights") for a in arrays))
    cdt = plan.compute_dtype
    grads_rank = {n: i for i, n in enumerate(grads_order(plan))} if plan.persistent_grads else {}
    rows = []
    for i, u in enumerate(plan.units):
        master = saved[f"{u.name}.master"]
        moments = saved[f"{u.name}.exp_avg"] + saved[f"{u.name}.exp_avg_sq"]
        # weights resident on the CPU device keep the frozen segment there too (Plan.frozen_home):
        # the device alternative saves its reads and holds its bytes (both 0 without frozen parameters)
        cpu = plan.device == "cpu"
        frozen, frozen_bytes = (saved.get(f"{u.name}.frozen", 0), u.frozen_bytes(cdt)) if cpu else (0, 0)
        if plan.separate_weights:
            w = saved[f"{u.name}.weights"]
            cand = [(0, ("weights@device",), w + frozen, u.weights_bytes(cdt)),
                    (0, ("weights@host",), w, u.weights_bytes(cdt)),
                    (0, ("master@host",), master, u.master_bytes)]  # fmt: skip
        elif cpu and frozen_bytes:  # the weights are the master, and the device holds the frozen segment too
            cand = [(0, ("master@device",), master + frozen, u.master_bytes + frozen_bytes),
                    (0, ("master@host",), master, u.master_bytes)]  # fmt: skip
        elif cpu:  # the weights are the master: on the CPU device (its budget) or the host
            cand = [(0, ("master@device", "master@host"), master, u.master_bytes)]
        else:  # CUDA, fp32: a resident copy on the device, and the master on the host
            cand = [
                (0, ("weights@device",), master, u.master_bytes),
                (0, ("master@host",), master, u.master_bytes),
            ]
        cand.append((2, ("moments@host",), moments, u.moments_bytes))
        if plan.persistent_grads:
            cand.append((1, ("grads@host",), saved[f"{u.name}.grads"], plan.grad_bytes(u)))
        for tie, whats, s, nbytes in cand:
            alts = tuple((u.name, w) for w in whats if w in arrays)
            if alts and nbytes > 0:
                rows.append((s / nbytes, tie, grads_rank[u.name] if tie == 1 else i, alts))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    return [(v, alts) for v, _, _, alts in rows]


def upgraded(plan: Plan, p, what: str):
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


def take(base: Plan, steps: list[tuple[tuple[str, str], ...]], ok: Callable[[Plan], bool]) -> Plan:
    """Applies `steps` in order (each the first of its (unit, what) alternatives that fits) while
    `ok` (the budgets) allows. The longest prefix that fits with first alternatives is found by bisection
    (keeping more never shrinks the peaks much), then steps go one by one, up to MAX_MISSES
    misses in a row: O(log n) schedule walks where a plain loop takes n."""

    index = {u.name: i for i, u in enumerate(base.units)}
    # (id(placement), what) -> (placement, upgraded()): the bisection makes each again and again
    # (keyed by identity, the placement held in the entry: hashing a placement's tiers cost more)
    made: dict = {}

    def up(p, what: str):
        e = made.get((id(p), what))
        if e is None or e[0] is not p:
            e = made[(id(p), what)] = (p, upgraded(base, p, what))
        return e[1]

    # the longest prefix that fits so far: the bisection's next prefixes start from it (the steps
    # apply in order, each to what the steps before it made)
    fitting = [0, base.placements]

    def prefix(n: int) -> Plan:
        start, placements = fitting
        placements = list(placements)
        for step in steps[start:n]:
            unit, what = step[0]
            new = up(placements[index[unit]], what)
            if new is not None:
                placements[index[unit]] = new
        return base.with_placements(tuple(placements))

    lo, hi = 0, len(steps)
    plan = base
    while lo < hi:
        mid = (lo + hi + 1) // 2
        p = prefix(mid)
        if ok(p):
            lo, plan = mid, p
            fitting[:] = [mid, p.placements]
        else:
            hi = mid - 1
    plan, misses = plan if lo else prefix(0), 0
    for step in steps[lo:]:
        for unit, what in step:
            i = index[unit]
            new = up(plan.placements[i], what)
            nxt = (
                None
                if new is None
                else plan.with_placements((*plan.placements[:i], new, *plan.placements[i + 1 :]))
            )
            if nxt is not None and ok(nxt):
                plan, misses = nxt, -1
                break
        misses += 1
        if misses >= MAX_MISSES:
            break
    return plan


def keep(
    plan: Plan, device_bytes: int, host_bytes: int, arrays: Sequence[str] = ARRAYS, *, additive: bool = False
) -> Plan:
    """THE rule: `plan` with the arrays of `arrays` kept in memory in `ranked` order (those kept
    already stay) while the schedule's peaks with them kept fit the budgets.

    additive: also count each kept array's own bytes against the room the budgets leave beyond
    the peaks of `plan` (the default plan's promise: at the streaming minimum everything streams,
    as the settings asked, though an array that some unit's buffers would hold anyway raises no
    peak). The search does not: it weighs every placement within the budgets by its estimate."""
    dev0, host0 = peak_bytes(plan)
    room_dev, room_host = device_bytes - dev0, host_bytes - host0
    res_dev, res_host = plan.resident_device_bytes(), plan.resident_host_bytes()

    def ok(p: Plan) -> bool:
        if additive and (
            p.resident_device_bytes() - res_dev > room_dev or p.resident_host_bytes() - res_host > room_host
        ):
            return False
        return fits(p, device_bytes, host_bytes)

    return take(plan, [alts for _, alts in ranked(plan, arrays)], ok)


_WHY = {
    "master": "read at each fetch, written by the update",
    "moments": "read and written by the update",
    "grads": "written by backward, read by the update",
    "weights": "read at each fetch",
}


def explain(base: Plan, kept: Plan) -> tuple[str, ...]:
    """The plan notes of `keep`: which arrays the memory left after streaming holds and why (SSD
    bytes they save a step per byte held), and where persistent gradients went."""
    saved = saved_bytes(base)
    cdt = base.compute_dtype
    took: dict[str, list] = {}
    for (u, b), k in zip(base, kept.placements):
        pairs = (("master", b.master, k.master, u.master_bytes), ("moments", b.moments, k.moments, u.moments_bytes),
                 ("weights", b.weights, k.weights, u.weights_bytes(cdt)))  # fmt: skip
        for what, before, after, nbytes in pairs:
            if what == "weights" and not base.separate_weights:
                continue
            if before is Tier.SSD and after is not Tier.SSD:
                s = saved[f"{u.name}.{what}"] if what != "moments" else 2 * saved[f"{u.name}.exp_avg"]
                took.setdefault(what, []).append((u.name, nbytes, s))
        if base.persistent_grads and b.grads is Tier.SSD and k.grads is Tier.HOST:
            took.setdefault("grads", []).append((u.name, base.grad_bytes(u), saved[f"{u.name}.grads"]))
    notes = []
    if took:
        parts = []
        for what in ("master", "weights", "grads", "moments"):
            rows = took.get(what, [])
            if rows:
                held, s = sum(r[1] for r in rows), sum(r[2] for r in rows)
                parts.append(
                    f"{what} of {len(rows)} unit(s) ({fmt_bytes(held)}; {_WHY[what]}: {s / held:.1f} B saved per B)"
                )
        total_saved = sum(r[2] for rows in took.values() for r in rows)
        notes.append(
            "memory left after streaming keeps (by SSD bytes saved per step per byte held, planner/keep.py): "
            + "; ".join(parts)
            + f"; {fmt_bytes(total_saved)} less SSD traffic a step"
        )
    if base.persistent_grads:
        total = sum(base.grad_bytes(u) for u in base.units)
        on_host = [p.unit for p in kept.placements if p.grads is Tier.HOST]
        if not on_host:
            notes.append(f"gradients ({fmt_bytes(total)}) do not fit the host budget's rest: kept on SSD")
        elif len(on_host) < len(base.units):
            units = {u.name: u for u in base.units}
            held = sum(base.grad_bytes(units[n]) for n in on_host)
            notes.append(
                f"gradients ({fmt_bytes(total)}) do not all fit the host budget's rest: {len(on_host)} of "
                f"{len(base.units)} units' ({fmt_bytes(held)}) in host memory, the rest on SSD (the units whose "
                "gradients the pending updates read first; arrays saving more bytes per byte held went first)"
            )
    return tuple(notes)


def keep_and_explain(plan: Plan, device_bytes: int, host_bytes: int) -> Plan:
    """The default plan's `keep` (additive), with its notes added to the plan's."""
    kept = keep(plan, device_bytes, host_bytes, additive=True)
    return replace(kept, notes=plan.notes + explain(plan, kept))
