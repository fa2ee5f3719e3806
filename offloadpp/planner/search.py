"""The planner: plan(hardware, model, req) -> Plan, the placement with the least estimated step.

Pure (no torch). Candidates are enumerated within the budgets and each is scored with the cost
model (cost.py); the least estimated step time wins.

Note: the candidates.
  1. Prefetch depths: weights k in 0..MAX_PREFETCH and optimizer read-ahead q in 0..MAX_OPTIM
     (or the caller's fixed values), each pair's streaming working set (every array on SSD)
     checked against the budgets with the schedule the runtime walks.
  2. For each pair, what to keep in memory with the budget left over. Every (unit, array)
     that could stay resident is an *upgrade*: keep unit u's master (on the CPU device with fp32
     compute that is its weights too, from the device req, or from the host req), its
     moments, or (16-bit compute, CUDA) its compute weights on the device or host. An
     upgrade's value is the SSD (and link) bytes per step it saves, measured by replaying the
     streaming plan and reading its per-key traffic; its price is the bytes it occupies.
     Upgrades are taken greedily by value per byte, each kept only if the schedule's peaks still
     fit. The fills a person would try by hand are scored too: the default policy's, forward
     order with masters or moments first, backward order (FILLS).
  3. The least estimated step time wins, robustly: the candidates near the best are scored again
     with the SSD at 70% of its measured speed and the least mean of the two estimates wins
     (the disk's speed moves from run to run; a plan whose I/O is on the critical path pays for
     it); means within TIE_FRAC go to the plan moving fewer SSD bytes.
If nothing fits, a PlanError says how many bytes each budget lacks for the smallest working
set (k = 0, q = 0), and which unit makes it that large.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .cost import StepEstimate, replay
from .default import _keep_what_fits, plan_shape, streaming_plan
from .hardware import HardwareProfile, IOPoint
from .model_profile import ModelProfile
from .plan import InfeasibleError, Plan, PlanError, Tier, fmt_bytes
from .schedule import build_schedule
from .spec import Budgets, Settings

MAX_PREFETCH = 3
MAX_OPTIM = 3
TIE_FRAC = 0.01
ROBUST_WINDOW = 0.25  # candidates this far above the best estimate are scored on a slow SSD too
ROBUST_MAX = 24
SLOW_SSD = 0.7
ACT_TOP_PLACEMENTS = 3


@dataclass(frozen=True)
class Request:
    """What the search is asked: budgets, and the settings that change the schedule and the
    estimate (compute dtype, accumulation, deferral, Adam threads, fixed depths)."""

    budgets: Budgets
    settings: Settings
    adam_threads: int = 1  # resolved (Settings.adam_threads may say "every core")
    ssd_free_bytes: Optional[int] = None  # plans keeping more on SSD are not candidates (None: not checked)

    @property
    def micro_batches(self) -> int:
        return self.settings.gradient_accumulation_steps

    @property
    def act_prefetch_units(self) -> int:
        return self.settings.activations.prefetch_units


@dataclass(frozen=True)
class Candidate:
    label: str
    plan: Plan
    estimate: StepEstimate
    activations: tuple[tuple[str, str], ...] = ()  # (unit, policy) for units that do not keep


@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    candidates: tuple[Candidate, ...]  # every plan scored, least estimate first

    @property
    def plan(self) -> Plan:
        return self.best.plan

    @property
    def activations(self) -> dict[str, str]:
        """The chosen activation policy per unit (units not named keep theirs)."""
        return dict(self.best.activations)


def _score(
    plan: Plan, hw: HardwareProfile, model: ModelProfile, req: Request, acts: Optional[dict] = None
) -> tuple[StepEstimate, dict]:
    return replay(plan, hw, model, adam_threads=req.adam_threads, micro_batches=req.micro_batches,
                  activations=acts or {}, act_prefetch_units=req.act_prefetch_units)  # fmt: skip


def activation_candidates(model: ModelProfile, req: Request, device: str) -> list[tuple[str, dict]]:
    """Activation policies to score when the saved activations exceed req.budgets.activation_bytes.

    Units are ranked by forward FLOPs per saved byte, lowest first (the paper's rule): those are
    the cheapest to recompute per byte freed and the hardest to hide a swap behind. Candidates:
    recompute along the ranking until the rest fits; keep along the ranking what fits (with room
    for the swapped units' working set, as the runtime reserves it) and swap the rest to host
    memory (CUDA) or SSD; and half of each."""
    acts = [(i, u) for i, u in enumerate(model.units) if u.activation_bytes > 0]
    total = sum(u.activation_bytes for _, u in acts)
    if req.budgets.activation_bytes is None or total <= req.budgets.activation_bytes:
        return [("keep", {})]
    cap = req.budgets.activation_bytes
    ranked = [u for _, u in sorted(acts, key=lambda x: (x[1].forward_flops / x[1].activation_bytes, -x[0]))]
    swap_to = "host" if device == "cuda" else "ssd"
    out = []
    # recompute the lowest ratios until what is kept fits
    rec, kept = {}, total
    for u in ranked:
        if kept <= cap:
            break
        rec[u.name] = "recompute"
        kept -= u.activation_bytes
    if kept <= cap:
        out.append(("recompute lowest FLOPs/byte", rec))
    # keep along the ranking, swap the rest
    working = 2 if req.act_prefetch_units > 0 else 1
    for pol in dict.fromkeys((swap_to, "ssd")):
        keep, used = set(), 0
        for u in ranked:
            rest = [v.activation_bytes for v in ranked if v.name not in keep and v is not u]
            if used + u.activation_bytes + working * max(rest, default=0) <= cap:
                keep.add(u.name)
                used += u.activation_bytes
        out.append(
            (
                f"keep lowest FLOPs/byte, swap the rest to {pol}",
                {u.name: pol for u in ranked if u.name not in keep},
            )
        )
    # half recomputed, half swapped
    if rec:
        half = dict(list(rec.items())[: max(1, len(rec) // 2)])
        swapped = {u.name: swap_to for u in reversed(ranked) if u.name not in half}
        kept_bytes = 0
        for u in ranked:
            if u.name in swapped and kept_bytes + u.activation_bytes <= cap // 2:
                del swapped[u.name]
                kept_bytes += u.activation_bytes
        out.append(("recompute half, swap half", {**half, **swapped}))
    return out or [("recompute all", {u.name: "recompute" for u in ranked})]


def _fits(plan: Plan, req: Request) -> bool:
    s = build_schedule(plan)
    return s.peak_device_bytes <= req.budgets.device_bytes and s.peak_host_bytes <= req.budgets.host_bytes


def _upgrades(plan: Plan, traffic: dict) -> list[tuple[float, int, str, str]]:
    """(value per byte, forward index, unit, what) for every array that could stay in memory."""
    out = []
    cpu = plan.device == "cpu"
    cdt = plan.compute_dtype
    for i, (u, _) in enumerate(plan):
        master = traffic.get(f"{u.name}.master", 0)
        moments = traffic.get(f"{u.name}.exp_avg", 0) + traffic.get(f"{u.name}.exp_avg_sq", 0)
        weights = traffic.get(f"{u.name}.weights", 0)
        if plan.separate_weights:
            out.append(((weights + 1) / u.weights_bytes(cdt), i, u.name, "weights@device"))
            out.append(((weights + 1) / u.weights_bytes(cdt), i, u.name, "weights@host"))
            out.append(((master + 1) / u.master_bytes, i, u.name, "master@host"))
        else:
            out.append(
                ((master + 1) / u.master_bytes, i, u.name, "master@device" if cpu else "weights@device")
            )
            out.append(((master + 1) / u.master_bytes, i, u.name, "master@host"))
        out.append(((moments + 1) / u.moments_bytes, i, u.name, "moments@host"))
    out.sort(key=lambda x: (-x[0], x[1]))
    return out


def _apply(plan: Plan, unit: str, what: str) -> Optional[Plan]:
    """The plan with one more array kept in memory, or None if that does not apply."""
    idx = [u.name for u in plan.units].index(unit)
    p = plan.placements[idx]
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
    else:
        raise ValueError(what)
    placements = list(plan.placements)
    placements[idx] = new
    try:
        return replace(plan, placements=tuple(placements))
    except PlanError:
        return None


MAX_MISSES = 6  # a fill stops after this many arrays in a row did not fit


def _take(base: Plan, steps: list[tuple[tuple[str, str], ...]], req: Request) -> Plan:
    """Applies `steps` in order (each the first of its (unit, what) alternatives that fits) while
    the budgets allow. The longest prefix that fits with first alternatives is found by bisection
    (keeping more never shrinks the peaks much), then steps go one by one, up to MAX_MISSES
    misses in a row: O(log n) schedule walks where a plain loop takes n."""

    def prefix(n: int) -> Plan:
        plan = base
        for step in steps[:n]:
            nxt = _apply(plan, *step[0])
            plan = nxt if nxt is not None else plan
        return plan

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
    """Gradients kept between micro-batches or for a deferred update: in host memory if all fit."""
    if not plan.persistent_grads:
        return plan
    host = replace(plan, placements=tuple(replace(p, grads=Tier.HOST) for p in plan.placements))
    return (
        host
        if _fits(host, req)
        else replace(plan, placements=tuple(replace(p, grads=Tier.SSD) for p in plan.placements))
    )


def _depths(req: Request, n_units: int) -> list[tuple[int, int]]:
    ks = (
        [req.settings.prefetch_depth]
        if req.settings.prefetch_depth is not None
        else list(range(MAX_PREFETCH + 1))
    )
    qmax = max(0, min(MAX_OPTIM, n_units - 1))
    qs = (
        [req.settings.optim_prefetch_depth]
        if req.settings.optim_prefetch_depth is not None
        else list(range(qmax + 1))
    )
    return [(k, q) for k in ks for q in qs]


def search(hardware: HardwareProfile, model: ModelProfile, req: Request) -> SearchResult:
    units = model.unit_specs()
    common = dict(device=hardware.device, budgets=req.budgets, **plan_shape(req.settings))
    cands: list[Candidate] = []
    smallest: Optional[Plan] = None
    for k, q in _depths(req, len(units)):
        base = streaming_plan(units, prefetch_depth=k, optim_prefetch_depth=q, **common)
        if smallest is None or (k, q) < (smallest.prefetch_depth, smallest.optim_prefetch_depth):
            smallest = base
        sched = build_schedule(base)
        if (
            sched.peak_device_bytes > req.budgets.device_bytes
            or sched.peak_host_bytes > req.budgets.host_bytes
        ):
            continue
        est, traffic = _score(base, hardware, model, req)
        tried = {base.placements: "stream"}
        greedy = _greedy(base, traffic, req)
        tried.setdefault(greedy.placements, "greedy")
        dflt = _keep_what_fits(
            base,
            req.budgets.device_bytes - sched.peak_device_bytes,
            req.budgets.host_bytes - sched.peak_host_bytes,
        )
        if _fits(dflt, req):
            tried.setdefault(_persistent_grads(dflt, req).placements, "default fill")
        names = [u.name for u in units]
        for label, backward, arrays in FILLS:
            filled = _ordered_fill(base, names[::-1] if backward else names, arrays, req)
            tried.setdefault(filled.placements, label)
        for placements, how in tried.items():
            plan = replace(base, placements=placements, notes=())
            if req.ssd_free_bytes is not None and plan.ssd_bytes() > req.ssd_free_bytes:
                continue
            e = est if how == "stream" else _score(plan, hardware, model, req)[0]
            cands.append(Candidate(f"k={k} q={q} {how}", plan, e))
    if not cands:
        _raise_infeasible(smallest, req)
    cands.sort(key=lambda c: c.estimate.step_s)
    act_cands = activation_candidates(model, req, hardware.device)
    if act_cands != [("keep", {})]:
        # the activation policy interacts with placement through the SSD and the cores: score
        # every policy against the best few placements
        top = cands[:ACT_TOP_PLACEMENTS]
        cands = []
        for c in top:
            for label, acts in act_cands:
                e = _score(c.plan, hardware, model, req, acts)[0]
                cands.append(
                    Candidate(f"{c.label}; activations: {label}", c.plan, e, tuple(sorted(acts.items())))
                )
        cands.sort(key=lambda c: c.estimate.step_s)
    best = _robust_pick(cands, hardware, model, req)
    notes = (f"auto plan: estimated {best.estimate.step_s:.3f} s/step, bound by {best.estimate.bound} "
             f"(best of {len(cands)} candidates)",)  # fmt: skip
    best_plan = replace(best.plan, notes=notes)
    io = io_choice(hardware)
    if io is not None:
        best_plan = replace(best_plan, io_block_size_bytes=io.block_size_bytes, io_queue_depth=io.queue_depth)
    if best.activations:
        acts = dict(best.activations)
        best_plan = replace(best_plan, activations=tuple(acts.get(u.name, "keep") for u in best_plan.units))
    best = replace(best, plan=best_plan)
    return SearchResult(best, tuple(cands))


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


def _robust_pick(cands: list[Candidate], hw: HardwareProfile, model: ModelProfile, req: Request) -> Candidate:
    """The candidate to run. Note: the SSD's bandwidth moves from run to run (up to 2x on the
    development machine, DESIGN.md), and a plan whose I/O sits on the critical path pays for
    every slow moment. So the candidates within ROBUST_WINDOW of the best estimate are scored
    again with the SSD at SLOW_SSD of its measured rate, and the one with the least mean of the
    two estimates wins; means within TIE_FRAC go to the plan moving fewer SSD bytes."""
    best_s = cands[0].estimate.step_s
    near = [c for c in cands if c.estimate.step_s <= best_s * (1 + ROBUST_WINDOW)][:ROBUST_MAX]
    slow = replace(
        hw,
        ssd_read_gbps=hw.ssd_read_gbps * SLOW_SSD,
        ssd_write_gbps=hw.ssd_write_gbps * SLOW_SSD,
        ssd_mixed_gbps=hw.ssd_mixed_gbps * SLOW_SSD,
        ssd_mixed_busy_gbps=hw.ssd_mixed_busy_gbps * SLOW_SSD,
    )
    score = {}
    for c in near:
        pessimistic = _score(c.plan, slow, model, req, dict(c.activations))[0].step_s
        score[id(c)] = (c.estimate.step_s + pessimistic) / 2
    top = min(score.values())
    close = [c for c in near if score[id(c)] <= top * (1 + TIE_FRAC)]
    return min(close, key=lambda c: (c.estimate.ssd_read_bytes + c.estimate.ssd_write_bytes, score[id(c)]))


def plan(hardware: HardwareProfile, model: ModelProfile, req: Request) -> Plan:
    """The placement and prefetch depths with the least estimated step time within `req`'s budgets.
    Raises PlanError naming the missing bytes and the tier when nothing fits."""
    return search(hardware, model, req).plan


def _raise_infeasible(smallest: Optional[Plan], req: Request) -> None:
    if smallest is None:
        raise PlanError("no prefetch depths to try")
    sched = build_schedule(smallest)
    cdt = smallest.compute_dtype
    biggest = max(smallest.units, key=lambda u: u.master_bytes)
    parts = []
    if sched.peak_device_bytes > req.budgets.device_bytes:
        miss = sched.peak_device_bytes - req.budgets.device_bytes
        parts.append(
            f"the device budget is short by {fmt_bytes(miss)} ({miss} bytes): it is {fmt_bytes(req.budgets.device_bytes)}, "
            f"streaming with prefetch depth {smallest.prefetch_depth} needs {fmt_bytes(sched.peak_device_bytes)}"
        )
    if sched.peak_host_bytes > req.budgets.host_bytes:
        miss = sched.peak_host_bytes - req.budgets.host_bytes
        parts.append(
            f"the host budget is short by {fmt_bytes(miss)} ({miss} bytes): it is {fmt_bytes(req.budgets.host_bytes)}, "
            f"the optimizer's working set with read-ahead {smallest.optim_prefetch_depth} needs "
            f"{fmt_bytes(sched.peak_host_bytes)}"
        )
    if not parts and req.ssd_free_bytes is not None:
        need = _all_kept_ssd_bytes(smallest, req)
        miss = need - req.ssd_free_bytes
        parts.append(
            f"the SSD space is short by {fmt_bytes(miss)} ({miss} bytes): {fmt_bytes(req.ssd_free_bytes)} free, "
            f"the state that does not fit in memory needs {fmt_bytes(need)}"
        )
    raise InfeasibleError(
        "no plan fits the budgets: " + "; ".join(parts) + f". The largest unit is {biggest.name!r} "
        f"({biggest.numel:,} parameters: {fmt_bytes(biggest.weights_bytes(cdt))} of {cdt} weights, "
        f"{fmt_bytes(biggest.master_bytes + biggest.moments_bytes)} of master weights and moments)."
    )


def _all_kept_ssd_bytes(plan: Plan, req: Request) -> int:
    """SSD bytes of the plan that keeps the most in memory (forward fill) at these depths."""
    s = build_schedule(plan)
    kept = _keep_what_fits(
        plan, req.budgets.device_bytes - s.peak_device_bytes, req.budgets.host_bytes - s.peak_host_bytes
    )
    return kept.ssd_bytes()


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
