"""The resolve stage: Settings + hardware profile + model profile + what the machine has free
-> the byte budgets and the Plan the runtime runs (DESIGN.md, "one spine"). Pure.

    r = resolve(settings, units, machine, hardware=hw, model=profile, saved=(plan, estimate))
    r.plan          # budgets inside (r.plan.budgets); the runtime executes it as it is
    r.estimate      # the cost model's step time, when profiles were given
    r.settings      # the settings with what resolve decided filled in (Adam threads, read-ahead)

`offloadpp.initialize`, `offloadpp plan` and every benchmark reach this one function (through
offloadpp/assemble.py, which gathers the inputs), so the plan printed is the plan that runs.

Note: "auto" budgets (Settings' None).
  - Where the settings put the state on SSD (offload_params / offload_optimizer, from
    ZeRO-Infinity's nvme offload), the budget is what streaming it needs and no more: the
    schedule's peaks for the streaming plan (planner.peaks.peak_bytes), so the state lives
    on SSD as asked and resident memory stays small whatever the machine has free.
  - The optimizer read-ahead q those budgets are sized for: with deferred updates (clipping,
    fp16) the updates run after backward and the state of the first q+1 of them is read during
    backward; with q covering every unit they wait for no read at all. So q covers every unit
    when its host buffers take at most READ_AHEAD_HOST_SHARE of the host memory available, else
    it is DEFERRED_PARTIAL_PREFETCH (none): a read-ahead of some units but not all only moves
    memory from the rest of the machine into buffers (a unit's state and gradients: 1.2 GB at
    GPT-2 2.3B), for a model whose updates are bound by the SSD anyway (measured: the same step
    time at q=0 as at q=1 through `offloadpp bench capacity`, 1.2 GiB less peak RSS). The plan is then made for exactly that q.
  - Elsewhere a share of what is free now: on CUDA DEVICE_SHARE_CUDA of the free device memory
    (the rest for the allocator's slack and the tensors a unit's compute makes and drops), on
    the CPU acting as the device DEVICE_SHARE_CPU of available RAM; host memory HOST_SHARE of
    available RAM (the rest for swapped activations, the model's own code and the OS).

Note: the activations in the device budget. With a model profile (plan "auto", or any plan
with a hardware profile) the saved activations are counted in the device budget: an "auto"
device budget that streams is the buffers' need plus what keeping every activation needs (at
most the activation budget), as far as the device's share allows; the planner then leaves the
activations what each placement does not take (at most `activations.budget_bytes`) and picks
their policies to fit it (planner/activations.py). Without a model profile nothing says how large
they are: they are not counted, and only an explicit activation budget is added to the streaming
device budget. Where even swapping every activation does not fit, the run is refused with the
largest micro-batch that would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from .act_fill import with_activation_policies, with_activation_sizes
from .budgets import (  # noqa: F401 (re-exported: what "auto" budgets are, named where resolve is)
    DEFERRED_PARTIAL_PREFETCH,
    DEVICE_SHARE_CPU,
    DEVICE_SHARE_CUDA,
    HOST_SHARE,
    READ_AHEAD_HOST_SHARE,
    budgets_for,
    check_asked_budgets,
)
from .cost import StepEstimate, estimate
from .decide import (
    LOOP_SLOWDOWN_TOLERANCE,
    accumulation,
    activation_choice,
    adam_threads,
    clipping,
    deferral_note,
    deferred_where,
    loop_candidates,
    loop_pick_note,
    optim_prefetch_depth,
    overlap_pays,
    prefetch_depth,
    speculates,
)
from .default import default_plan, plan_shape, streaming_plan
from .given_plan import check_fits, check_plan, load_saved_plan
from .hardware import HardwareProfile
from .infeasible import raise_infeasible
from .io_settings import with_io
from .machine import Machine
from .model_profile import ModelProfile
from .peaks import peak_bytes
from .plan import InfeasibleError, Plan, PlanError, UnitSpec, fmt_bytes, shard_units
from .profiles import (  # noqa: F401 (re-exported: assemble.py and the CLI read them here)
    CONTEXT_KEYS,
    _check_profiles,
    _check_units,
    load_hardware,
    model_profile_for,
)
from .ranks import RankLink
from .request import Request
from .search import act_planner, remembering, search
from .spec import PLAN_AUTO, Budgets, Settings
from .ssd_room import ssd_need_bytes
from .vertical import (
    as_vertical,
    fits_per_micro_batch,
    loop_grads_homes,
    window_note,
    window_profile,
    window_settings,
)


def machine_for(hw: HardwareProfile) -> Machine:
    """The Machine a hardware profile describes: its memory, cores and SSD space (not known
    unless every directory's free space is given). `offloadpp plan --machine-from-hardware`
    plans for it: what a hand-written profile of another machine is for."""
    free = [s.free_bytes for s in hw.ssds]
    return Machine(
        device=hw.device,
        host_available_bytes=hw.host_memory_bytes,
        device_free_bytes=hw.device_memory_bytes if hw.device == "cuda" else None,
        ssd_free_bytes=sum(free) if free and all(free) else None,
        cores=hw.cpu_cores,
    )


@dataclass(frozen=True)
class Resolved:
    settings: Settings
    plan: Plan
    estimate: Optional[StepEstimate] = None
    candidates: tuple = ()  # plan "auto": every plan the search scored, least estimate first
    # a speculative plan: the estimate of a step that runs its updates deferred (one that clips,
    # or every step with speculation off); `estimate` is that of a step that validates
    deferred_estimate: Optional[StepEstimate] = None
    # with accumulation: the resolve of the schedule not chosen for a window driven whole (the
    # horizontal one where the plan is vertical, the vertical one where it is not and could run),
    # for the printout; and why a vertical window cannot run, where it cannot
    other: Optional[Resolved] = None
    vertical_why_not: Optional[str] = None
    # a vertical plan: the estimate of a window of it run by a per-micro-batch loop (horizontally)
    loop_estimate: Optional[StepEstimate] = None
    # the horizontal schedule's search stopped at this estimate of the vertical window's (no plan
    # left could beat it): its plan is the first it replayed, its estimate above the window's
    beaten_by: Optional[float] = None

    @property
    def budgets(self) -> Budgets:
        assert self.plan.budgets is not None  # resolve always sets them
        return self.plan.budgets


def resolve(
    settings: Settings,
    units: Sequence[UnitSpec],
    machine: Machine,
    *,
    hardware: Optional[HardwareProfile] = None,
    model: Optional[ModelProfile] = None,
    saved: Optional[tuple[Plan, Optional[StepEstimate]]] = None,
    io_set: Optional[Mapping[str, int]] = None,
) -> Resolved:
    """Budgets and the Plan for `units` (the model's, in forward order) under `settings`.

    hardware / model: the profiles; plan "auto" needs both, other plans get an estimate when
    both are given. With a model profile the saved activations count in the device budget (see
    the module Note). io_set: the I/O settings the run fixes itself (IOConfig's block_size_bytes,
    queue_depth, num_threads): the plan carries them, else the profile's (io_settings.py). saved: the plan file `settings.plan` names, already read (load_saved_plan).
    Raises PlanError naming the budget, the unit and the bytes when nothing fits (an
    InfeasibleError with the largest micro-batch that fits where the activations do not)."""
    if machine.ranks > 1 and speculates(settings):
        # speculative updates are one process's: over several ranks updates are deferred
        if settings.speculate == "on":
            raise PlanError(
                f'speculate "on": speculative updates run in one process, this run has {machine.ranks} ranks; '
                'set speculate "auto" or "off"'
            )
        settings = settings.model_copy(update={"speculate": "off"})
    deferral = ()
    if (
        units
        and settings.plan_path is None
        and not settings.defer_updates
        and not overlap_pays(settings, units)
    ):
        # (a plan file keeps the deferral it was made with: check_plan)
        settings = settings.model_copy(update={"defer_updates": True})
        deferral = (deferral_note(units, settings.compute_dtype),)
    check_asked_budgets(settings, machine)
    units = shard_units(units, machine.ranks)
    if not units:
        raise PlanError("no units to plan: the model has no parameters")
    machine = machine.rank_share()
    settings = settings.model_copy(update={"adam_threads": adam_threads(settings, machine.cores)})
    if model is not None:
        _check_units(model, units)
        model = model.with_fused_loss(settings.activations.fused_loss)
    given = _Given(units, machine, hardware, model, io_set, deferral)
    with remembering():  # (a window's horizontal schedule may be searched twice: search.py's Note)
        return _with_window(settings, given, saved)


@dataclass(frozen=True)
class _Given:
    """What resolve() was given, made ready (units sharded, the rank's share of the machine, the
    model's loss as it runs), and the deferral note it decided: what each schedule's plan reads."""

    units: tuple
    machine: Machine
    hardware: Optional[HardwareProfile]
    model: Optional[ModelProfile]
    io_set: Optional[Mapping[str, int]]
    deferral: tuple


def _resolve_one(settings: Settings, given: _Given, saved, window: int = 1,
                 beat_s: Optional[float] = None, prefer: Optional[tuple] = None) -> Resolved:  # fmt: skip
    """resolve() for one schedule: a step of the settings' micro-batches, or (window > 1) a
    vertical window of that many planned as one step (planner/vertical.py). beat_s: another
    schedule's estimate, which the search stops at (Request.beat_s); prefer: the search's
    candidate to take (Request.prefer)."""
    units, machine, hardware, model = given.units, given.machine, given.hardware, given.model
    io_set, deferral = given.io_set, given.deferral
    budgets, settings = budgets_for(settings, units, machine, model, window)
    ask = {"window": window, "beat_s": beat_s, "prefer": prefer}
    try:
        plan, est, candidates = _make_plan(settings, units, machine, budgets, hardware, model, saved, ask)
    except PlanError:
        if settings.plan_path is not None or not speculates(settings) or settings.speculate != "auto":
            raise
        # the budgets were set for deferred updates: what speculation holds more does not fit
        plan, est, candidates = _make_plan(settings.model_copy(update={"speculate": "off"}), units, machine,
                                           budgets, hardware, model, saved, ask)  # fmt: skip
        plan = replace(plan, notes=plan.notes + (
            "the budgets do not hold what speculative updates hold during backward: updates are deferred",))  # fmt: skip
    plan = with_activation_policies(plan, settings)
    if model is not None:
        plan = with_activation_sizes(plan, model)
    speculative = with_speculation(plan, settings, machine)
    if speculative.speculative != plan.speculative:
        est = None  # estimated as it was made: estimated again below, as it runs
    plan = replace(speculative, notes=speculative.notes + deferral + settings_notes(settings, speculative))
    plan = with_io(plan, hardware, io_set or {})
    plan = replace(plan, adam_threads=settings.adam_threads)  # (decided above: decide.adam_threads)
    if hardware is not None and not plan.ssd_stripe:
        plan = replace(plan, ssd_stripe=hardware.stripe_weights())  # striped by the drives' rates
    deferred_est = None
    if hardware is not None and model is not None:
        _check_profiles(hardware, model, units, machine.device)
        kw = dict(adam_threads=settings.adam_threads, micro_batches=settings.gradient_accumulation_steps,
                  act_prefetch_units=settings.activations.prefetch_units,
                  link=rank_link(settings, machine, hardware))  # fmt: skip
        if est is None:
            est = estimate(plan, hardware, model, **kw)
        # what a step that clips costs: deferred updates (not for a schedule another beats: the
        # choice reads the estimates of steps that validate, and it is not run)
        if plan.speculative and (beat_s is None or est.step_s <= beat_s):
            deferred_est = estimate(plan, hardware, model, deferred=True, **kw)
    return Resolved(settings, plan, est, candidates, deferred_est)


def _with_window(settings: Settings, given: _Given, saved) -> Resolved:
    """The horizontal schedule's resolve and, with accumulation, the vertical window's, and the
    choice between them (decide.accumulation): the Resolved of the plan chosen, the other in
    `other`. A plan file keeps the choice it was made with.

    Note: the vertical window is planned first. Its estimate is the horizontal search's bar
    (Request.beat_s): once no horizontal plan left could beat it, that search stops (its plan is
    then the first it replayed, not its best: Resolved.beaten_by says so); planning both costs
    about what the horizontal search alone did, whose replays walk G micro-batches each. Where
    the window still runs horizontally (the vertical plan would slow a per-micro-batch loop,
    decide.accumulation), the horizontal search runs again without the bar, for its best plan."""
    g = settings.gradient_accumulation_steps
    hardware, model = given.hardware, given.model
    if g == 1 or settings.plan_path is not None:
        one = _resolve_one(settings, given, saved)
        return one if one.plan.micro_batches == g or settings.plan_path is not None else replace(
            one, plan=replace(one.plan, micro_batches=g))  # fmt: skip
    if settings.accumulation == "horizontal" or (
        settings.accumulation == "auto" and (hardware is None or model is None)
    ):  # (no estimates: nothing to choose by, decide.accumulation)
        one = _resolve_one(settings, given, saved)
        return replace(one, plan=replace(one.plan, micro_batches=g))
    window = replace(given, model=window_profile(model, g) if model is not None else None)

    def vertical_of(prefer: Optional[tuple] = None) -> tuple[Optional[Resolved], Optional[str]]:
        """The vertical window's resolve (the search's pick, or its candidate `prefer`), or why it cannot run."""
        try:
            v = _resolve_one(window_settings(settings), window, None, window=g, prefer=prefer)
        except InfeasibleError as e:
            return None, f"the activations of its {g} micro-batches held at once do not fit: {e}"
        except PlanError as e:
            return None, str(e)
        vplan, why = fits_per_micro_batch(as_vertical(v.plan, g), settings)
        return replace(v, plan=vplan, settings=v.settings.model_copy(
            update={"gradient_accumulation_steps": g, "accumulation": settings.accumulation})), why  # fmt: skip

    def with_loop(v: Resolved, horizontal: Resolved) -> tuple[Resolved, Optional[StepEstimate]]:
        """The vertical plan with the horizontal plan's gradient homes where a loop needs them, and
        its window run by a per-micro-batch loop (its placement, its micro-batches one by one)."""
        homes = loop_grads_homes(v.plan, horizontal.plan)
        fitted, homes_why = fits_per_micro_batch(homes, settings) if homes is not v.plan else (v.plan, None)
        v = v if homes_why is not None or fitted is v.plan else replace(v, plan=fitted)
        if hardware is None or model is None:
            return v, None
        return v, estimate(v.plan, hardware, model, adam_threads=v.settings.adam_threads, micro_batches=g,
                           act_prefetch_units=settings.activations.prefetch_units,
                           link=rank_link(settings, given.machine, hardware))  # fmt: skip

    v, why = vertical_of()
    v_s = v.estimate.step_s if v is not None and v.estimate is not None and why is None else None

    def horizontal_of(beat_s: Optional[float]) -> tuple[Resolved, Optional[float]]:
        one = _resolve_one(settings, given, saved, beat_s=beat_s)
        h = replace(one, plan=replace(one.plan, micro_batches=g))
        h_s = h.estimate.step_s if h.estimate is not None else None
        if beat_s is not None and h_s is not None and h_s > beat_s:
            h = replace(h, beaten_by=beat_s)
        return h, h_s

    horizontal, h_s = horizontal_of(v_s)
    loop = None
    options: list = []  # (vertical resolve, its loop), the pick first (decide.loop_candidates' Note)
    if v is not None and why is None:
        v, loop = with_loop(v, horizontal)
        if loop is not None and settings.accumulation == "auto":
            options.append((v, loop))
            for key in loop_candidates(v.candidates, v.estimate, h_s):
                alt, alt_why = vertical_of(prefer=key)
                if alt is not None and alt_why is None and alt.estimate is not None:
                    options.append(with_loop(alt, horizontal))
    if options and v_s is not None and horizontal.beaten_by is not None:
        # "auto" also asks that a loop with the vertical plan be no slower than the horizontal
        # plan's best (decide.accumulation): a search stopped at the window's bar says only that
        # its best is slower than the window; where the loop's bar is higher, search to that one.
        bar = min(lp.step_s for _, lp in options) / (1 + LOOP_SLOWDOWN_TOLERANCE)
        if bar > v_s:
            horizontal, h_s = horizontal_of(bar)
    # the first whose loop holds, the pick where none does (its note says what the loop costs)
    v, loop = next((o for o in options if accumulation(settings, h_s, o[0].estimate.step_s, None, o[1].step_s)),
                   (v, loop))  # fmt: skip
    v_s = v.estimate.step_s if v_s is not None else None
    if options and v is not options[0][0]:
        note = loop_pick_note(options[0][0].estimate.step_s, options[0][1].step_s)
        v = replace(v, plan=replace(v.plan, notes=v.plan.notes + (note,)))
    vertical = accumulation(settings, h_s, v_s, why, loop_s=loop.step_s if loop is not None else None)
    if not vertical and horizontal.beaten_by is not None:  # (its search stopped at a bar)
        horizontal, h_s = horizontal_of(None)
    window_s = tuple((k, t) for k, t in (("horizontal", h_s), ("vertical", v_s)) if t is not None)
    note = window_note(g, vertical, h_s, v_s, why)
    if not vertical and v_s is not None and h_s is not None and v_s < h_s and settings.accumulation == "auto":
        note = (f"a window of {g} micro-batches runs horizontally: vertically it would take {v_s:.3f} s against "
                f"{h_s:.3f} s, but its plan would slow a per-micro-batch loop (forward/backward/step) to "
                f"{loop.step_s:.3f} s, and \"auto\" never does; set accumulation \"vertical\" where windows are driven "
                "whole (train_batch, the Trainer's window)")  # fmt: skip
    if not vertical:
        plan = replace(horizontal.plan, window_s=window_s, notes=horizontal.plan.notes + (note,))
        return replace(horizontal, plan=plan, other=v if why is None else None, vertical_why_not=why)
    assert v is not None
    plan = replace(v.plan, window_s=window_s, notes=v.plan.notes + (note,))
    return replace(v, plan=plan, other=horizontal, loop_estimate=loop)


def _make_plan(settings: Settings, units, machine: Machine, budgets: Budgets, hardware, model, saved,
               ask: Optional[Mapping] = None):  # fmt: skip
    """(plan, estimate or None, candidates) for the settings: the plan file's, the search's or
    the default plan. ask: Request fields the caller sets ("window": a vertical window's
    micro-batches; "beat_s": the search's bar)."""
    ask = dict(ask or {})
    window = ask.get("window", 1)
    est: Optional[StepEstimate] = None
    candidates: tuple = ()
    if settings.plan_path is not None:
        if saved is None:
            raise PlanError(f"plan {settings.plan!r}: the plan file was not read (load_saved_plan)")
        plan, est = saved
        plan = replace(plan, clipping=clipping(settings))  # (what a speculative step keeps)
        check_plan(plan, units, machine.device, settings)
        plan = replace(plan, budgets=plan.budgets or budgets)  # a plan keeps the budgets it was made for
        check_fits(plan)
    elif settings.plan == PLAN_AUTO:
        if hardware is None or model is None:
            missing = "a hardware profile" if hardware is None else "a model profile"
            raise PlanError(f"plan 'auto' needs {missing}")
        _check_profiles(hardware, model, units, machine.device)
        req = replace(_request(settings, budgets, machine, hardware), **ask)
        result = search(hardware, model, req)
        plan, est, candidates = result.plan, result.best.estimate, result.candidates
    else:
        plan = replace(_default(settings, units, machine, budgets, model, window), micro_batches=window)
    return plan, est, candidates


def with_speculation(plan: Plan, settings: Settings, machine: Machine) -> Plan:
    """The plan, speculative where its updates are deferred (clipping, fp16), the settings let
    them run speculatively during backward (Settings.speculate; the planner sized the plan for it,
    plan_shape) and the SSDs have room for the second generation of state that needs: "auto"
    defers where they do not, "on" is refused."""
    if not plan.deferred_update or not speculates(settings):
        return replace(plan, speculative=False)
    if not plan.speculative:  # a plan file made without it, or budgets that do not hold it
        if settings.plan_path is None:
            return plan
        return replace(
            plan, notes=plan.notes + ("the plan file was made for deferred updates: not speculating",)
        )
    free = machine.ssd_free_bytes
    need = ssd_need_bytes(plan)
    if free is None or need <= free:
        return plan
    msg = (
        f"speculative updates keep a second generation of the optimizer state on SSD: {fmt_bytes(need)} "
        f"where {fmt_bytes(free)} is free"
    )
    if settings.speculate == "on":
        raise PlanError(f'{msg}; free {fmt_bytes(need - free)} or set speculate "auto" or "off"')
    return replace(plan, speculative=False, notes=plan.notes + (f"{msg}: updates are deferred",))


def settings_notes(settings: Settings, plan: Plan) -> tuple[str, ...]:
    """What the settings imply that the plan's table does not show."""
    out = []
    if plan.speculative:
        clip = clipping(settings)
        why = (["the loss scaler's overflow check"] if settings.compute_dtype == "fp16" else []) + (
            [f"the global norm (gradient clipping {settings.gradient_clipping:g})"] if clip else []
        )
        then = ["an overflowing step is skipped"] if settings.compute_dtype == "fp16" else []
        if clip:
            then.insert(0, "a step that clips is redone exactly from the previous generation of the state")
        if clip and settings.speculate == "auto":
            then.append(f"while clipping keeps triggering, updates are deferred: they {deferred_where(plan)}")
        out.append(
            "updates run during backward speculatively with the raw gradients and are validated at its end by "
            f"{' and '.join(why)}: {'; '.join(then)}"
        )
        return tuple(out)
    deferred = []
    if settings.defer_updates:  # (the deferral note says why, where resolve decided it)
        return tuple(out + [f"deferred updates {deferred_where(plan)}"]) if plan.deferred_update else ()
    if settings.compute_dtype == "fp16":
        deferred.append(
            "fp16: updates are deferred (the loss scaler's overflow check needs every gradient first); bf16 "
            "needs no loss scaling and keeps the overlap of Adam with backward"
        )
    if clipping(settings):
        deferred.append(
            f"gradient clipping ({settings.gradient_clipping:g}): updates are deferred (the global norm needs "
            "every gradient first), so Adam does not overlap backward (DeepSpeed's default is 1.0: set "
            '"gradient_clipping": 0 to keep the overlap)'
        )
    if deferred:
        deferred.append(f"deferred updates {deferred_where(plan)}")
    return tuple(out + deferred)


def _request(settings: Settings, budgets: Budgets, machine: Machine, hardware=None) -> Request:
    link = rank_link(settings, machine, hardware) if hardware is not None else None
    return Request(budgets, settings, adam_threads=settings.adam_threads, ssd_free_bytes=machine.ssd_free_bytes,
                   count_activations=True, act_host_bytes=_act_host_bytes(settings, budgets, machine),
                   ranks=machine.ranks, link=link)  # fmt: skip


def rank_link(settings: Settings, machine: Machine, hardware: HardwareProfile) -> Optional[RankLink]:
    """The ranks as the estimate sees them (planner/ranks.py; None for one): the collectives'
    bandwidth configured, else measured over the ranks at start (which includes the network
    between nodes), else the hardware profile's."""
    if machine.ranks == 1:
        return None
    measured = machine.collective_gbps
    intra = settings.collective_gbps or measured or hardware.collective_gbps
    net = (
        settings.network_gbps or (measured if not settings.collective_gbps else None) or hardware.network_gbps
    )
    return RankLink(local=machine.local_ranks, nodes=machine.nodes, collective_gbps=intra or 0.0,
                    network_gbps=net or 0.0)  # fmt: skip


def _act_host_bytes(settings: Settings, budgets: Budgets, m: Machine) -> int:
    """Host memory swapped activations may take: the settings' activation host budget, else what
    the host budget (and, on the CPU acting as the device, the device budget) leaves."""
    if settings.activations.host_budget_bytes is not None:
        return settings.activations.host_budget_bytes
    taken = budgets.host_bytes + (budgets.device_bytes if m.device == "cpu" else 0)
    return max(0, m.host_available_bytes - taken)


def _default(settings: Settings, units, machine: Machine, budgets: Budgets, model, window: int = 1) -> Plan:
    """The default plan; with a model profile, the activations' part of the device budget and
    their policies first (keep them all if they fit, else swap along the ranking and keep what
    fits: planner/activations.py)."""
    if model is None:
        return default_plan(
            units, device=machine.device, settings=settings, budgets=budgets, micro_batches=window
        )
    req = _request(settings, budgets, machine)
    acts = act_planner(model, req, machine.device)
    k, q = prefetch_depth(settings), optim_prefetch_depth(settings)
    shape = dict(plan_shape(settings), micro_batches=window)
    stream = streaming_plan(units, device=machine.device, prefetch_depth=k, optim_prefetch_depth=q, **shape)
    left = budgets.device_bytes - peak_bytes(stream)[0]
    room = min(req.act_cap, max(acts.least.need_bytes, min(acts.keep_all.need_bytes, left)))
    choice = activation_choice(acts, room) if room < budgets.device_bytes else None
    if choice is None:
        smallest = streaming_plan(units, device=machine.device, prefetch_depth=0, optim_prefetch_depth=0,
                                  **shape)  # fmt: skip
        raise_infeasible(smallest, req, acts, model)
    budgets = Budgets(budgets.device_bytes, budgets.host_bytes, activation_bytes=room)
    plan = default_plan(
        units, device=machine.device, settings=settings, budgets=budgets, micro_batches=window
    )
    return replace(plan, activations=tuple(p for _, p in choice.policies))


__all__ = [
    "Machine",
    "Resolved",
    "machine_for",
    "check_fits",
    "check_plan",
    "load_hardware",
    "load_saved_plan",
    "model_profile_for",
    "resolve",
    "with_activation_policies",
    "with_activation_sizes",
    "with_speculation",
]
