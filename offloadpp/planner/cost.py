"""The cost model: estimate(plan, hardware, model) -> StepEstimate.

Pure (no torch). The step time comes from a replay of the runtime's schedule on timed
resources (simulate.py: device compute, the optimizer's worker, one SSD shared by reads and
writes, the host<->device link, CPU sharing between compute and Adam on the CPU device); the
floor and the bound come from the totals.

Note: the equations (docs/planner.md has them with the measured accuracy).
  compute_s = sum over units of forward_s(u) + backward_s(u)   [measured per unit on this device
              kind, else FLOPs / device FLOP/s; recompute adds forward_s(u) to backward]
  adam_s    = params / Adam params/s at the runtime's Adam threads
  ssd_s     = read bytes / read GB/s + write bytes / write GB/s   [bytes as the replay moves them]
  link_s    = max(h2d bytes / h2d GB/s, d2h bytes / d2h GB/s)     [CUDA only]
  comm_s    = collective bytes / the ranks' bus GB/s               [several ranks: ranks.py]
  floor_s   = max(compute_s, ssd_s, adam_s, link_s, comm_s); `bound` names the largest.
Over several ranks the plan is one rank's (its shards) and the hardware the node's: the replay
runs on the rank's share of it (ranks.rank_share) with the collectives on a link of their own.
  step_s    = the replay's time from the first forward to step() returning, steady state, and
              at least ssd_s and link_s (a step can leave writes queued that no later read waits
              for, but not forever).
The replay is what makes step_s differ from floor_s: weights that arrive late (the SSD queue
holds the previous step's writes), Adam slowed by compute on shared cores, the last units'
updates after backward, deferred updates run after backward (one rank: at each unit's next
visit, simulate_pending.py). A speculative plan (clipping or fp16
with Plan.speculative) is replayed as a step that validates: its updates run during backward.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from typing import Mapping, Optional

from .activations import LAST, NESTED, act_units, forward_moved, recompute_fraction, recomputes
from .decide import lazy_applies, lazy_runtime
from .desim import Fifo, Ssd
from .desim_loop import run
from .hardware import HardwareProfile
from .model_profile import ModelProfile
from .plan import DTYPE_BYTES, Plan, PlanError, Tier, fmt_bytes
from .ranks import RankLink, rank_share
from .schedule import cached_schedule
from .simulate import Costs, Sim
from .simulate_act import ActWork
from .traffic import ByKind, by_key_kinds

REPLAY_STEPS = 3  # the first steps fill the SSD queue and the moments; the last is steady
# Models of many units (a replay walks every visit of each step; 175B has 98 units and must plan
# within 2 s) replay two: their second step is already steady (GPT-3 175B b8-b32 and 13B b64
# on the paper profile: the 2- and 3-step estimates of the best six candidates agree within
# 0.03%, 2026-12-03), and a replay costs a third less.
MANY_UNITS, MANY_UNITS_STEPS = 64, 2


def replay_steps(plan: Plan, micro_batches: int) -> int:
    """Steps a replay of `plan` walks. Two on models of many units (above), and where a step runs
    several micro-batches (accumulation, or a vertical window's visits), unless its updates are
    deferred to the next step's visits: the first step's last micro-batch already leaves the
    state a steady step leaves (GPT-3 13B b8 x 4 on the paper profile and its data-sheet variant,
    13B b32 x 4 on one SSD: the 2- and 3-step estimates of the plans chosen agree to 1e-12 s, and
    the same plans are chosen, 2026-12-05); deferred updates applied at the next visits need the
    third (13B b8 x 4 with clipping and speculation off: 68.0 s after two, 32.6 s after three)."""
    if len(plan.units) > MANY_UNITS:
        return MANY_UNITS_STEPS
    window = micro_batches * (1 if plan.accumulate_grads else plan.micro_batches)
    return MANY_UNITS_STEPS if window > 1 and not lazy_applies(plan) else REPLAY_STEPS


@dataclass(frozen=True)
class StepEstimate:
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_wait_s: float
    compute_s: float
    adam_s: float
    ssd_s: float
    link_s: float
    floor_s: float
    bound: str  # "compute" | "ssd" | "adam" | "link" | "comm"
    ssd_read_bytes: int
    ssd_write_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    pool_wait_s: float  # of step_s, the main thread waiting for a buffer to come free
    peak_device_bytes: int  # the schedule's runtime buffers (activations not included)
    peak_host_bytes: int
    peak_activation_bytes: int = 0  # the saved activations on the device, as the replay counts them
    comm_s: float = 0.0  # over several ranks: the step's gathers and reductions at the bus bandwidth
    comm_bytes: int = 0  # the bytes through this rank's link for them
    # of ssd_read_bytes / ssd_write_bytes, (kind, read, written) per kind (planner/traffic.py)
    ssd_by_kind: ByKind = ()

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"estimate {self.step_s:.3f}s (fwd {self.forward_s:.3f} bwd {self.backward_s:.3f} "
            f"opt-wait {self.optimizer_wait_s:.3f}) floor {self.floor_s:.3f}s bound by {self.bound} "
            f"[compute {self.compute_s:.3f} ssd {self.ssd_s:.3f} adam {self.adam_s:.3f} link {self.link_s:.3f}"
            + (f" comm {self.comm_s:.3f}" if self.comm_bytes else "")
            + "] "
            f"ssd r {fmt_bytes(self.ssd_read_bytes)} w {fmt_bytes(self.ssd_write_bytes)}"
        )


def activation_policies(plan: Plan) -> dict[str, str]:
    """The plan's activation policy per unit, if the plan carries them ({} means keep all)."""
    acts = getattr(plan, "activations", None)
    if not acts:
        return {}
    if isinstance(acts, Mapping):
        return {k: getattr(v, "value", v) for k, v in acts.items()}
    return {u.name: getattr(a, "value", a) for u, a in zip(plan.units, acts)}


# (the search bounds and replays hundreds of plans of the same units, profiles and dtype: their
# times are found once; keyed by the profiles' identity, both held in the entry so neither id is
# reused while it is there. The dicts returned are shared: read them, never write.)
_TIMES: dict[tuple, tuple] = {}
_TIMES_MAX = 16


def compute_times(plan: Plan, hardware: HardwareProfile, model: ModelProfile) -> tuple[dict, dict]:
    """(forward_s, backward_s) per unit on this hardware: measured when the profile was taken on
    this device kind, else FLOPs / FLOP/s."""
    key = (id(hardware), id(model), plan.compute_dtype, tuple(u.name for u in plan.units))
    e = _TIMES.get(key)
    if e is not None and e[0] is hardware and e[1] is model:
        return e[2]
    times = _compute_times(plan, hardware, model)
    if len(_TIMES) >= _TIMES_MAX:
        _TIMES.pop(next(iter(_TIMES)))
    _TIMES[key] = (hardware, model, times)
    return times


def _compute_times(plan: Plan, hardware: HardwareProfile, model: ModelProfile) -> tuple[dict, dict]:
    names = [u.name for u in plan.units]
    have = {u.name for u in model.units}
    missing = [n for n in names if n not in have]
    if missing:
        raise PlanError(f"the model profile has no unit(s) {missing}: profile the model the plan is for")
    measured = model.has_times(hardware.device)
    rate = hardware.flops_per_s(plan.compute_dtype)
    fwd, bwd = {}, {}
    for n in names:
        u = model.unit(n)
        if measured:
            fwd[n], bwd[n] = float(u.forward_s), float(u.backward_s)
        else:
            fwd[n], bwd[n] = u.forward_flops / rate, u.backward_flops / rate
    return fwd, bwd


# (a model's saved bytes and activation units by name, for every replay and bound of a search:
# found once per model profile; keyed by identity, the profile held in the entry so its id is not
# reused while it is there. The dicts returned are shared: read them, never write.)
_ACTS: dict[int, tuple] = {}
_ACTS_MAX = 16


def _model_acts(model: ModelProfile) -> tuple[dict, dict]:
    e = _ACTS.get(id(model))
    if e is not None and e[0] is model:
        return e[1]
    acts = ({u.name: u.activation_bytes for u in model.units}, {a.name: a for a in act_units(model)})
    if len(_ACTS) >= _ACTS_MAX:
        _ACTS.pop(next(iter(_ACTS)))
    _ACTS[id(model)] = (model, acts)
    return acts


@dataclass(frozen=True)
class ReplayOptions:
    """What estimate() and replay() take beside the plan and the profiles.

    adam_threads: the runtime's Adam threads; micro_batches: of one optimizer step;
    activations: per unit "keep" | "host" | "ssd" | "recompute" | "recompute_host" |
    "recompute_ssd" | "partial" | "partial_host" | "partial_ssd" | "recompute_nested" |
    "recompute_nested_host" | "recompute_nested_ssd" | "partial_host_tail" | "grad_in_forward" (a fused
    head's only)
    (default: the plan's, else keep everything); act_prefetch_units: backward's
    activation read-ahead; link: over several ranks, the ranks per node and the collectives'
    bandwidth (needed there); deferred: for a speculative plan, replay a step that defers its
    updates (one that clips) instead of one that validates: the plan's own schedule (its keeps
    and windows are sized for speculating), its updates deferred, at each unit's next visit
    where the runtime applies them so."""

    adam_threads: int = 1
    micro_batches: int = 1
    activations: Optional[Mapping[str, str]] = None
    act_prefetch_units: int = 2
    link: Optional[RankLink] = None
    deferred: bool = False


def estimate(plan: Plan, hardware: HardwareProfile, model: ModelProfile, **options) -> StepEstimate:
    """The step time `plan` takes on `hardware` for `model` (one optimizer step of
    `micro_batches` micro-batches), and the phase that bounds it; `options`: ReplayOptions'."""
    return replay(plan, hardware, model, **options)[0]


# replays made by this process (replays_made): planning's work in a unit no machine's speed moves
# (issue 36's planning time is CPU seconds, which moved 25% between days for the same code)
_REPLAYS = 0


def replays_made() -> int:
    """How many replays (cost.replay) this process has made: a count of the planner's work."""
    return _REPLAYS


def replay(
    plan: Plan, hardware: HardwareProfile, model: ModelProfile, **options
) -> tuple[StepEstimate, dict]:
    """estimate(), plus the SSD bytes the steady step moves per key ("<unit>.<array>").

    Note: the cycle collector waits while a replay runs. A replay makes thousands of objects
    (requests, slots, jobs) that live until it returns; the collector's passes in between found
    them alive and moved them on to its oldest generation, whose pass walks every object of the
    process (torch's and DeepSpeed's: 0.1-0.3 s, about every fourth point planned). A replay
    makes no garbage that needs the collector (its one cycle is broken as it returns, which a
    test checks), so pausing it frees nothing later than it would have been freed; nested and
    concurrent replays only resume it if it ran when they started."""
    global _REPLAYS
    _REPLAYS += 1
    was = gc.isenabled()
    gc.disable()
    try:
        return _replay(plan, hardware, model, **options)
    finally:
        if was:
            gc.enable()


def _replay(
    plan: Plan, hardware: HardwareProfile, model: ModelProfile, **options
) -> tuple[StepEstimate, dict]:
    o = ReplayOptions(**options)
    adam_threads, micro_batches, activations, link = o.adam_threads, o.micro_batches, o.activations, o.link
    act_prefetch_units = o.act_prefetch_units
    hardware, link = _for_rank(plan, hardware, link)
    if plan.device != hardware.device:
        raise PlanError(
            f"the plan is for device {plan.device!r}, the hardware profile for {hardware.device!r}"
        )
    if micro_batches < 1:
        raise PlanError(f"micro_batches must be >= 1, got {micro_batches}")
    if (micro_batches > 1) != plan.accumulate_grads:
        raise PlanError(f"micro_batches={micro_batches} but plan.accumulate_grads={plan.accumulate_grads}")
    policies = activations if activations is not None else activation_policies(plan)
    # (a grad_in_forward head runs its backward's matmuls in its forward)
    fwd, bwd = forward_moved(*compute_times(plan, hardware, model), policies)
    cuda = plan.device == "cuda"
    costs = Costs(
        forward_s=fwd,
        backward_s=bwd,
        adam_rate=hardware.adam_rate(adam_threads),
        adam_tail_rate=hardware.adam_rate(max(adam_threads, hardware.cpu_cores)),
        memcpy_bps=hardware.memcpy_gbps * 1e9,
        compute_slowdown=1.0 if cuda else hardware.compute_slowdown_under_adam,
        adam_slowdown=1.0 if cuda else hardware.adam_slowdown_under_compute,
        forward_visit_s=hardware.runtime_forward_visit_s,
        backward_visit_s=hardware.runtime_backward_visit_s,
        io_issue_s=hardware.io_issue_s,
    )
    rb, wb = hardware.ssd_rates()
    block = plan.io_block_size_bytes or hardware.io_block_size_bytes
    depth = plan.io_queue_depth or hardware.io_queue_depth
    ssd = Ssd(rb * 1e9, wb * 1e9, hardware.ssd_latency_s, inflight_bytes=block * depth)
    h2d = Fifo(hardware.h2d_gbps * 1e9, hardware.h2d_gbps * 1e9)
    d2h = Fifo(hardware.d2h_gbps * 1e9, hardware.d2h_gbps * 1e9)
    sim = Sim(
        plan,
        costs,
        ssd,
        h2d,
        d2h,
        micro_batches=micro_batches,
        acts=ActWork(
            policies=policies,
            saved_bytes=_model_acts(model)[0],
            units=_model_acts(model)[1],
            prefetch_units=act_prefetch_units,
        ),
        link=link,
    )
    if o.deferred and plan.speculative:  # the step clipped: no speculation, updates deferred
        sim.speculating, sim.lazy = False, lazy_runtime(plan)
    run(
        sim,
        sim.main(replay_steps(plan, micro_batches)),
        sim.helpers(),
        compute_slowdown=costs.compute_slowdown,
        helper_slowdown=costs.adam_slowdown,
        io_slowdown=1.0 if cuda else hardware.compute_slowdown_under_io,
    )
    m = sim.marks[-1]
    sched = cached_schedule(plan)  # (the one the replay just walked)
    acts = sim.act.units
    recompute = sum(fwd[n] * recompute_fraction(policies.get(n, "keep"), acts.get(n)) for n in fwd)
    compute = micro_batches * (sum(fwd[n] + bwd[n] for n in fwd) + recompute)
    adam = sum(u.numel for u in plan.units) / plan.ranks / costs.adam_rate
    ssd_s = m["ssd_r"] / ssd.read_bps + m["ssd_w"] / ssd.write_bps
    link_s = max(m["h2d"] / h2d.read_bps, m["d2h"] / d2h.read_bps) if cuda else 0.0
    comm = m["net"] / sim.net.read_bps if sim.net is not None else 0.0
    parts = {"compute": compute, "ssd": ssd_s, "adam": adam, "link": link_s, "comm": comm}
    bound = max(parts, key=parts.get)
    # A replayed step can end with writes still queued (activations no later step reads back
    # first); in the long run no step is shorter than what the SSD or a link must do in one.
    step = max(m["end"] - m["start"], ssd_s, link_s, comm)
    fwd_end = m["forward_end"][-1]
    bwd_end = m["backward_end"][-1]
    est = StepEstimate(
        step_s=step,
        forward_s=sum(f - s for f, s in zip(m["forward_end"], [m["start"]] + m["backward_end"][:-1])),
        backward_s=sum(b - f for b, f in zip(m["backward_end"], m["forward_end"])),
        optimizer_wait_s=m["end"] - bwd_end if bwd_end >= fwd_end else 0.0,
        compute_s=compute,
        adam_s=adam,
        ssd_s=ssd_s,
        link_s=link_s,
        floor_s=parts[bound],
        bound=bound,
        ssd_read_bytes=int(m["ssd_r"]),
        ssd_write_bytes=int(m["ssd_w"]),
        h2d_bytes=int(m["h2d"]),
        d2h_bytes=int(m["d2h"]),
        pool_wait_s=m["pool_wait"],
        peak_device_bytes=sched.peak_device_bytes,
        peak_host_bytes=sched.peak_host_bytes,
        peak_activation_bytes=sim.act.peak_bytes,
        comm_s=comm,
        comm_bytes=int(m["net"]),
        ssd_by_kind=by_key_kinds(m["by_dir"], plan.separate_weights),
    )
    # the one reference cycle of a replay (the activation replay reads its Sim's clock): broken
    # here, so the replay's thousands of objects go when it returns, not at the collector's next
    # pass, which walks every object of the process (torch's and DeepSpeed's: 0.1-0.3 s, about
    # once per point planned: 10-20% of the planning time, docs/performance.md, session 7)
    sim.act.sim = None
    return est, m["by_key"]


def _for_rank(plan: Plan, hardware: HardwareProfile, link: Optional[RankLink]):
    """The hardware one rank runs on, and its link (ranks.py); one rank: as given."""
    if plan.ranks == 1:
        return hardware, None
    if link is None:
        raise PlanError(
            f"the plan is for {plan.ranks} ranks: the estimate needs their link (ranks per node and the "
            "collectives' bandwidth: planner.ranks.RankLink)"
        )
    if link.ranks != plan.ranks:
        raise PlanError(
            f"the link describes {link.ranks} ranks ({link.nodes} x {link.local}), the plan {plan.ranks}"
        )
    return rank_share(hardware, link.local), link


def lower_bound(
    plan: Plan,
    hardware: HardwareProfile,
    model: ModelProfile,
    *,
    adam_threads: int = 1,
    micro_batches: int = 1,
    activations: Optional[Mapping[str, str]] = None,
    link: Optional[RankLink] = None,
) -> float:
    """A step time no replay of `plan` can beat, from totals alone (no replay): the planner
    replays only candidates whose bound is near the best estimate so far.

    Note: why each term is a bound. The main thread runs every visit's compute (recompute
    included) one after the other, each at most at full speed; the worker runs every update, at
    most at the rate of all cores; every array whose home is SSD is written once per step, and
    the moments (and, where the weights are separate, the master) are read once per step: they
    go back to the store after their update and nothing keeps them; on CUDA every weights not
    resident on the device crosses the link at least once per forward, every resident one once
    after its update, and every gradient leaves once per micro-batch. step_s is at least the
    replay's time, its SSD time and its link time. Activation traffic is left out (a swap-out
    not started when backward wants the unit is cancelled, so none of it is certain). Over
    several ranks each rank's link carries, per step, every unit's gradients reduced once and
    its weights gathered at least once (forward, or after the update where resident)."""
    hardware, link = _for_rank(plan, hardware, link)
    t = _plan_terms(plan, hardware, model, adam_threads, micro_batches, link)
    fwd = t.fwd
    policies = activations if activations is not None else activation_policies(plan)
    # (nested's and partial_last's shares of a recompute are the unit's)
    nested = _model_acts(model)[1] if any(p in NESTED or p in LAST for p in policies.values()) else {}
    recompute = sum(fwd[u] * recompute_fraction(p, nested.get(u)) + hardware.runtime_forward_visit_s
                    for u, p in policies.items() if recomputes(p))  # fmt: skip
    compute = micro_batches * (t.visit_compute + recompute)
    # a deferred update starts once backward is over (a speculative one, in a step that
    # validates, as it would without clipping; one applied at the next visit, beside the forward)
    serial = compute + t.adam * t.deferred / t.numel if t.deferred and not t.lazy else 0.0
    return max(compute, t.worker, serial, t.ssd, t.link_s, t.comm_s)


@dataclass(frozen=True)
class _PlanTerms:
    """lower_bound's terms that do not read the activations: what the search bounds each of a
    placement's activation choices with (its Note has why each is a bound)."""

    fwd: dict
    visit_compute: float  # forward and backward of every unit and their visits, one micro-batch
    adam: float
    worker: float
    deferred: float  # parameters whose updates wait for the end of backward
    numel: float
    lazy: bool
    ssd: float
    link_s: float
    comm_s: float


# (the search bounds every activation choice of each placement: the rest of the bound is found
# once per plan; keyed by identity, the plan and the profiles held in the entry so no id is
# reused while it is there)
_TERMS: dict[tuple, tuple] = {}
_TERMS_MAX = 64


def _plan_terms(plan: Plan, hardware: HardwareProfile, model: ModelProfile, adam_threads: int,
                micro_batches: int, link: Optional[RankLink]) -> _PlanTerms:  # fmt: skip
    key = (id(plan), id(hardware), id(model), adam_threads, micro_batches, link)
    e = _TERMS.get(key)
    if e is not None and e[0] is plan and e[1] is hardware and e[2] is model:
        return e[3]
    terms = _find_plan_terms(plan, hardware, model, adam_threads, micro_batches, link)
    if len(_TERMS) >= _TERMS_MAX:
        _TERMS.pop(next(iter(_TERMS)))
    _TERMS[key] = (plan, hardware, model, terms)
    return terms


def _find_plan_terms(plan: Plan, hardware: HardwareProfile, model: ModelProfile, adam_threads: int,
                     micro_batches: int, link: Optional[RankLink]) -> _PlanTerms:  # fmt: skip
    fwd, bwd = compute_times(plan, hardware, model)
    n = len(fwd)
    visits = n * (hardware.runtime_forward_visit_s + hardware.runtime_backward_visit_s)
    visit_compute = sum(fwd.values()) + sum(bwd.values()) + visits
    numel = sum(u.numel for u in plan.units) / plan.ranks
    adam = numel / max(
        hardware.adam_rate(adam_threads), hardware.adam_rate(max(adam_threads, hardware.cpu_cores))
    )
    # the worker absorbs gradients (and takes their norm for a deferred update) unit by unit
    # where they are not used in place (CUDA, or persistent), then runs Adam
    dp = plan.ranks > 1
    absorbed = sum(u.numel for u in plan.units) if plan.device == "cuda" or plan.persistent_grads or dp else 0
    if plan.speculative and plan.device == "cpu" and micro_batches == 1 and not dp:
        absorbed = 0  # speculated gradients are used where autograd left them
    memcpy = hardware.memcpy_gbps * 1e9
    # the units whose updates wait for the end of backward: all of a deferred plan's; of a
    # speculative one those whose state is not all on SSD (they cannot speculate)
    deferred = sum(u.numel for u, p in plan if not _speculates(plan, u, p)) / plan.ranks
    # (speculating: the norm is taken in the Adam pass; a deferred unit's when absorbed)
    norm = deferred * plan.ranks if absorbed else 0
    absorb = (absorbed * micro_batches * 8 + norm * 4) / memcpy
    worker = absorb + adam
    sched_keep = _next_keep(plan)
    cdt = plan.compute_dtype
    read = write = 0
    h2d = d2h = 0
    comm = 0.0
    for u, p in plan:
        if p.moments is Tier.SSD:
            read += u.moments_bytes
            write += u.moments_bytes
        if p.master is Tier.SSD:
            write += u.master_bytes
            if plan.separate_weights:
                read += u.master_bytes
        if plan.separate_weights and p.weights is Tier.SSD:
            write += u.weights_home_bytes(cdt)
            if u.name not in sched_keep:
                read += u.weights_home_bytes(cdt)  # fetched at least once for the next forward
        if dp:
            comm += link.ring_bytes(u.grad_bytes) + link.ring_bytes(u.weights_bytes(cdt))
        if plan.device == "cuda":
            w = u.weights_home_bytes(cdt)  # (over several ranks the rest comes by the gather)
            h2d += w if p.weights is Tier.DEVICE else micro_batches * w
            d2h += micro_batches * u.numel * DTYPE_BYTES[cdt]
    rb, wb = hardware.ssd_rates()
    ssd = read / (rb * 1e9) + write / (wb * 1e9)
    link_s = (
        max(h2d / (hardware.h2d_gbps * 1e9), d2h / (hardware.d2h_gbps * 1e9))
        if plan.device == "cuda"
        else 0.0
    )
    comm_s = comm / (link.bus_gbps() * 1e9) if dp else 0.0
    return _PlanTerms(
        fwd, visit_compute, adam, worker, deferred, numel, lazy_applies(plan), ssd, link_s, comm_s
    )


def _speculates(plan: Plan, u, p) -> bool:
    """Whether unit u's update runs during backward in a step of `plan`: every update of a plan
    not deferred; of a speculative one, where the unit's state all lives on SSD (the replay's
    Unit.can_speculate, the runtime's)."""
    if not plan.deferred_update:
        return True
    if not plan.speculative:
        return False
    homes = plan.homes(u, p)
    return all(homes[a] is Tier.SSD for a in ("master", "exp_avg", "exp_avg_sq", "weights") if a in homes)


def _next_keep(plan: Plan) -> frozenset:
    """The units whose updated weights stay in memory for the next forward (schedule.next_keep,
    before the CPU device's _keep_across, which only separate weights need here)."""
    units = plan.units
    k = plan.prefetch_depth
    first = [u for u in units[: k + 2]]
    return frozenset(n for u in first for n in (u.name, *u.borrows))
