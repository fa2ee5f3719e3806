"""SSD bytes a replay of a plan certainly moves beyond those cost.lower_bound counts: a tighter
bound the search settles candidates with (settle.py), from the plan, its schedule and its
activations' sizes alone (no replay).

Note: what is certain, and why. cost.lower_bound counts, of the weights, one read per step (for
the next forward) and, of the gradients, nothing. Where a step's weights and gradients cross the
SSD more often, the bound sits below every replay of the placement whatever its activations
(issue 36's sweep, random profile 18, 13B fp16 b32: bound 67.2 s, the replays' SSD time 72.4 s,
the best 71.4 s: each of the placement's activation choices was replayed to learn it loses).
Counted here, where the replay's rules make them certain (simulate.py, simulate_units.py), on
CUDA, one rank, one micro-batch, no update applied at the next visit (its pending copy changes
what a fetch finds):
- weights whose home is SSD, read again in backward: a unit not in the next forward's kept set
  (next_keep, spec_next_keep: their buffers hold NEXT) that the schedule drops after its forward
  use and holds again at or before its own backward visit. There its source slot is EMPTY: the
  step's COMPUTE hold went at the drop; its own update (OPTIM) comes after its backward visit;
  the last step's updates completed at that step's end (finish) and their queued writes (WRITE)
  were flushed by forward visit min(k, forward visits - 1). An EMPTY slot of an array on disk is
  read (Slot.acquire), whatever the timing.
- gradients of a deferred update whose home is SSD, of units that do not speculate: written
  after their backward (Sim.on_grads: not among the first q + 1 of the update order, whose
  gradients stay held, nor the last of the absorb order, whose writes wait for the next forward)
  and read back for the update after backward (run_deferred: every job completed by finish
  first, so the slot is EMPTY and on disk).
- activations written to SSD (certain_act_moves' second count): lower_bound leaves activation traffic out, as
  a swap-out not started when backward wants its unit is cancelled. But a swap-out started is
  finished (the worker copies its records, then writes the whole to SSD, before the unit's
  backward fetches it), and the room forces starts: the forward adds its last part only once it
  fits the activation room beside what is held, or once the copies before it are done (the
  queue is empty, or its head is that unit's own, waiting for its next piece). So at that point
  the worker (one queue, forward order, empty at forward's start) has copied out at least all
  the forward saved less the room (and a grad_in_forward head's released input), or every copy
  of the units before the last: the jobs to SSD within the first of those are written.
  (Random profile 21, 13B bf16 b64: candidates sending partial pieces to SSD replay at 50-167 s,
  the best 47.4 s, their bound 41-43 s: 103 replays, 34 with these writes.)
- activations copied out over the device-to-host link (certain_act_moves): the same copies, to
  host memory or on their way to SSD. A copy started copies every record of its unit over the
  link (simulate_act's worker: each record is submitted to the link before its bytes are freed on
  the device, so a copy that has freed its bytes has moved them), and the copies the room forces
  within forward are done by its last part, as above. lower_bound's link term counts, of the
  device-to-host link, only each gradient leaving once; these bytes are other transfers on it
  within the same step. (Random profile 1, 13B fp16 b128: candidates with partial_host outputs
  replay at 1.5-3.1x the best, the link set by these copies, their bound 0.70-0.94x.)
  Both counts of activations rest on the replay's device holding no activation bytes below 0 at
  forward's start. At random profile 27, Llama 7B b64 (a candidate with partial_host units
  before kept ones) it held -2.69 GB from the first step's backward on: that backward fetched
  the last swapped unit while its copy out still ran, and ActReplay.before_backward took the
  unit's other pieces (`rest`) before that fetch set them, so they were never counted back
  (fixed since: before_backward counts them once the late fetch sets them; the test
  `test_a_block_fetched_while_its_copy_out_runs_gives_back_what_it_holds`). There fewer copies
  were forced than counted; every replay checked still moved these bytes (docs/performance.md,
  session 11). The phase bound s11time tried (forward's copies, then backward's compute) failed
  its check at that point only; it may hold now, unproven.
Each is at most what a replay moves, so lower_bound with the SSD term raised by these bytes, and
its link term by the copies out, is still a bound (tests/test_certain_io.py replays random points
against it).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Mapping, Optional

from .activations import GRAD_IN_FORWARD
from .cost import _model_acts, _plan_terms, _speculates, lower_bound
from .decide import lazy_applies
from .hardware import HardwareProfile
from .model_profile import ModelProfile
from .plan import DTYPE_BYTES, Plan, Tier
from .request import Request
from .schedule import cached_schedule
from .simulate_act import ActReplay
from .simulate_memo import shared_sizes

# (the search asks this of each placement's activation choices in turn: found once per plan;
# keyed by identity, the plan held in the entry so its id is not reused while it is there)
_EXTRA: dict[tuple, tuple] = {}
_EXTRA_MAX = 64


def certain_extra_bytes(plan: Plan, micro_batches: int = 1) -> tuple[int, int]:
    """(read, written) SSD bytes every replay of `plan` moves per step beyond lower_bound's
    (the module Note); (0, 0) outside the case it covers."""
    key = (id(plan), micro_batches)
    e = _EXTRA.get(key)
    if e is not None and e[0] is plan:
        return e[1]
    got = _find_extra(plan, micro_batches)
    if len(_EXTRA) >= _EXTRA_MAX:
        _EXTRA.pop(next(iter(_EXTRA)))
    _EXTRA[key] = (plan, got)
    return got


def _find_extra(plan: Plan, micro_batches: int) -> tuple[int, int]:
    if plan.device != "cuda" or plan.ranks != 1 or micro_batches != 1 or plan.micro_batches != 1:
        return 0, 0
    if lazy_applies(plan):
        return 0, 0
    sched = cached_schedule(plan)
    nf, alive = sched.num_forward, sched.alive
    kept = sched.next_keep | sched.spec_next_keep
    cdt = DTYPE_BYTES[plan.compute_dtype]
    gdt = DTYPE_BYTES[plan.grad_dtype]
    q = sched.optim_prefetch_depth
    window = set(sched.update_order[: q + 1])  # gradients held for the first updates
    last = sched.absorb_order[-1] if sched.absorb_order else None
    read = written = 0
    for u, p in plan:
        homes = plan.homes(u, p)
        n = min(u.padded_numel, u.shard_numel)
        if plan.separate_weights and homes.get("weights") is Tier.SSD and u.name not in kept:
            b = sched.backward_index[u.name]
            if any(u.name in alive[i] and u.name not in alive[i - 1] for i in range(nf, b + 1)):
                read += n * cdt
        if (
            plan.deferred_update
            and homes.get("grads") is Tier.SSD
            and not _speculates(plan, u, p)
            and u.name not in window
            and u.name != last
        ):
            read += n * gdt
            written += n * gdt
    return read, written


def certain_act_moves(plan: Plan, model: ModelProfile, activations: Mapping[str, str],
                      micro_batches: int = 1) -> tuple[int, int]:  # fmt: skip
    """(bytes copied out over the device-to-host link, bytes written to SSD) of activations, per
    step, by every replay of `plan` with `activations`: the copies out the device's activation
    room forces within forward (the module Note, activations and their copies out)."""
    budget = plan.budgets.activation_bytes if plan.budgets is not None else None
    if (budget is None or plan.device != "cuda" or plan.ranks != 1 or micro_batches != 1
            or plan.micro_batches != 1 or len(plan.units) < 2
            or not any(p != "keep" for p in activations.values())):  # fmt: skip
        return 0, 0
    saved, units = _model_acts(model)
    terms = _unit_terms(saved, units)
    added = released = 0
    jobs: list[tuple[int, int]] = []  # (bytes freed, written to SSD) of the copies out, worker's order
    for u in plan.units:  # (forward order)
        a, r, out = terms(u.name, activations.get(u.name, "keep"))
        added += a
        released += r
        if out is not None:
            jobs.append(out)
    last = terms(plan.units[-1].name, activations.get(plan.units[-1].name, "keep"))[2]
    before_last = jobs[:-1] if last is not None else jobs
    # the last forward part is added only once the room holds it or the copies before it are done
    copied = added - budget - released  # (the device holds nothing below 0 at forward's start)
    prefix, done = 0, 0
    for freed, written in jobs:
        if prefix + freed > copied:
            break
        prefix += freed
        done += written
    # (a job's freed bytes are the records it copies over the link: simulate_act's worker)
    return min(prefix, sum(f for f, _ in before_last)), min(done, sum(w for _, w in before_last))


def _unit_terms(saved: Mapping[str, int], units: Mapping) -> Callable:
    """(unit, policy) -> what its forward adds to the room, releases, and copies out: a unit's
    are functions of its profile and its own policy, kept with the replay's shared sizes of the
    model's activation units (simulate_memo.shared_sizes, cost._model_acts' mapping)."""
    memo = shared_sizes(units)
    if memo is None:
        memo = {}

    def terms(name: str, policy: str) -> tuple:
        key = ("certain_io.terms", name, policy)
        got = memo.get(key)
        if got is None:
            # the replay's own sizes (simulate_act.ActReplay), for this unit under this policy
            act = ActReplay(_NO_SIM, {name: policy}, saved, 1, None, units)
            added = sum(b for _, b in act.forward_parts(name))
            gif = act.policy(name) == GRAD_IN_FORWARD and name in act.units
            out = act._out_shape(name)
            job = None
            if out is not None:  # (the bytes its records free as copied, simulate_act's worker; written: all)
                n, to_ssd, pieces, _, parts = out
                freed = sum(sum(r) for r in parts) if parts else sum(pieces) if pieces else n
                job = (freed, n if to_ssd else 0)
            got = memo[key] = (added, act.units[name].loss_input if gif else 0, job)  # fmt: skip
        return got

    return terms


_NO_SIM = SimpleNamespace(sched=SimpleNamespace(visits=()))  # (ActReplay reads its backward order)


def tight_bound(lb: float, plan: Plan, hardware: HardwareProfile, model: ModelProfile, req: Request, *,
                activations: Optional[Mapping[str, str]] = None, need: Optional[float] = None) -> float:  # fmt: skip
    """`lb` (cost.lower_bound of `plan` with `activations`, for `req`'s Adam threads, micro-batches
    and link) raised to the SSD time of the bytes it counts plus certain_extra_bytes and
    certain_act_moves' SSD writes, and to the device-to-host link's time of its gradients plus the
    activations certain_act_moves copies out: no replay of the plan is faster.
    `need`: the caller asks only whether the bound exceeds it; where even every streamed
    weights and gradient counted could not, certain_extra_bytes (which builds the plan's
    schedule, for candidates most of which are never replayed) is left out."""
    micro_batches = req.micro_batches
    out_act, w_act = (
        certain_act_moves(plan, model, activations, micro_batches) if activations is not None else (0, 0)
    )
    t = _plan_terms(plan, hardware, model, req.adam_threads, micro_batches, req.link)
    if out_act:  # (only on CUDA, one rank, one micro-batch: lower_bound's link is the hardware's)
        lb = max(lb, _link_bound(plan, hardware, out_act))
    rb, wb = hardware.ssd_rates()
    if need is not None:
        r_hi, w_hi = _extra_at_most(plan)
        if t.ssd + (w_act + w_hi) / (wb * 1e9) + r_hi / (rb * 1e9) <= need:
            r = w = 0
        else:
            r, w = certain_extra_bytes(plan, micro_batches)
    else:
        r, w = certain_extra_bytes(plan, micro_batches)
    w += w_act
    if not (r or w):
        return lb
    # (the replay sums the same bytes in another order: a rounding below its SSD time, not above)
    return max(lb, (t.ssd + r / (rb * 1e9) + w / (wb * 1e9)) * (1 - 1e-12))


def _link_bound(plan: Plan, hardware: HardwareProfile, out_act: int) -> float:
    """The device-to-host link's time for lower_bound's bytes on it (each gradient leaving once:
    cost._find_plan_terms, one micro-batch) and `out_act` bytes of activations copied out."""
    grads = sum(u.numel for u in plan.units) * DTYPE_BYTES[plan.compute_dtype]
    # (the replay sums the same bytes in another order: a rounding below its link time, not above)
    return (grads + out_act) / (hardware.d2h_gbps * 1e9) * (1 - 1e-12)


def tight_lower_bound(plan: Plan, hardware: HardwareProfile, model: ModelProfile, req: Request,
                      activations: Mapping[str, str]) -> float:  # fmt: skip
    """cost.lower_bound of `plan` with `activations` for `req`, raised by tight_bound: no replay
    of it on `hardware` is faster (the search's reach and the robust pick's floor on the slow
    SSD)."""
    lb = lower_bound(plan, hardware, model, adam_threads=req.adam_threads, micro_batches=req.micro_batches,
                     activations=activations, link=req.link)  # fmt: skip
    return tight_bound(lb, plan, hardware, model, req, activations=activations)


def _extra_at_most(plan: Plan) -> tuple[int, int]:
    """certain_extra_bytes' most, without the schedule: every streamed weights read again, every
    gradient on SSD written and read back."""
    cdt, gdt = DTYPE_BYTES[plan.compute_dtype], DTYPE_BYTES[plan.grad_dtype]
    read = written = 0
    for u, p in plan:
        homes = plan.homes(u, p)
        n = u.padded_numel
        if plan.separate_weights and homes.get("weights") is Tier.SSD:
            read += n * cdt
        if plan.deferred_update and homes.get("grads") is Tier.SSD:
            read += n * gdt
            written += n * gdt
    return read, written


def clear_certain() -> None:
    """Forgets the certain bytes found so far (peaks.clear_cache: planning from nothing)."""
    _EXTRA.clear()  # (the unit terms go with the replay's shared sizes: peaks.clear_cache)


__all__ = [
    "certain_act_moves",
    "certain_extra_bytes",
    "clear_certain",
    "tight_bound",
    "tight_lower_bound",
]
