"""What a schedule holds (planner/schedule.py): per visit, the units whose buffers are held
(`holds`, independent of where arrays live), and the bytes of each buffer a placement gives them
(the optimizer's window, a fetch's staging copy, gradients kept, drains). schedule._walk and
peaks.PeakModel add them up with a plan's placements. Pure (no torch).

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

from dataclasses import dataclass

from .plan import DTYPE_BYTES, Plan, Tier
from .visits import Schedule


def alias_master(plan: Plan) -> bool:
    """On the CPU device with fp32 compute a unit's device weights are its host master buffer
    (one rank: over several, the device buffer is gathered from every rank's master shard)."""
    return plan.device == "cpu" and not plan.separate_weights and plan.ranks == 1


def staged_fetch(plan: Plan) -> bool:
    """A fetch reads the weights' home into a host buffer of its own before they reach the
    device: on CUDA (the pinned copy), and over several ranks (this rank's shard, which the
    gather then spreads into the whole unit's device buffer)."""
    return plan.device != "cpu" or plan.ranks > 1


def drain_host_bytes(plan: Plan) -> int:
    """One unit's worth of host buffers for writes still draining (the pool waits for them
    beyond it), and the resident host arrays."""
    drain = max((optim_host_bytes(plan, u, p) for u, p in plan), default=0)
    return drain + plan.resident_host_bytes()


def drain_device_bytes(plan: Plan) -> int:
    """As drain_host_bytes, on the device: a master still being written where the weights
    alias it (CPU, fp32), and the resident device weights."""
    drain = (
        max((u.master_bytes for u, p in plan if p.master is Tier.SSD), default=0) if alias_master(plan) else 0
    )
    return drain + plan.resident_device_bytes()


def optim_host_bytes(plan: Plan, u, p) -> int:
    """Host bytes the optimizer holds for one unit in its window."""
    cdt = plan.compute_dtype
    b = 0
    if p.moments is Tier.SSD:
        b += u.moments_bytes
    if p.master is Tier.SSD and not alias_master(plan):
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
    alias = alias_master(plan)
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
    alias = alias_master(plan)
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


__all__ = [
    "Holds",
    "alias_master",
    "drain_device_bytes",
    "drain_host_bytes",
    "fetch_host_bytes",
    "held_weights_bytes",
    "holds",
    "kept_grad_bytes",
    "kept_host_bytes",
    "optim_host_bytes",
    "staged_fetch",
    "tied_partial_bytes",
    "visit_grad_bytes",
]
