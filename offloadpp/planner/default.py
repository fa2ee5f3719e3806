"""The default placement policy: stream what must be streamed, keep what fits, the rest on SSD.

Pure (no torch). This is Settings.plan "default"; the cost-model planner (search.py) is "auto".
The rule:

1. The streaming working set (everything on SSD) must fit the budgets with some prefetch depth:
   k = 2, else 1, else 0 (no look-ahead), unless the caller fixed k. If even k = 0 does not fit,
   the budget is too small for one unit: a PlanError names the unit and the bytes.
2. What is left of the budgets keeps arrays in memory by planner/keep.py's rule, the one the
   search's fills use too: by the SSD bytes per step each saves per byte it holds (masters, the
   most-read arrays, first; then persistent gradients, unit by unit in the order the pending
   updates read them, and moments), while the schedule's peaks fit. The plan's notes say which
   and why.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from .decide import DEFAULT_OPTIM_PREFETCH, clipping, optim_prefetch_depth, prefetch_depth, speculates
from .keep import keep_and_explain
from .plan import InfeasibleError, Plan, PlanError, UnitSpec, all_on_ssd, fmt_bytes
from .schedule import build_schedule
from .spec import Budgets, Settings


def streaming_plan(
    units: Sequence[UnitSpec], *, optim_prefetch_depth: int = DEFAULT_OPTIM_PREFETCH, **fields
) -> Plan:
    """Every array of every unit on SSD: the Plan with `fields` (any of Plan's but units and
    placements; device, compute_dtype and prefetch_depth at least, plan_shape's from settings),
    its optimizer read-ahead at most the units after the first."""
    return Plan(
        units=tuple(units),
        placements=all_on_ssd(units),
        optim_prefetch_depth=min(optim_prefetch_depth, max(0, len(units) - 1)),
        **fields,
    )


def plan_shape(settings: Settings) -> dict:
    """The keyword arguments of streaming_plan that come from the settings."""
    return dict(
        compute_dtype=settings.compute_dtype,
        accumulate_grads=settings.accumulate_grads,
        deferred_update=settings.deferred_update,
        speculative=speculates(settings),
        clipping=clipping(settings),
        fill_gaps=settings.fill_gaps,
    )


def with_peak_budgets(plan: Plan, activation_bytes: Optional[int] = None) -> Plan:
    """`plan` with budgets equal to its schedule's peaks: exactly what it needs (hand-written
    plans in benchmarks and tests; the resolve stage sizes budgets for real runs)."""
    s = build_schedule(plan)
    return replace(
        plan, budgets=Budgets(s.peak_device_bytes, s.peak_host_bytes, activation_bytes=activation_bytes)
    )


def min_budgets(units: Sequence[UnitSpec], **kwargs) -> tuple[int, int]:
    """(device_bytes, host_bytes) the streaming plan needs: the smallest budgets that run.
    Takes streaming_plan's keyword arguments."""
    sched = build_schedule(streaming_plan(units, **kwargs))
    return sched.peak_device_bytes, sched.peak_host_bytes


def default_plan(units: Sequence[UnitSpec], *, device: str, settings: Settings, budgets: Budgets,
                 micro_batches: int = 1) -> Plan:  # fmt: skip
    """The rule of the module docstring, for `settings` within `budgets`; micro_batches: a
    vertical window's (Request.window), whose step's peaks count what its visits hold for them
    (holds.visit_grad_bytes), so what is kept fits beside them."""
    if not units:
        raise PlanError("no units to plan: the model has no parameters")
    base = dict(device=device, budgets=budgets, micro_batches=micro_batches, **plan_shape(settings))
    k_fixed, q_fixed = settings.prefetch_depth, settings.optim_prefetch_depth
    q = optim_prefetch_depth(settings)
    ks = (k_fixed,) if k_fixed is not None else (prefetch_depth(settings), 1, 0)
    qs = (q,) if q_fixed is not None else tuple(range(min(q, len(units) - 1), -1, -1))
    dev_b, host_b = budgets.buffer_bytes, budgets.host_bytes  # (the activations have their part)
    # Deepest weights prefetch first, then the deepest optimizer read-ahead that also fits.
    for k in ks:
        for q_try in qs:
            plan = streaming_plan(units, prefetch_depth=k, optim_prefetch_depth=q_try, **base)
            sched = build_schedule(plan)
            if sched.peak_device_bytes <= dev_b and sched.peak_host_bytes <= host_b:
                return keep_and_explain(plan, dev_b, host_b)
    smallest = streaming_plan(units, prefetch_depth=ks[-1], optim_prefetch_depth=qs[-1], **base)
    sched = build_schedule(smallest)
    if sched.peak_device_bytes > dev_b:
        _raise_device_too_small(units, smallest, sched.peak_device_bytes)
    _raise_host_too_small(units, smallest, sched.peak_host_bytes)
    raise AssertionError("unreachable")


def _raise_device_too_small(units: Sequence[UnitSpec], plan: Plan, need: int) -> None:
    cdt = plan.compute_dtype
    biggest = max(units, key=lambda u: u.weights_bytes(cdt))
    b = plan.budgets
    what = (f"device budget of {fmt_bytes(b.device_bytes)} ({b.device_bytes} bytes)" if b.activation_bytes is None else
            f"device budget's {fmt_bytes(b.buffer_bytes)} ({b.buffer_bytes} bytes) for buffers (of {b.device_bytes} "
            f"bytes, {b.activation_bytes} for activations)")  # fmt: skip
    raise InfeasibleError(
        f"{what} is too "
        f"small: streaming the units with prefetch depth {plan.prefetch_depth} needs at least {fmt_bytes(need)} "
        f"({need} bytes); the largest unit {biggest.name!r} has {biggest.numel:,} parameters "
        f"({fmt_bytes(biggest.weights_bytes(cdt))} of {cdt} weights). Raise the device budget to at least {need + (b.activation_bytes or 0)} bytes."
    )


def _raise_host_too_small(units: Sequence[UnitSpec], plan: Plan, need: int) -> None:
    biggest = max(units, key=lambda u: u.moments_bytes)
    raise InfeasibleError(
        f"host budget of {fmt_bytes(plan.budgets.host_bytes)} ({plan.budgets.host_bytes} bytes) is too "
        f"small: the optimizer's working set with optimizer prefetch depth "
        f"{plan.optim_prefetch_depth} needs at least {fmt_bytes(need)} ({need} bytes); the largest "
        f"unit {biggest.name!r} has {biggest.numel:,} parameters ({fmt_bytes(biggest.moments_bytes)} of "
        f"Adam moments). Raise the host budget to at least {need} bytes."
    )
