"""The schedule a Plan implies: the order units run in one training step, which weights are held
at each point, the order the optimizer updates units, and the memory that takes.

Pure (no torch). The runtime walks `Schedule.visits` and does what it says; the planner uses the
same walk to check budgets, so what is checked is what runs.

Note: the shape of a step. A *visit* is one unit running: forward visits the units in order,
backward visits them in reverse. While visit i runs, the weights of visits i..i+k are held
(`alive[i]`), so the fetch for visit i+k starts as visit i starts, and a unit used twice within
k visits (the last blocks of forward, reused first in backward; the embeddings read again by a
tied head) is simply kept. The optimizer updates a unit as its gradients complete, which is at
its backward visit, so `update_order` is the backward order (a deferred update, run after
backward, takes the largest units first instead, equals in forward order). Its state (master,
moments) is read in a window over that order: the first q+1 units' state at the start of the
forward that ends on an accumulation boundary (for a deferred update, clipping or the overflow
check: at the start of that backward), then unit i+q+1's as unit i is handed to the optimizer.

Note: across the step boundary. The units the next forward's first two visits hold (`next_keep`)
keep their buffers after their update: the weights the update just produced are what that
forward needs, and reading them back would wait for the step's own trailing write of that very
key (a read of a key starts only once its write is done), stalling the first visits. On the CPU
device with fp32 compute (the weights are the master), a later unit is kept too wherever that
does not raise the step's device peak, as _fill_gaps keeps units within a step: the same memory,
one read less per unit and step (every update is still written to SSD). A kept unit's hold ends
at the visit that first holds it (`next_keep_until`).

What a schedule holds at each visit (bytes by buffer): planner/holds.py.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

from .decide import lazy_runtime
from .holds import (
    alias_master,
    drain_device_bytes,
    drain_host_bytes,
    fetch_host_bytes,
    held_weights_bytes,
    holds,
    kept_grad_bytes,
    kept_host_bytes,
    optim_host_bytes,
)
from .plan import Plan, Tier
from .visits import Schedule, Visit


def flush_rank(key: str) -> int:
    """The order flush_writes starts the writes a step left queued (a stable sort on this): the
    weights first, the optimizer's state after.

    Note: why. The next forward reads back every updated unit's weights that it does not keep,
    and a read of a key waits for that key's own write; the engine serves writes in order, so a
    weights write queued behind the moments' (every unit's, with a window over all units) stalled
    the forward's last visits for the moments' whole drain (docs/runtime.md)."""
    return 0 if key.endswith((".master", ".weights")) else 1


def grads_order(plan: Plan) -> list[str]:
    """The units whose gradients are worth keeping in host memory first, where not all fit.

    Note: why this order. A deferred step's gradients wait for its update: the update pass
    reads them back largest unit first, and updates applied at the next visit (simulate_pending)
    read them in forward order, the first units' first, which are those backward finished last.
    Either way the first q+1 units of that order keep theirs in memory without a home (the
    runtime's window), so a home in host memory saves a write and a read for the units after
    them, in the same order: theirs are the reads the next pass or forward waits for first."""
    q = plan.optim_prefetch_depth
    if lazy_runtime(plan):
        order = [u.name for u in plan.units]  # forward order
    else:
        order = list(structure(plan).update_order)
    return order[q + 1 :] + order[: q + 1]


def build_schedule(plan: Plan) -> Schedule:
    sched = structure(plan)
    if plan.fill_gaps:
        sched = Schedule(**{**sched.__dict__, "alive": _fill_gaps(plan, sched)})
    sched = Schedule(
        **{**sched.__dict__, "next_keep_until": _first_alive(sched, sched.next_keep | sched.spec_next_keep)}
    )
    if plan.fill_gaps and (alias_master(plan) or plan.ranks > 1):
        sched = _keep_across(plan, sched)
    dev, host = _peaks(plan, sched)
    return Schedule(**{**sched.__dict__, "peak_device_bytes": dev, "peak_host_bytes": host})


def structure(plan: Plan) -> Schedule:
    """The schedule before any gap is filled (no peaks): what depends only on the units, the
    depths and the settings, not on where arrays live. Its peaks are the filled schedule's
    (filling never raises a peak), which peaks.PeakModel evaluates for many placements."""
    units = plan.units
    k = plan.prefetch_depth
    visits: list[Visit] = []
    for u in units:
        visits.append(Visit(len(visits), u.name, False, (u.name, *u.borrows)))
    for u in reversed(units):
        own = (u.name,) if u.backward_needs_weights else ()
        visits.append(Visit(len(visits), u.name, True, own + u.borrows))
    n = len(visits)
    alive = tuple(
        frozenset(name for v in visits[i : min(n, i + k + 1)] for name in v.needs) for i in range(n)
    )
    forward_index = {v.unit: v.index for v in visits if not v.backward}
    backward_index = {v.unit: v.index for v in visits if v.backward}
    absorb_order = tuple(v.unit for v in visits if v.backward)
    update_order = absorb_order
    if plan.deferred_update:
        # Updates run after backward, in any order: the largest first, so that their state
        # (read during backward) is not read after it; among equals in the next forward's
        # order, so the weights that forward reads first are the first written back (a read of
        # a key waits for that key's write).
        specs = {u.name: u for u in units}
        update_order = tuple(
            sorted(absorb_order, key=lambda n: (-specs[n].master_bytes, forward_index.get(n, 0)))
        )
    keep_until_update = frozenset()
    if alias_master(plan) and not plan.deferred_update:
        # A unit whose weights backward reads before its own visit (tied embeddings read by the
        # head): its weights are its master, which its update needs at the end; keep them.
        keep_until_update = frozenset(
            name for v in visits if v.backward for name in v.needs if v.index < backward_index[name]
        )
    return Schedule(
        visits=tuple(visits),
        alive=alive,
        update_order=update_order,
        absorb_order=absorb_order,
        prefetch_depth=k,
        next_keep=alive[0] | (alive[1] if n > 1 else frozenset()),
        spec_next_keep=(alive[0] | (alive[1] if n > 1 else frozenset())) if plan.speculative else frozenset(),
        keep_until_update=keep_until_update,
        optim_prefetch_depth=plan.optim_prefetch_depth,
        peak_device_bytes=0,
        peak_host_bytes=0,
        forward_index=forward_index,
        backward_index=backward_index,
    )


def _first_alive(sched: Schedule, names) -> dict[str, int]:
    """Per unit named, the first visit that holds it; in forward order, the order the replay and
    the runtime release the kept units in (executor.py walks this mapping): `names` is often a
    frozenset, whose order follows the interpreter's hash seed, and so did the replay's releases."""
    fwd = sched.forward_index
    return {
        n: next(i for i, a in enumerate(sched.alive) if n in a)
        for n in sorted(names, key=lambda n: (fwd.get(n, len(fwd)), n))
    }


def _keep_across(plan: Plan, sched: Schedule) -> Schedule:
    """`next_keep` with every further unit whose weights can stay from its update to the next
    forward's first hold of them without raising the device peak (see the module Note), largest
    first; for a speculative plan also `spec_next_keep`, the same for a step that speculates
    (its updates run in backward, so a kept unit is held through the rest of backward too: it
    keeps fewer, and the deferred step keeps what it can on its own walk). Over several ranks:
    _keep_shards."""
    if plan.ranks > 1:
        return _keep_shards(plan, sched)
    base, spec = _walk(plan, sched, "base"), _walk(plan, sched, "speculative")
    peak = max(max(base[0]), max(spec[0], default=0))
    keep = _keep_set(plan, sched, sched.next_keep, peak, base, backward=not plan.deferred_update)
    spec_keep = frozenset()
    if plan.speculative:
        # the next forward's visits are the base walk's (with the deferred step's kept units in
        # them now); a unit the deferred step keeps is counted there already
        spec_keep = _keep_set(plan, sched, sched.spec_next_keep, peak, spec, backward=True,
                              forward=(base[0], base[2]), skip=keep)  # fmt: skip
    both = keep | spec_keep
    return Schedule(**{**sched.__dict__, "next_keep": keep, "spec_next_keep": spec_keep,
                       "next_keep_until": _first_alive(sched, both)})  # fmt: skip


def _keep_set(plan: Plan, sched: Schedule, start: frozenset, peak: int, walk, *, backward: bool,
              forward=None, skip: frozenset = frozenset()) -> frozenset:  # fmt: skip
    """The units kept across on one walk (devs, _, helds): held from the update (backward: the
    backward visits after the unit's own; a deferred update: none) to the next forward's first
    hold. `forward`: the (devs, helds) the forward visits are counted on, where not the walk's
    own; `skip`: units whose forward span that counts already."""
    devs, _, helds = walk
    fdevs, fhelds = forward if forward is not None else (devs, helds)
    specs = {u.name: u for u in plan.units}
    place = {p.unit: p for p in plan.placements}
    keep = set(start)
    for name in sorted(specs, key=lambda n: (-specs[n].master_bytes, n)):
        if name in keep or place[name].weights is Tier.DEVICE:
            continue
        w = specs[name].weights_bytes(plan.compute_dtype)
        until = _first_alive(sched, (name,))[name]
        fwd = [] if name in skip else [i for i in range(until) if name not in fhelds[i]]
        bwd = range(sched.backward_index[name] + 1, len(sched.visits)) if backward else ()
        bwd = [i for i in bwd if name not in helds[i]]
        if all(fdevs[i] + w <= peak for i in fwd) and all(devs[i] + w <= peak for i in bwd):
            keep.add(name)
            for i in fwd:
                fdevs[i] += w
                fhelds[i].add(name)
            for i in bwd:
                devs[i] += w
                helds[i].add(name)
    return frozenset(keep)


def _keep_shards(plan: Plan, sched: Schedule) -> Schedule:
    """Over several ranks what stays across the step boundary is the rank's updated shard, in
    host memory: `next_keep` with every further unit whose shard fits without raising the host
    peak, largest first (the shard is counted from its own backward visit on, as holds() counts
    it, deferred or not). Several ranks never speculate (planner/resolve.py)."""
    _, hosts, _ = _walk(plan, sched)
    peak = max(hosts)
    specs = {u.name: u for u in plan.units}
    place = {p.unit: p for p in plan.placements}
    keep = set(sched.next_keep)
    for name in sorted(specs, key=lambda n: (-specs[n].master_bytes, n)):
        if name in keep or place[name].weights is Tier.DEVICE:
            continue
        w = kept_host_bytes(plan, specs[name], place[name])
        if not w:
            continue  # (its shard is resident anyway)
        until = _first_alive(sched, (name,))[name]
        span = list(range(until)) + list(range(sched.backward_index[name] + 1, len(sched.visits)))
        if all(hosts[i] + w <= peak for i in span):
            keep.add(name)
            for i in span:
                hosts[i] += w
    keep_f = frozenset(keep)
    return Schedule(**{**sched.__dict__, "next_keep": keep_f, "next_keep_until": _first_alive(sched, keep_f)})


# plan -> its schedule: the search replays one plan with several activation choices and on a slow
# SSD (search.py), and building a 175B schedule is a third of its replay's time. The same
# placements come with several activation budgets (search.py), which the schedule does not read:
# they are not in the key. (64: a search's plans at a few depths, replayed again by the robust pick)
_SCHEDULES: dict[tuple, Schedule] = {}
_SCHEDULES_MAX = 64
_KEY_FIELDS = tuple(f.name for f in fields(Plan) if f.compare and f.name != "budgets")


# (and by the plan's identity, the plan held in the entry so its id is not reused while it is
# there: the key above hashes every unit and placement, and a search asks for the schedule of
# the same plan object at each of its replays)
_BY_PLAN: dict[int, tuple] = {}


def cached_schedule(plan: Plan) -> Schedule:
    """build_schedule(plan), remembered for the last few plans (a Schedule is frozen; the plan's
    derived properties are in the key as read: one changed, as a test may patch, is a new key)."""
    derived = (plan.grad_dtype, plan.persistent_grads, plan.separate_weights, plan.ranks)
    e = _BY_PLAN.get(id(plan))
    if e is not None and e[0] is plan and e[1] == derived:
        return e[2]
    key = (*(getattr(plan, f) for f in _KEY_FIELDS), *derived)
    s = _SCHEDULES.get(key)
    if s is None:
        s = build_schedule(plan)
        if len(_SCHEDULES) >= _SCHEDULES_MAX:
            _SCHEDULES.pop(next(iter(_SCHEDULES)))
        _SCHEDULES[key] = s
    if len(_BY_PLAN) >= _SCHEDULES_MAX:
        _BY_PLAN.pop(next(iter(_BY_PLAN)))
    _BY_PLAN[id(plan)] = (plan, derived, s)
    return s


def clear_schedules() -> None:
    _SCHEDULES.clear()
    _BY_PLAN.clear()


def _peaks(plan: Plan, sched: Schedule) -> tuple[int, int]:
    """Peak device and host bytes of the runtime's buffers over one step (an accumulation
    boundary, the heavier case), by walking the visits as the runtime does (see _walk)."""
    return walk_peaks(plan, sched)


def walk_peaks(plan: Plan, sched: Schedule, which: Optional[str] = None) -> tuple[int, int]:
    """(device, host) peak bytes of one walk of the schedule (_walk's `which`; None: both), with
    the buffers still draining. walk_peaks(plan, sched, "base") of a speculative plan is what a
    step that defers its updates holds (the runtime paces its pools to it: runtime/memory.py)."""
    devs, hosts, _ = _walk(plan, sched, which)
    return max(devs) + drain_device_bytes(plan), max(hosts) + drain_host_bytes(plan)


def _walk(plan: Plan, sched: Schedule, which: Optional[str] = None) -> tuple[list[int], list[int], list[set]]:
    """Per visit: device bytes, host bytes, and the units whose weights are in device memory
    (the buffers of `holds`, with this plan's placements; where a visit has two walks, the larger
    bytes and the units both hold). which: "base" or "speculative", that walk only (visits it
    does not walk: nothing)."""
    cdt = plan.compute_dtype
    place = {p.unit: p for p in plan.placements}
    wb = {u.name: u.weights_bytes(cdt) for u in plan.units}
    tb = {u.name: held_weights_bytes(plan, u, False) for u in plan.units}  # (no frozen segment)
    ob = {u.name: optim_host_bytes(plan, u, place[u.name]) for u in plan.units}
    fb = {u.name: fetch_host_bytes(plan, u, place[u.name]) for u in plan.units}
    kb = {u.name: kept_grad_bytes(plan, u, place[u.name]) for u in plan.units}
    sb = {u.name: kept_host_bytes(plan, u, place[u.name]) for u in plan.units}
    n = len(sched.visits)
    devs, hosts, helds = [0] * n, [0] * n, [None] * n
    for h in holds(plan, sched):
        if which is not None and h.speculative != (which == "speculative"):
            continue
        held = {x for x in h.device if place[x].weights is not Tier.DEVICE}
        i = h.visit
        devs[i] = max(devs[i], sum(wb[x] if x in h.computing else tb[x] for x in held) + h.grads)
        host = sum(ob[x] for x in h.window) + sum(kb[x] for x in h.kept) + sum(sb[x] for x in h.kept_shards)
        host += sum(fb[x] for x in h.fetching)
        hosts[i] = max(hosts[i], host)
        helds[i] = held if helds[i] is None else helds[i] & held
    return devs, hosts, [h if h is not None else set() for h in helds]


def _fill_gaps(plan: Plan, sched: Schedule) -> tuple[frozenset[str], ...]:
    """`alive`, with units kept between two uses wherever that does not raise either peak.

    Note: why. The peak of a step is set by its heaviest moment (for a tied GPT-2 on the CPU,
    the end of backward: the embeddings' master, gradients and moments at once). Elsewhere the
    budget has room, and a unit read twice in a step (the embeddings: at the first visit and by
    the tied head; the last blocks: in forward and again in backward) can simply stay: the same
    memory, less SSD traffic. Largest units first.
    """
    devs, hosts, helds = _walk(plan, sched)
    peak_dev, peak_host = max(devs), max(hosts)
    specs = {u.name: u for u in plan.units}
    place = {p.unit: p for p in plan.placements}
    cdt = plan.compute_dtype
    alive = [set(a) for a in sched.alive]
    uses: dict[str, list[int]] = {}
    for v in sched.visits:
        for name in v.needs:
            uses.setdefault(name, []).append(v.index)
    for name in sorted(uses, key=lambda n: (-specs[n].weights_bytes(cdt), n)):
        if place[name].weights is Tier.DEVICE:
            continue
        w = specs[name].weights_bytes(cdt)
        w_host = fetch_host_bytes(plan, specs[name], place[name])
        for a, b in zip(uses[name], uses[name][1:]):
            gap = [i for i in range(a + 1, b) if name not in helds[i]]
            if gap and all(devs[i] + w <= peak_dev and hosts[i] + w_host <= peak_host for i in gap):
                for i in gap:
                    alive[i].add(name)
                    helds[i].add(name)
                    devs[i] += w
                    hosts[i] += w_host
    return tuple(frozenset(a) for a in alive)
