"""The planner: plan(hardware, model, budget) -> Plan, the placement with the least estimated step.

Pure (no torch). Candidates are enumerated within the budgets and each is scored with the cost
model (cost.py); the least estimated step time wins.

Note: the candidates.
  1. Prefetch depths: weights k in 0..MAX_PREFETCH and optimizer read-ahead q in 0..MAX_OPTIM
     (or the caller's fixed values), each pair's streaming working set (every array on SSD)
     checked against the budgets with the schedule the runtime walks.
  2. For each pair, what to keep in memory with the budget left over. Every (unit, array)
     that could stay resident is an *upgrade*: keep unit u's master (on the CPU device with fp32
     compute that is its weights too, from the device budget, or from the host budget), its
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

from dataclasses import dataclass, fields, replace
from typing import Optional

from .cost import StepEstimate, replay
from .default import _keep_what_fits, streaming_plan
from .hardware import HardwareProfile, IOPoint
from .model_profile import ModelProfile
from .plan import COMPUTE_DTYPES, Plan, PlanError, Tier, fmt_bytes
from .schedule import build_schedule

MAX_PREFETCH = 3
MAX_OPTIM = 3
TIE_FRAC = 0.01
ROBUST_WINDOW = 0.25  # candidates this far above the best estimate are scored on a slow SSD too
ROBUST_MAX = 24
SLOW_SSD = 0.7
ACT_TOP_PLACEMENTS = 3


@dataclass(frozen=True)
class Budget:
    """What the planner may use, and the run's settings that change the schedule.

    device_bytes / host_bytes: as RuntimeConfig's device_budget_bytes / host_budget_bytes.
    activation_bytes: device bytes the saved activations may take (ActivationConfig.budget_bytes);
        None: unlimited, every unit keeps its activations.
    ssd_bytes: free space on the swap directories (None: not checked).
    prefetch_depth / optim_prefetch_depth: fixed by the user (None: searched).
    """

    device_bytes: int
    host_bytes: int
    ssd_bytes: Optional[int] = None
    compute_dtype: str = "fp32"
    micro_batches: int = 1
    deferred_update: bool = False
    adam_threads: int = 1
    prefetch_depth: Optional[int] = None
    optim_prefetch_depth: Optional[int] = None
    activation_bytes: Optional[int] = None  # device bytes for saved activations (None: no limit)
    act_prefetch_units: int = 2

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise PlanError(f"Budget.{name} must be an int > 0, got {v!r}")
        if self.ssd_bytes is not None and self.ssd_bytes < 0:
            raise PlanError(f"Budget.ssd_bytes must be >= 0 or None, got {self.ssd_bytes!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise PlanError(
                f"Budget.compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}"
            )
        if self.micro_batches < 1:
            raise PlanError(f"Budget.micro_batches must be >= 1, got {self.micro_batches!r}")
        if self.adam_threads < 1:
            raise PlanError(f"Budget.adam_threads must be >= 1, got {self.adam_threads!r}")
        for name in ("prefetch_depth", "optim_prefetch_depth"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise PlanError(f"Budget.{name} must be >= 0 or None, got {v!r}")


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
    plan: Plan, hw: HardwareProfile, model: ModelProfile, budget: Budget, acts: Optional[dict] = None
) -> tuple[StepEstimate, dict]:
    return replay(plan, hw, model, adam_threads=budget.adam_threads, micro_batches=budget.micro_batches,
                  activations=acts or {}, act_prefetch_units=budget.act_prefetch_units)  # fmt: skip


def activation_candidates(model: ModelProfile, budget: Budget, device: str) -> list[tuple[str, dict]]:
    """Activation policies to score when the saved activations exceed budget.activation_bytes.

    Units are ranked by forward FLOPs per saved byte, lowest first (the paper's rule): those are
    the cheapest to recompute per byte freed and the hardest to hide a swap behind. Candidates:
    recompute along the ranking until the rest fits; keep along the ranking what fits (with room
    for the swapped units' working set, as the runtime reserves it) and swap the rest to host
    memory (CUDA) or SSD; and half of each."""
    acts = [(i, u) for i, u in enumerate(model.units) if u.activation_bytes > 0]
    total = sum(u.activation_bytes for _, u in acts)
    if budget.activation_bytes is None or total <= budget.activation_bytes:
        return [("keep", {})]
    cap = budget.activation_bytes
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
    working = 2 if budget.act_prefetch_units > 0 else 1
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


def _fits(plan: Plan, budget: Budget) -> bool:
    s = build_schedule(plan)
    return s.peak_device_bytes <= budget.device_bytes and s.peak_host_bytes <= budget.host_bytes


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


def _take(base: Plan, steps: list[tuple[tuple[str, str], ...]], budget: Budget) -> Plan:
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
        if _fits(prefix(mid), budget):
            lo = mid
        else:
            hi = mid - 1
    plan, misses = prefix(lo), 0
    for step in steps[lo:]:
        for unit, what in step:
            nxt = _apply(plan, unit, what)
            if nxt is not None and _fits(nxt, budget):
                plan, misses = nxt, -1
                break
        misses += 1
        if misses >= MAX_MISSES:
            break
    return _persistent_grads(plan, budget)


def _greedy(base: Plan, traffic: dict, budget: Budget) -> Plan:
    return _take(base, [((unit, what),) for _, _, unit, what in _upgrades(base, traffic)], budget)


def _ordered_fill(base: Plan, order: list[str], arrays: tuple[str, ...], budget: Budget) -> Plan:
    """Keeps `arrays` of the units in `order` (all of the first array's units, then the next
    array's) while the budgets allow: the fills a person tuning by hand would try."""
    masters = ("master@device", "master@host") if base.device == "cpu" else ("master@host",)
    steps = [
        tuple((u, w) for w in (masters if what == "master" else (what,))) for what in arrays for u in order
    ]
    return _take(base, steps, budget)


FILLS = (
    ("forward, master first", False, ("master", "moments@host")),
    ("forward, moments first", False, ("moments@host", "master")),
    ("backward, master first", True, ("master", "moments@host")),
)


def _persistent_grads(plan: Plan, budget: Budget) -> Plan:
    """Gradients kept between micro-batches or for a deferred update: in host memory if all fit."""
    if not plan.persistent_grads:
        return plan
    host = replace(plan, placements=tuple(replace(p, grads=Tier.HOST) for p in plan.placements))
    return (
        host
        if _fits(host, budget)
        else replace(plan, placements=tuple(replace(p, grads=Tier.SSD) for p in plan.placements))
    )


def _depths(budget: Budget, n_units: int) -> list[tuple[int, int]]:
    ks = [budget.prefetch_depth] if budget.prefetch_depth is not None else list(range(MAX_PREFETCH + 1))
    qmax = max(0, min(MAX_OPTIM, n_units - 1))
    qs = [budget.optim_prefetch_depth] if budget.optim_prefetch_depth is not None else list(range(qmax + 1))
    return [(k, q) for k in ks for q in qs]


def search(hardware: HardwareProfile, model: ModelProfile, budget: Budget) -> SearchResult:
    units = model.unit_specs()
    common = dict(
        device=hardware.device,
        compute_dtype=budget.compute_dtype,
        accumulate_grads=budget.micro_batches > 1,
        deferred_update=budget.deferred_update,
        device_budget_bytes=budget.device_bytes,
        host_budget_bytes=budget.host_bytes,
    )
    cands: list[Candidate] = []
    smallest: Optional[Plan] = None
    for k, q in _depths(budget, len(units)):
        base = streaming_plan(units, prefetch_depth=k, optim_prefetch_depth=q, **common)
        if smallest is None or (k, q) < (smallest.prefetch_depth, smallest.optim_prefetch_depth):
            smallest = base
        sched = build_schedule(base)
        if sched.peak_device_bytes > budget.device_bytes or sched.peak_host_bytes > budget.host_bytes:
            continue
        est, traffic = _score(base, hardware, model, budget)
        tried = {base.placements: "stream"}
        greedy = _greedy(base, traffic, budget)
        tried.setdefault(greedy.placements, "greedy")
        dflt = _keep_what_fits(
            base, budget.device_bytes - sched.peak_device_bytes, budget.host_bytes - sched.peak_host_bytes
        )
        if _fits(dflt, budget):
            tried.setdefault(_persistent_grads(dflt, budget).placements, "default fill")
        names = [u.name for u in units]
        for label, backward, arrays in FILLS:
            filled = _ordered_fill(base, names[::-1] if backward else names, arrays, budget)
            tried.setdefault(filled.placements, label)
        for placements, how in tried.items():
            plan = replace(base, placements=placements, notes=())
            if budget.ssd_bytes is not None and plan.ssd_bytes() > budget.ssd_bytes:
                continue
            e = est if how == "stream" else _score(plan, hardware, model, budget)[0]
            cands.append(Candidate(f"k={k} q={q} {how}", plan, e))
    if not cands:
        _raise_infeasible(smallest, budget)
    cands.sort(key=lambda c: c.estimate.step_s)
    act_cands = activation_candidates(model, budget, hardware.device)
    if act_cands != [("keep", {})]:
        # the activation policy interacts with placement through the SSD and the cores: score
        # every policy against the best few placements
        top = cands[:ACT_TOP_PLACEMENTS]
        cands = []
        for c in top:
            for label, acts in act_cands:
                e = _score(c.plan, hardware, model, budget, acts)[0]
                cands.append(
                    Candidate(f"{c.label}; activations: {label}", c.plan, e, tuple(sorted(acts.items())))
                )
        cands.sort(key=lambda c: c.estimate.step_s)
    best = _robust_pick(cands, hardware, model, budget)
    notes = (f"auto plan: estimated {best.estimate.step_s:.3f} s/step, bound by {best.estimate.bound} "
             f"(best of {len(cands)} candidates)",)  # fmt: skip
    best_plan = replace(best.plan, notes=notes)
    io = io_choice(hardware)
    if io is not None and "io_block_size_bytes" in {f.name for f in fields(Plan)}:
        best_plan = replace(best_plan, io_block_size_bytes=io.block_size_bytes, io_queue_depth=io.queue_depth)
    if best.activations and "activations" in {f.name for f in fields(Plan)}:
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


def _robust_pick(
    cands: list[Candidate], hw: HardwareProfile, model: ModelProfile, budget: Budget
) -> Candidate:
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
        pessimistic = _score(c.plan, slow, model, budget, dict(c.activations))[0].step_s
        score[id(c)] = (c.estimate.step_s + pessimistic) / 2
    top = min(score.values())
    close = [c for c in near if score[id(c)] <= top * (1 + TIE_FRAC)]
    return min(close, key=lambda c: (c.estimate.ssd_read_bytes + c.estimate.ssd_write_bytes, score[id(c)]))


def plan(hardware: HardwareProfile, model: ModelProfile, budget: Budget) -> Plan:
    """The placement and prefetch depths with the least estimated step time within `budget`.
    Raises PlanError naming the missing bytes and the tier when nothing fits."""
    return search(hardware, model, budget).plan


def _raise_infeasible(smallest: Optional[Plan], budget: Budget) -> None:
    if smallest is None:
        raise PlanError("no prefetch depths to try")
    sched = build_schedule(smallest)
    cdt = smallest.compute_dtype
    biggest = max(smallest.units, key=lambda u: u.master_bytes)
    parts = []
    if sched.peak_device_bytes > budget.device_bytes:
        miss = sched.peak_device_bytes - budget.device_bytes
        parts.append(
            f"the device budget is short by {fmt_bytes(miss)} ({miss} bytes): it is {fmt_bytes(budget.device_bytes)}, "
            f"streaming with prefetch depth {smallest.prefetch_depth} needs {fmt_bytes(sched.peak_device_bytes)}"
        )
    if sched.peak_host_bytes > budget.host_bytes:
        miss = sched.peak_host_bytes - budget.host_bytes
        parts.append(
            f"the host budget is short by {fmt_bytes(miss)} ({miss} bytes): it is {fmt_bytes(budget.host_bytes)}, "
            f"the optimizer's working set with read-ahead {smallest.optim_prefetch_depth} needs "
            f"{fmt_bytes(sched.peak_host_bytes)}"
        )
    if not parts and budget.ssd_bytes is not None:
        need = _all_kept_ssd_bytes(smallest, budget)
        miss = need - budget.ssd_bytes
        parts.append(
            f"the SSD space is short by {fmt_bytes(miss)} ({miss} bytes): {fmt_bytes(budget.ssd_bytes)} free, "
            f"the state that does not fit in memory needs {fmt_bytes(need)}"
        )
    raise PlanError(
        "no plan fits the budgets: " + "; ".join(parts) + f". The largest unit is {biggest.name!r} "
        f"({biggest.numel:,} parameters: {fmt_bytes(biggest.weights_bytes(cdt))} of {cdt} weights, "
        f"{fmt_bytes(biggest.master_bytes + biggest.moments_bytes)} of master weights and moments)."
    )


def _all_kept_ssd_bytes(plan: Plan, budget: Budget) -> int:
    """SSD bytes of the plan that keeps the most in memory (forward fill) at these depths."""
    s = build_schedule(plan)
    kept = _keep_what_fits(
        plan, budget.device_bytes - s.peak_device_bytes, budget.host_bytes - s.peak_host_bytes
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


__all__ = ["Budget", "Candidate", "SearchResult", "plan", "search", "describe_buffers"]
