"""The planner: plan(hardware, model, req) -> Plan, the placement with the least estimated step.

Pure (no torch). Candidates are enumerated within the budgets and each is scored with the cost
model (cost.py); the least estimated step time wins.

Note: the candidates.
  1. Prefetch depths: weights k in 0..MAX_PREFETCH and optimizer read-ahead q in 0..MAX_OPTIM
     (or the caller's fixed values), each pair's streaming working set (every array on SSD)
     checked against the budgets with the schedule the runtime walks, with room left on the
     device for the least the activations need (planner/activations.py).
  2. For each pair, what to keep in memory with the budget left over. Every (unit, array)
     that could stay resident is an *upgrade*: keep unit u's master (on the CPU device with fp32
     compute that is its weights too, from the device req, or from the host req), its
     moments, or (16-bit compute, CUDA) its compute weights on the device or host. An
     upgrade's value is the SSD (and link) bytes per step it saves (read and written once per
     step, weights read at each fetch the schedule makes); its price is the bytes it occupies.
     Upgrades are taken greedily by value per byte, each kept only if the schedule's peaks still
     fit. The fills a person would try by hand are made too: the default policy's, forward
     order with masters or moments first, backward order (FILLS). Where the activations count
     in the device budget, each fill is made twice: setting aside room for keeping every
     activation (or the activation budget), and only the least they need.
  3. Each placement leaves the activations the rest of the device budget (at most the
     activation budget); the activation choices that fit that room are paired with it.
  4. Every pair gets a lower bound from totals alone (cost.lower_bound); pairs are replayed
     (cost.replay) from the least bound up, until the next bound is beyond ROBUST_WINDOW of the
     best estimate: no pair left out could have been chosen.
     The best's activation choice is also replayed on a few other fills (Note on step 3), and
     where it mixes partial and recompute, with its split moved a unit at a time (act_refine.py).
  5. The least estimated step time wins, robustly: the candidates within NOMINAL_GIVE (1%) of the
     best are scored again with the SSD at 70% of its measured speed and the least mean of the
     two estimates wins (the disk's speed moves from run to run; a plan whose I/O is on the
     critical path pays for it); means within TIE_FRAC go to the plan moving fewer SSD bytes,
     but for one another such plan beats on both SSDs (robust_pick.py).
If nothing fits, an InfeasibleError says how many bytes each budget lacks for the smallest working
set (k = 0, q = 0), and which unit makes it that large; where the activations are what does not
fit, the largest micro-batch whose activations would.
"""

from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

from .act_candidates import ActChoice, ActPlanner, fixed_policies, untwinned
from .act_refine import balance
from .activations import act_units
from .candidate import Candidate
from .certain_io import tight_bound, tight_lower_bound
from .cost import MANY_UNITS, StepEstimate, lower_bound, replay
from .decide import speculates
from .default import plan_shape, streaming_plan
from .fills import _placements
from .hardware import HardwareProfile, IOPoint
from .infeasible import raise_infeasible
from .keep import explain
from .model_profile import ModelProfile
from .peaks import peak_bytes
from .plan import Plan, PlanError, Tier, all_on_ssd, fmt_bytes, shard_units
from .request import Request
from .robust_pick import (  # noqa: F401 (re-exported: the pick's numbers, named where the search is)
    MANY_NEAR,
    NOMINAL_GIVE,
    ROBUST_MAX,
    SLOW_SSD,
    TIE_FRAC,
    robust_pick,
    slow_hardware,
)
from .schedule import build_schedule
from .settle import Settled, activation_room
from .spec import Budgets
from .ssd_room import ssd_need_bytes

MAX_PREFETCH = 3
MAX_OPTIM = 3
ROBUST_WINDOW = 0.25  # the search replays candidates this far above the best estimate
# beyond MANY_UNITS units (cost.py: a replay walks every visit of each step) at most
# (8 and 3, from 10 and 6: 175B b8-b32 plan the same steps, 237.3 / 257.1 / 345.1 s, in 20% less
# time, 2026-12-03)
MANY_REPLAYS = 8  # placements are replayed, and the robust pick looks at MANY_NEAR candidates
RESCORE_GAIN = 0.05  # a new best is replayed on the slow SSD when it beats the last one by this
ACT_TOP_PLACEMENTS = 3  # the activation choices beyond the first are scored on this many placements
# Note on step 3: a placement is replayed first with its activation choice of least bound, and
# the bound leaves out the activations' link traffic, so where partial's outputs load the link
# that choice can make a placement look far worse than it is (random profile 1, 13B b128: every
# in-memory placement replayed only with partial_host, 144.8 s, the SSD-streaming ones' nested
# recompute 43.97 s; an in-memory one with nested: 40.72 s). So the best candidate's choice is
# replayed on the placements of ACT_TOP_PLACEMENTS other fills (placement rules), each at the
# best's depths where it has them: the bound barely tells such placements apart. And on its own
# fill at another k, where the first choice replayed may have been far worse (data-sheet 13B b48).


@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    candidates: tuple[Candidate, ...]  # every plan replayed, least estimate first
    pruned: int = 0  # candidates whose lower bound left them out of the replay

    @property
    def plan(self) -> Plan:
        return self.best.plan

    @property
    def activations(self) -> dict[str, str]:
        """The chosen activation policy of each unit that does not keep its activations."""
        return {u: p for u, p in self.best.activations if p != "keep"}


def _score(
    plan: Plan, hw: HardwareProfile, model: ModelProfile, req: Request, acts: Optional[dict] = None
) -> tuple[StepEstimate, dict]:
    return replay(plan, hw, model, adam_threads=req.adam_threads, micro_batches=req.micro_batches,
                  activations=acts or {}, act_prefetch_units=req.act_prefetch_units, link=req.link)  # fmt: skip


def act_planner(model: ModelProfile, req: Request, device: str) -> ActPlanner:
    names = [u.name for u in model.units]
    return ActPlanner(act_units(model), fixed_policies(req.settings.activations, names), device=device,
                      host_bytes=req.act_host_bytes, mixes=len(names) <= MANY_UNITS,
                      stage_units=req.act_prefetch_units)  # fmt: skip


def _depths(req: Request, n_units: int) -> list[tuple[int, int]]:
    ks = (
        [req.settings.prefetch_depth]
        if req.settings.prefetch_depth is not None
        else list(range(MAX_PREFETCH + 1))
    )
    top = max(0, n_units - 1)
    if req.settings.optim_prefetch_depth is not None:
        return [(k, req.settings.optim_prefetch_depth) for k in ks]
    qs = list(range(min(MAX_OPTIM, top) + 1))
    if req.settings.deferred_update and not speculates(req.settings) and top not in qs:
        # deferred updates run after backward: every unit's state read ahead during backward, the
        # read-ahead the resolve stage sizes the host budget for where it fits
        # (budgets._streaming_need; the peaks check drops it where it does not). Not for a
        # speculative step, whose updates run during backward: there it crowded out the
        # shallower depths that won (issue 36's property sweep, profile 1: 12.8 s against 9.7 s)
        qs.append(top)
    return [(k, q) for k in ks for q in qs]


@dataclass
class _Enumerated:
    """What a search enumerated (its candidates with their bounds) and what it replayed, for a
    search of the same inputs with another bar (Request.beat_s) in the same resolve (remembering)."""

    hardware: HardwareProfile
    model: ModelProfile
    units: list
    acts: ActPlanner
    groups: list  # (least bound, label, plan, [(bound, i, choice)])
    smallest: Optional[Plan]
    # (id(plan), slow SSD?, policies) -> _score's; every plan a search scores is one of `groups`',
    # held here as long as the entry, so no id is reused for another plan
    replays: dict = field(default_factory=dict)


# Note: the search remembered. With accumulation resolve searches the horizontal schedule up to
# twice, with another bar each time (resolve._with_window); the candidates, their bounds and any
# replay are the same. While resolve() runs (remembering), a search keeps them by its inputs
# (the profiles by identity, the request but its bar by value) and the next search of the same
# inputs starts from them.
_REMEMBERED: Optional[dict] = None


@contextmanager
def remembering() -> Iterator[None]:
    """Searches made inside share what they enumerated and replayed (the Note above), and the
    cycle collector waits (cost.replay's Note: the same holds of a search, whose candidates and
    their replays live until it returns and which makes no garbage that needs the collector).
    Nested and concurrent ones resume the collector only if it ran when they started."""
    global _REMEMBERED
    outer = _REMEMBERED
    _REMEMBERED = {} if outer is None else outer
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _REMEMBERED = outer
        if collecting:
            gc.enable()


def _enumerated(hardware: HardwareProfile, model: ModelProfile, req: Request) -> _Enumerated:
    key = (id(hardware), id(model), repr(replace(req, beat_s=None, prefer=None)))
    e = _REMEMBERED.get(key) if _REMEMBERED is not None else None
    if e is not None and e.hardware is hardware and e.model is model:
        return e
    e = _enumerate(hardware, model, req)
    if _REMEMBERED is not None:
        _REMEMBERED[key] = e
    return e


def search(hardware: HardwareProfile, model: ModelProfile, req: Request) -> SearchResult:
    e = _enumerated(hardware, model, req)
    units, acts, groups, counted = e.units, e.acts, e.groups, req.counted
    if not groups:
        raise_infeasible(e.smallest, req, acts, model)
    slow = slow_hardware(hardware)

    def score(plan: Plan, policies: dict, on_slow: bool = False) -> StepEstimate:
        key = (id(plan), on_slow, tuple(sorted(policies.items())))
        got = e.replays.get(key)
        if got is None:
            got = e.replays[key] = _score(plan, slow if on_slow else hardware, model, req, policies)[0]
        return got

    choice_of: dict[int, ActChoice] = {}  # id(candidate) -> its activation choice

    def candidate(label: str, plan: Plan, c: ActChoice) -> Candidate:
        est = score(plan, c.as_dict())
        got = Candidate(label + (f"; activations: {c.label}" if counted else ""), plan, est, c.policies)
        choice_of[id(got)] = c
        return got

    # 1. the placements, each with its activation choice of least bound, from the least bound up
    groups.sort(key=lambda g: g[0])
    cands: list[Candidate] = []
    best_s = float("inf")
    # a replay walks every visit of three steps: on models of many units, fewer of them
    max_replays = ROBUST_MAX if len(units) <= MANY_UNITS else MANY_REPLAYS
    slow_s: dict[int, float] = {}  # id(candidate) -> its estimate on the slow SSD
    # no candidate whose estimate is beyond the reach can win the robust pick; found lazily (the
    # Note on the reach below): `reach_of` is the best it is set by while its slow replay waits
    reach, reach_of, reach_lo = float("inf"), None, float("inf")
    # candidates whose bound says they cannot be picked are not replayed (settle.py's Note; not
    # where one is asked for by name, Request.prefer, which must be replayed)
    settled = Settled(on=req.window == 1 and req.prefer is None, give=NOMINAL_GIVE,
                      tighten=lambda p, lb, c, need: tight_bound(lb, p, hardware, model, req,
                                                                 activations=c.as_dict(), need=need))  # fmt: skip
    many = len(units) > MANY_UNITS
    n_tops, extra_tops = (1, 0) if many else (ACT_TOP_PLACEMENTS, 2)

    def beyond_reach(x: float) -> bool:
        """x > reach, the best's slow replay made only where its lower bound cannot say."""
        nonlocal reach, reach_of
        if reach_of is None:
            return x > reach
        if x <= reach_lo:
            return False
        slow_s[id(reach_of)] = score(reach_of.plan, dict(reach_of.activations), on_slow=True).step_s
        reach = (1 + TIE_FRAC) * (reach_of.estimate.step_s + slow_s[id(reach_of)]) / 2
        reach_of = None
        return x > reach

    for lb, label, plan, bounds in groups:
        if (
            len(cands) + len(settled.left) >= max_replays
            or _beaten(req, best_s, lb)
            or lb > best_s * (1 + ROBUST_WINDOW)
            or beyond_reach(lb)
        ):
            break
        c = bounds[0][2]
        if settled.settles(lb, label, plan, c, best_s, tops=(cands, n_tops, extra_tops)):
            continue
        cands.append(candidate(label, plan, c))
        if cands[-1].estimate.step_s < best_s:
            best = cands[-1]
            improved = best.estimate.step_s < best_s * (1 - RESCORE_GAIN)
            best_s = best.estimate.step_s
            if not improved:
                continue  # (the reach of a best only slightly worse still holds every contender)
            # Note: a slower SSD never makes a step shorter, so a candidate can win the robust
            # pick (the least mean of both estimates, to TIE_FRAC) only if its own estimate is
            # within TIE_FRAC of the best's mean: beyond that nothing needs replaying.
            # Note on the reach: the best's slow replay is made only when a bound is compared
            # with the reach and its lower bound on the slow SSD (cost.lower_bound: no replay
            # beats it) does not already put the reach above that bound: the same comparisons
            # come out, and a best superseded or never compared costs no slow replay
            reach_of = best
            floor = tight_lower_bound(best.plan, slow, model, req, dict(best.activations))
            reach_lo = (1 + TIE_FRAC) * (best_s + floor) / 2
    replayed = len(cands)
    # 2. the other activation choices of the best few placements
    cands.sort(key=lambda c: c.estimate.step_s)
    by_plan = {id(g[2]): g for g in groups}
    beaten = _beaten(req, best_s)
    for top in [] if beaten else _tops(cands, n_tops, extra=extra_tops):
        _, label, plan, bounds = by_plan[id(top.plan)]
        for lb, _, c in bounds[1:]:
            if not (lb > best_s * (1 + ROBUST_WINDOW) or beyond_reach(lb)):
                if settled.settles(lb, label, plan, c, best_s):
                    continue
                cands.append(candidate(label, plan, c))
                best_s = min(best_s, cands[-1].estimate.step_s)
                replayed += 1
    # 3. the best's activation choice on the placements it was not replayed with (Note on step 3)
    if not beaten and not many and cands:
        lead = min(cands, key=lambda c: c.estimate.step_s)
        want, depths = choice_of[id(lead)].label, (lead.plan.prefetch_depth, lead.plan.optim_prefetch_depth)
        tried = {_fill_of(c.label) for c in cands if choice_of[id(c)].label == want}
        tried |= {_fill_of(label) for label, _, c in settled.left if c.label == want}
        # per fill not tried with it: the placement at the best's depths, else its least bound
        per_fill: dict[str, tuple] = {}
        for i, (_, label, plan, bounds) in enumerate(groups):
            fill = _fill_of(label)
            if fill in tried:
                continue
            for lb, _, c in bounds:
                rank = ((plan.prefetch_depth, plan.optim_prefetch_depth) != depths, lb)
                if c.label == want and (fill not in per_fill or rank < per_fill[fill][0]):
                    per_fill[fill] = (rank, lb, i, c)
        others = sorted(per_fill.values(), key=lambda t: t[1])[:ACT_TOP_PLACEMENTS]
        # and on its own fill at the other weights' prefetch depth of least bound, with or without
        # its head twin (offered by the logits' share of the room: Note on step 3)
        done = {(id(c.plan), choice_of[id(c)].label) for c in cands} | settled.pairs()
        own = [(lb, i, c) for i, (_, label, plan, bounds) in enumerate(groups) for lb, _, c in bounds
               if _fill_of(label) == _fill_of(lead.label) and untwinned(c.label) == untwinned(want)
               and (id(plan), c.label) not in done and plan.prefetch_depth != depths[0]
               and plan.optim_prefetch_depth == depths[1]]  # fmt: skip
        others += [(None, lb, i, c) for lb, i, c in sorted(own, key=lambda t: t[0])[:1]]
        for _, lb, i, c in others:
            if lb > min(best_s * (1 + ROBUST_WINDOW), reach):
                break
            if settled.settles(lb, groups[i][1], groups[i][2], c, best_s):
                continue
            cands.append(candidate(groups[i][1], groups[i][2], c))
            best_s = min(best_s, cands[-1].estimate.step_s)
            replayed += 1
    # 4. the best's mix of partial and recompute, its split moved a unit at a time (act_refine.py)
    remixed = 0
    if not beaten and cands:
        lead = min(cands, key=lambda c: c.estimate.step_s)
        head = lead.label.split("; activations:")[0]

        def tried(c: ActChoice) -> float:
            cands.append(candidate(head, lead.plan, c))
            return cands[-1].estimate.step_s

        remixed = len(balance(acts, choice_of[id(lead)], lead.plan.budgets.activation_bytes, lead.estimate.step_s,
                              tried))  # fmt: skip
    replayed += remixed
    total = sum(len(g[3]) for g in groups) + remixed  # (the mixes made here were not enumerated)
    cands.sort(key=lambda c: c.estimate.step_s)
    if req.prefer is not None:
        best = next((c for c in cands if (c.label, c.activations) == req.prefer), None)
        if best is None:
            raise PlanError(f"the search replayed no candidate {req.prefer[0]!r} (Request.prefer)")
    elif beaten:
        best = cands[0]
    else:
        best = robust_pick(cands, hardware, model, req, slow_s, lambda p, a: score(p, a, on_slow=True))
    notes = (f"auto plan: estimated {best.estimate.step_s:.3f} s/step, bound by {best.estimate.bound} "
             f"({'the one asked for' if req.prefer is not None else 'best'} of {replayed} candidates replayed, "
             f"{total - replayed} left out by their lower bound"
             + (f"; none left could beat another schedule's {req.beat_s:.3f} s" if beaten else "") + ")",)  # fmt: skip
    best_plan = replace(
        best.plan, notes=notes + explain(replace(best.plan, placements=all_on_ssd(units)), best.plan)
    )
    if counted:
        best_plan = replace(best_plan, activations=tuple(p for _, p in best.activations))
    best = replace(best, plan=best_plan)
    return SearchResult(best, tuple(cands), total - replayed)


def _enumerate(hardware: HardwareProfile, model: ModelProfile, req: Request) -> _Enumerated:
    """The candidates: every placement at every depth, with the activation choices that fit the
    room it leaves and their lower bounds (the module Note, 1-4)."""
    units = shard_units(model.unit_specs(), req.ranks)
    b = req.budgets
    common = dict(device=hardware.device, budgets=b, micro_batches=req.window, **plan_shape(req.settings))
    acts = act_planner(model, req, hardware.device)
    counted = req.counted
    smallest: Optional[Plan] = None
    bases = []  # (k, q, the streaming plan, its device and host peaks)
    for k, q in _depths(req, len(units)):
        base = streaming_plan(units, prefetch_depth=k, optim_prefetch_depth=q, **common)
        if smallest is None or (k, q) < (smallest.prefetch_depth, smallest.optim_prefetch_depth):
            smallest = base
        bases.append((k, q, base, *peak_bytes(base)))
    least = least_need(acts, req, [(dev0, host0) for *_, dev0, host0 in bases]) if counted else 0
    held = acts.least_held.need_bytes if counted else 0
    if counted:
        # (and what swapping whole units needs, where partial pieces need less: the placements
        # that leave room for recomputing whole units are tried too)
        # (not on models of many units: each reserve enumerates the placements again, and 175B
        # must plan within 2 s)
        whole = acts.swap_all.need_bytes
        extra = {whole} if whole <= req.act_cap and len(units) <= MANY_UNITS else set()
        # the least room set aside is partial's, pieces' only at the depths partial's does not fit
        # (ActPlanner.least_partial: the same placements where it fits)
        part = acts.least_partial.need_bytes
        part = part if part <= req.act_cap else least
        reserves = sorted({min(req.act_cap, acts.keep_all.need_bytes), part} | extra, reverse=True)
    else:
        reserves, part = [0], 0
    fixed = acts._choice("settings", {})  # not counted: the settings' policies, others kept
    groups: list[tuple[float, str, Plan, list]] = []  # (least bound, label, plan, [(bound, i, choice)])
    alike: set = set()
    grain = max(1, sum(u.master_bytes + u.moments_bytes for u in units) // 1000)  # 0.1% of the state
    for k, q, base, dev0, host0 in bases:
        if host0 > b.host_bytes or dev0 + least > b.device_bytes or least > req.act_cap:
            continue
        tried: dict = {}
        # (at a depth partial's least room does not fit: pieces', or where that does not either the
        # refetching twin's; act_candidates.py, Note on refetch)
        low = [r for r in (held, least) if r < part and dev0 + r <= b.device_bytes][:1]
        for r in reserves + (low if dev0 + part > b.device_bytes else []):
            for placements, how in _placements(base, req, r).items():
                tried.setdefault(placements, how)
        for placements, how in tried.items():
            plan = replace(base, placements=placements, notes=())
            if req.ssd_free_bytes is not None and ssd_need_bytes(plan) > req.ssd_free_bytes:
                continue  # (ssd_room.py: the one SSD-room rule, resolve's and the preflight's)
            choices: tuple = (fixed,)
            if counted:
                room = min(req.act_cap, b.device_bytes - peak_bytes(plan)[0])
                choices = acts.candidates(room)
                plan = replace(plan, budgets=Budgets(b.device_bytes, b.host_bytes, activation_bytes=room))
            label = f"k={k} q={q} {how}"
            # placements keeping the same bytes in each tier (to 0.1% of the state) at these
            # depths behave alike: one of them is replayed (fills differ in which of equal units)
            same = (k, q, plan.resident_device_bytes() // grain, plan.resident_host_bytes() // grain,
                    plan.ssd_bytes() // grain, tuple(c.policies for c in choices))  # fmt: skip
            if same in alike:
                continue
            alike.add(same)
            bounds = [(_bound(plan, c, hardware, model, req), i, c) for i, c in enumerate(choices)]
            if bounds:
                groups.append((min(bounds)[0], label, plan, sorted(bounds)))
    return _Enumerated(hardware, model, units, acts, groups, smallest)


def least_need(acts: ActPlanner, req: Request, peaks: Sequence[tuple[int, int]]) -> int:
    """The least device bytes the activations need (acts.least), the room a depth must leave for
    the search to try it; with each derived argument's source held (acts.least_held) where that
    fits no depth (`peaks`: each depth's streaming plan's device and host peaks): the refetching
    twin's choices deepen the weights' prefetch of a point that runs without them, they do not
    make one run that does not (act_candidates.py, Note on refetch)."""
    b, least, held = req.budgets, acts.least.need_bytes, acts.least_held.need_bytes
    fits = held <= req.act_cap and any(
        dev + held <= b.device_bytes and host <= b.host_bytes for dev, host in peaks
    )
    return least if fits else held


def _beaten(req: Request, best_s: float, lb: float = float("inf")) -> bool:
    """The best replayed, and a candidate of lower bound `lb`, are slower than another schedule
    (Request.beat_s): neither can be chosen over it, so the search goes no further."""
    return req.beat_s is not None and req.beat_s < best_s < float("inf") and lb > req.beat_s


def _fill_of(label: str) -> str:
    """A candidate's placement rule, its depths left out ("k=1 q=0 forward, master first; ..."
    -> "forward, master first")."""
    head = label.split("; activations:")[0]
    return re.sub(r"^k=\d+ q=\d+ ", "", head)


def _tops(cands: list[Candidate], n: int, extra: int) -> list[Candidate]:
    """The best n placements replayed, and the best of up to `extra` other activation rooms: a placement
    leaving the activations little room (partial pieces fit in it) can be replayed faster with its
    first choice than one leaving more room with its first, where the latter's other choices
    (recomputing whole units) are faster still."""
    out = list(cands[:n])
    rooms = {c.plan.budgets.activation_bytes for c in out if c.plan.budgets is not None}
    for c in cands[n:]:
        room = activation_room(c.plan)
        if room not in rooms and len(out) < n + extra:
            rooms.add(room)
            out.append(c)
    return out


def _bound(plan: Plan, c: ActChoice, hw: HardwareProfile, model: ModelProfile, req: Request) -> float:
    return lower_bound(plan, hw, model, adam_threads=req.adam_threads, micro_batches=req.micro_batches,
                       activations=c.as_dict(), link=req.link)  # fmt: skip


IO_GAIN = 0.9  # another I/O setting is used only if it moves a byte in at most this much time


def io_choice(hardware: HardwareProfile) -> Optional[IOPoint]:
    """The measured (block size, queue depth) to run with, if clearly better than the default
    one (the grid's numbers are single short measurements: small differences are noise)."""
    if not hardware.io_grid:
        return None
    default = next(
        (p for p in hardware.io_grid
         if (p.block_size_bytes, p.queue_depth) == (hardware.io_block_size_bytes, hardware.io_queue_depth)),
        IOPoint(hardware.io_block_size_bytes, hardware.io_queue_depth, hardware.ssd_read_gbps, hardware.ssd_write_gbps),
    )  # fmt: skip
    best = hardware.best_io()
    return best if best.seconds_per_byte() <= IO_GAIN * default.seconds_per_byte() else None


def plan(hardware: HardwareProfile, model: ModelProfile, req: Request) -> Plan:
    """The placement and prefetch depths with the least estimated step time within `req`'s budgets.
    Raises PlanError naming the missing bytes and the tier when nothing fits."""
    return search(hardware, model, req).plan


def describe_buffers(plan: Plan) -> list[str]:
    """The runtime buffers a plan implies: how many of each size, per tier."""
    s = build_schedule(plan)
    cdt = plan.compute_dtype
    streamed = [u for u, p in plan if p.weights is not Tier.DEVICE]
    lines = []
    if streamed:
        big = max(u.weights_bytes(cdt) for u in streamed)
        lines.append(f"weights buffers: up to {plan.prefetch_depth + 1} units in flight "
                     f"(largest {fmt_bytes(big)}), device peak {fmt_bytes(s.peak_device_bytes)}")  # fmt: skip
    opt = [u for u, p in plan if p.moments is Tier.SSD or p.master is Tier.SSD]
    if opt:
        big = max(u.master_bytes + u.moments_bytes for u in opt)
        lines.append(f"optimizer buffers: {plan.optim_prefetch_depth + 2} units of state in flight "
                     f"(largest {fmt_bytes(big)}), host peak {fmt_bytes(s.peak_host_bytes)}")  # fmt: skip
    return lines


__all__ = ["Request", "Candidate", "SearchResult", "plan", "search", "describe_buffers"]
