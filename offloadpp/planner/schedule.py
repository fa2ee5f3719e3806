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

Note on updates' copies. With 16-bit compute an update writes a new compute copy of the unit's
weights, in a buffer of the pool the copy lives in (Plan.compute_copy_on_device): on CUDA and
over several ranks a host buffer (optim_host_bytes), on the CPU acting as the device a device
buffer. There an update that runs in backward (not deferred, or speculated) takes it at the
unit's backward visit, whether or not that visit holds the weights: a visit that does not (an
embedding's: its backward needs no weights) still holds the copy its update makes (holds). Not
counting it there was issue 37's under-count: GPT-2 in bf16 without clipping, whose tied
embeddings' new copy came on top of the blocks kept for the next forward, waited 60 s and raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Mapping, Optional

from .decide import lazy_runtime
from .plan import DTYPE_BYTES, Plan, Tier


@dataclass(frozen=True)
class Visit:
    index: int
    unit: str
    backward: bool
    needs: tuple[str, ...]  # units whose weights must be on the device while this visit runs


@dataclass(frozen=True)
class Schedule:
    visits: tuple[Visit, ...]  # forward visits, then backward visits
    alive: tuple[frozenset[str], ...]  # weights held while visit i runs (needed by visits i..i+k)
    update_order: tuple[str, ...]  # units in the order the optimizer updates them (see Note)
    prefetch_depth: int  # k: alive[i] spans visits i..i+k
    next_keep: frozenset[str]  # updated weights kept in memory for the next forward (see Note)
    keep_until_update: frozenset[str]  # weights (== master) kept from an early backward use to the update
    optim_prefetch_depth: int  # q: state of updates i..i+q is read ahead
    peak_device_bytes: int  # runtime buffers on the device (weights, one unit's grads)
    peak_host_bytes: int  # runtime buffers in host memory, resident arrays included
    absorb_order: tuple[str, ...] = ()  # units in the order their gradients complete (backward)
    # a speculative plan: the units next_keep names for a step that speculates (its updates run in
    # backward, so a kept unit is held through the rest of it; next_keep is the deferred step's)
    spec_next_keep: frozenset[str] = frozenset()
    forward_index: Mapping[str, int] = field(compare=False, repr=False, default_factory=dict)
    backward_index: Mapping[str, int] = field(compare=False, repr=False, default_factory=dict)
    next_keep_until: Mapping[str, int] = field(compare=False, repr=False, default_factory=dict)

    @property
    def num_forward(self) -> int:
        return len(self.forward_index)

    def window_at(self, submitted: int) -> tuple[str, ...]:
        """Units whose optimizer state is wanted once `submitted` updates were handed out."""
        n = len(self.update_order)
        return self.update_order[max(0, submitted - 1) : min(n, submitted + self.optim_prefetch_depth + 1)]


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
    if plan.fill_gaps and (_alias(plan) or plan.ranks > 1):
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
    if _alias(plan) and not plan.deferred_update:
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
    return {n: next(i for i, a in enumerate(sched.alive) if n in a) for n in names}


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


def _alias(plan: Plan) -> bool:
    """On the CPU device with fp32 compute a unit's device weights are its host master buffer
    (one rank: over several, the device buffer is gathered from every rank's master shard)."""
    return plan.device == "cpu" and not plan.separate_weights and plan.ranks == 1


def staged_fetch(plan: Plan) -> bool:
    """A fetch reads the weights' home into a host buffer of its own before they reach the
    device: on CUDA (the pinned copy), and over several ranks (this rank's shard, which the
    gather then spreads into the whole unit's device buffer)."""
    return plan.device != "cpu" or plan.ranks > 1


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


def drain_host_bytes(plan: Plan) -> int:
    """One unit's worth of host buffers for writes still draining (the pool waits for them
    beyond it), and the resident host arrays."""
    drain = max((optim_host_bytes(plan, u, p) for u, p in plan), default=0)
    return drain + plan.resident_host_bytes()


def drain_device_bytes(plan: Plan) -> int:
    """As drain_host_bytes, on the device: a master still being written where the weights
    alias it (CPU, fp32), and the resident device weights."""
    drain = max((u.master_bytes for u, p in plan if p.master is Tier.SSD), default=0) if _alias(plan) else 0
    return drain + plan.resident_device_bytes()


def optim_host_bytes(plan: Plan, u, p) -> int:
    """Host bytes the optimizer holds for one unit in its window."""
    cdt = plan.compute_dtype
    b = 0
    if p.moments is Tier.SSD:
        b += u.moments_bytes
    if p.master is Tier.SSD and not _alias(plan):
        b += u.master_bytes
    if plan.separate_weights and p.weights is not Tier.HOST and not plan.compute_copy_on_device:
        b += u.weights_home_bytes(cdt)  # the new compute copy the update writes (else: holds, device)
    if plan.ranks > 1:
        # the whole unit's fp32 gradients the ranks reduce (persistent with accumulation) and
        # this rank's reduced shard (kept for a deferred update); CUDA: the pinned staging too
        if not (plan.accumulate_grads and p.grads is Tier.HOST):
            b += u.grad_bytes
        if not (plan.deferred_update and p.grads is Tier.HOST):
            b += u.shard_grad_bytes
        if plan.device != "cpu":
            b += u.padded_numel * DTYPE_BYTES[cdt]
        return b
    if plan.persistent_grads:
        if p.grads is Tier.SSD:
            b += plan.grad_bytes(u)
    elif plan.device != "cpu":
        b += plan.grad_bytes(u) + u.padded_numel * DTYPE_BYTES[cdt]  # host grads + pinned staging
    # (on the CPU device, transient grads are the device's own: counted there)
    return b


@dataclass(frozen=True)
class Holds:
    """Per visit, the units whose buffers are held (names; the placements decide the bytes):
    `device`: weights in device memory (before dropping those resident on the device anyway),
    `window`: the optimizer's read-ahead window, `fetching`: weights being fetched (CUDA: a pinned
    host copy each, where they come from SSD), `grads`: the bytes of the visit's own gradients,
    `kept`: units whose gradient buffers are kept past their update (speculation), `visit`: the
    visit (a speculative plan has two walks of its backward visits: see holds)."""

    device: frozenset[str]
    window: tuple[str, ...]
    fetching: frozenset[str]
    grads: int
    kept: tuple[str, ...] = ()
    visit: int = 0
    speculative: bool = False  # of a speculative plan's walk of a step that speculates
    kept_shards: frozenset[str] = frozenset()  # over several ranks: updated shards kept for the next forward
    # the units of `device` held for computing (alive): their frozen segment too; the others (the
    # optimizer's masters, updated weights kept for the next forward) hold the trainable weights
    # only (UnitSpec's Note on frozen parameters)
    computing: frozenset[str] = frozenset()


def held_weights_bytes(plan: Plan, u, computing: bool) -> int:
    """Device bytes of unit u's weights held at a visit: both segments where it computes (or is
    fetched for it), else its trainable weights only (held for the optimizer or the next forward)."""
    wb = u.weights_bytes(plan.compute_dtype)
    return wb if computing else wb - u.frozen_bytes(plan.compute_dtype)


def holds(plan: Plan, sched: Schedule) -> list[Holds]:
    """What _walk counts at each visit, independent of the placements.

    Device: the weights `alive` holds; the unit's gradients in its backward visit; updated units
    kept for the next forward; with the weights aliasing the master (CPU, fp32), also the masters
    the optimizer holds (its window, units kept until their update). Host: the optimizer window's
    moments (and master, compute copy, gradients where they are separate), a pinned copy per
    weights fetch in flight where the device is separate. Resident arrays are not included.
    """
    alias = _alias(plan)
    specs = {u.name: u for u in plan.units}
    first_backward = len(sched.forward_index)
    tied = tied_partial_bytes(plan, sched)
    out = []
    for v in sched.visits:
        # units handed to Adam, about (a deferred update hands none out before backward ends)
        seen = v.index - first_backward + 1 if v.backward and not plan.deferred_update else 0
        # (a deferred update's window is read from the start of backward: optimizer.begin_backward)
        window = sched.window_at(seen) if v.backward or not plan.deferred_update else ()
        updated = {w.unit for w in sched.visits[first_backward : v.index]} if v.backward else set()
        kept = sched.next_keep & updated
        if not v.backward:
            # kept from the previous step's updates until first held, beyond the first two
            # visits (_keep_across). (A unit of alive[1] is held at visit 0 too, and not counted
            # here: as before _keep_across, one unit at most, rarely the peak.)
            kept |= {n for n, t in sched.next_keep_until.items() if 2 <= t and v.index < t}
        held = set(sched.alive[v.index])
        if plan.ranks == 1:
            held |= kept  # the compute copy kept is the device's (over several ranks: the host shard)
        if alias:
            held |= set(window)
            if v.backward:
                held |= {n for n in sched.keep_until_update if n not in updated}
        if v.backward and not plan.deferred_update and plan.compute_copy_on_device:
            held.add(v.unit)  # the new compute copy its update writes (the Note on updates' copies)
        grads = visit_grad_bytes(plan, specs[v.unit]) + tied.get(v.index, 0) if v.backward else 0
        fetching = sched.alive[v.index] if staged_fetch(plan) else frozenset()
        shards = frozenset(kept) if plan.ranks > 1 else frozenset()
        out.append(Holds(frozenset(held), tuple(window), fetching, grads, visit=v.index, kept_shards=shards,
                         computing=frozenset(sched.alive[v.index])))  # fmt: skip
    if plan.speculative:
        out += _speculative_holds(plan, sched)
    return out


def _speculative_holds(plan: Plan, sched: Schedule) -> list[Holds]:
    """A speculative plan's backward visits in a step that speculates (holds walks the same visits
    deferring; a step does either, so each visit's peak is the larger of the two).

    Note: what a speculating step holds (runtime/optimizer.py). The state window slides over the
    order gradients complete in from the start of backward, as where updates are not deferred
    (q+2 units' state at a time); with clipping (a step may be redone) the gradients of the
    units the deferred window covers (update_order[:q+1]) stay held from their update until the
    step is validated, as deferring keeps them, and the others' go to their home. After backward,
    a redo or the updates of the
    units not speculated are the deferred ones, whose holds the deferred walk counts."""
    alias = _alias(plan)
    specs = {u.name: u for u in plan.units}
    first_backward = len(sched.forward_index)
    absorb, q = sched.absorb_order, sched.optim_prefetch_depth
    keep = set(sched.update_order[: q + 1]) if plan.clipping else set()  # (no clipping: no redo)
    tied = tied_partial_bytes(plan, sched)
    out = []
    for v in sched.visits[first_backward:]:
        seen = v.index - first_backward + 1
        window = absorb[max(0, seen - 1) : min(len(absorb), seen + q + 1)]
        updated = {w.unit for w in sched.visits[first_backward : v.index]}
        held = set(sched.alive[v.index]) | (sched.spec_next_keep & updated)
        if alias:
            held |= set(window)
        if plan.compute_copy_on_device:
            held.add(v.unit)  # the new compute copy its speculative update writes (holds)
        kept = tuple(n for n in absorb if n in updated and n in keep and n not in window)
        grads = visit_grad_bytes(plan, specs[v.unit]) + tied.get(v.index, 0)
        fetching = sched.alive[v.index] if plan.device != "cpu" else frozenset()
        out.append(Holds(frozenset(held), tuple(window), fetching, grads, kept, v.index, speculative=True,
                         computing=frozenset(sched.alive[v.index])))  # fmt: skip
    return out


def visit_grad_bytes(plan: Plan, u) -> int:
    """Device bytes of a unit's gradients at its backward visit: autograd's, in the compute
    dtype; in a vertical window's step (planner/vertical.py window_plan) with 16-bit compute on
    the CPU device, each micro-batch's own gradient, kept until the unit's are complete, and
    their sum rounded to Plan.window_grad_dtype (runtime/window_grads.py's Note); on an
    accelerator, one fp32 sum a parameter, added into as each micro-batch's gradient arrives and
    rounded once the parameter's last one has (so at most 4 bytes a parameter; issue 33's paper
    estimates with this count: 175B b8 x G4 313.0 s, clipped 447.6 s, 13B b8 x G4 22.6 s)."""
    cdt = plan.compute_dtype
    g = 1 if plan.accumulate_grads else plan.micro_batches
    if g == 1 or cdt == "fp32":
        return u.padded_numel * DTYPE_BYTES[cdt]
    if plan.device != "cpu":
        return u.padded_numel * DTYPE_BYTES["fp32"]
    return u.padded_numel * (g * DTYPE_BYTES[cdt] + DTYPE_BYTES[plan.window_grad_dtype])


def tied_partial_bytes(plan: Plan, sched: Schedule) -> dict[int, int]:
    """{backward visit: bytes} of a CPU vertical window's tied gradients in flight: a unit that
    borrows another's weights (an output projection tied to the embedding) makes each
    micro-batch's gradient of them at its visit, and each is kept in 16 bits until the owner's
    visit adds that micro-batch's own (runtime/window_grads.py: as that micro-batch's
    AccumulateGrad would), so G of them are held through every visit between (the owner's
    padded size: an upper bound of the tied parameters'). Empty where visit_grad_bytes counts
    one micro-batch's gradients."""
    g = 1 if plan.accumulate_grads else plan.micro_batches
    if (
        g == 1
        or plan.compute_dtype == "fp32"
        or plan.device != "cpu"
        or not any(u.borrows for u in plan.units)
    ):
        return {}
    specs = {u.name: u for u in plan.units}
    per = g * DTYPE_BYTES[plan.compute_dtype]
    out, open_ = {}, set()
    for v in sched.visits:
        if not v.backward:
            continue
        open_.discard(v.unit)  # (the owner's visit: its kept gradients are visit_grad_bytes')
        open_ |= set(specs[v.unit].borrows) - {v.unit}
        if open_:
            out[v.index] = sum(specs[n].padded_numel for n in open_) * per
    return out


def kept_grad_bytes(plan: Plan, u, p) -> int:
    """Host bytes of a unit's gradient buffer kept past its update (Holds.kept): where its home
    is SSD (a resident one is counted with the resident arrays)."""
    return plan.grad_bytes(u) if plan.persistent_grads and p.grads is Tier.SSD else 0


def fetch_host_bytes(plan: Plan, u, p) -> int:
    """Host bytes of a unit's weights being fetched (staged_fetch): its home, read from SSD, and
    its frozen segment, staged the same way wherever the unit's weights are not resident."""
    if not staged_fetch(plan):
        return 0
    frozen = u.frozen_bytes(plan.compute_dtype) if u.frozen_numel and plan.frozen_home(p) is Tier.SSD else 0
    return (u.weights_home_bytes(plan.compute_dtype) if p.weights is Tier.SSD else 0) + frozen


def kept_host_bytes(plan: Plan, u, p) -> int:
    """Over several ranks, host bytes of a unit's updated shard kept for the next forward."""
    return u.weights_home_bytes(plan.compute_dtype) if plan.ranks > 1 and p.weights is not Tier.HOST else 0


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
