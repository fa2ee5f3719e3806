"""Plans made elsewhere (a plan file, a caller): read, and checked against the model's units,
the settings and the plan's own budgets before resolve hands them to the runtime. Pure."""

from __future__ import annotations

from typing import Optional, Sequence

from .cost import StepEstimate
from .decide import clipping
from .plan import Plan, PlanError, UnitSpec, fmt_bytes
from .planfile import load_plan
from .schedule import build_schedule
from .spec import Settings


def check_plan(plan: Plan, units: Sequence[UnitSpec], device: str, settings: Settings) -> None:
    """A plan made elsewhere (a file, a caller) must be for these units and these settings."""
    if list(plan.units) != list(units):
        raise PlanError(
            "the plan was made for other units: plan has "
            f"{[(u.name, u.numel) for u in plan.units]}, the model {[(u.name, u.numel) for u in units]}"
        )
    want = dict(
        device=device,
        compute_dtype=settings.compute_dtype,
        accumulate_grads=settings.accumulate_grads or plan.accumulate_grads,
        deferred_update=settings.deferred_update or plan.deferred_update,
    )
    if plan.vertical:  # (a vertical window holds micro_batches micro-batches' activations at once)
        want["micro_batches"] = settings.gradient_accumulation_steps
    if plan.speculative:  # (the runtime reads Plan.clipping: whether a speculative step may be redone)
        want["clipping"] = clipping(settings)
    for k, v in want.items():
        if getattr(plan, k) != v:
            raise PlanError(f"plan.{k} is {getattr(plan, k)!r} but the settings need {v!r}")


def check_fits(plan: Plan) -> None:
    """The schedule's peaks fit the plan's budgets (a plan from a file, or edited by hand)."""
    b = plan.budgets
    if b is None:
        raise PlanError("the plan has no budgets: make it with offloadpp plan or planner.resolve")
    s = build_schedule(plan)
    for tier, peak, budget in (
        ("device", s.peak_device_bytes, b.buffer_bytes),
        ("host", s.peak_host_bytes, b.host_bytes),
    ):
        if peak > budget:
            raise PlanError(
                f"the plan needs {fmt_bytes(peak)} ({peak} bytes) of {tier} buffers at its peak but its {tier} budget "
                f"is {fmt_bytes(budget)} ({budget} bytes)"
            )


def load_saved_plan(settings: Settings) -> Optional[tuple[Plan, Optional[StepEstimate]]]:
    """The plan file `settings.plan` names, read (None when the plan is made here)."""
    return load_plan(settings.plan_path) if settings.plan_path is not None else None
