"""Plans as JSON: what `offloadpp plan --json` writes and `"plan": "PATH"` in a config reads.

Pure (no torch). The file holds the Plan (units, placements, depths, budgets) and, when the
planner made it, the estimate it was chosen with, so the runtime can log predicted against
measured step time without the profiles at hand.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from typing import Any, Mapping, Optional

from .cost import StepEstimate
from .plan import Placement, Plan, PlanError, Tier, UnitSpec
from .spec import Budgets

PLANFILE_VERSION = 2


def plan_to_dict(plan: Plan, estimate: Optional[StepEstimate] = None) -> dict:
    d: dict[str, Any] = {"version": PLANFILE_VERSION}
    for f in fields(Plan):
        if f.name in ("units", "placements", "notes", "budgets"):
            continue
        d[f.name] = getattr(plan, f.name)
    d["budgets"] = asdict(plan.budgets) if plan.budgets is not None else None
    d["units"] = [
        {
            "name": u.name,
            "numel": u.numel,
            "borrows": list(u.borrows),
            "backward_needs_weights": u.backward_needs_weights,
            "frozen_numel": u.frozen_numel,
            "frozen_dtype": u.frozen_dtype,
        }
        for u in plan.units
    ]
    d["placements"] = [
        {"unit": p.unit, "weights": p.weights.value, "master": p.master.value, "moments": p.moments.value,
         "grads": p.grads.value}
        for p in plan.placements
    ]  # fmt: skip
    d["notes"] = list(plan.notes)
    if estimate is not None:
        d["estimate"] = estimate.as_dict()
    return d


def _tier(v: Any, where: str) -> Tier:
    try:
        return Tier(v)
    except ValueError:
        raise PlanError(f"{where}: tier must be one of {[t.value for t in Tier]}, got {v!r}") from None


def plan_from_dict(d: Mapping[str, Any]) -> tuple[Plan, Optional[StepEstimate]]:
    if not isinstance(d, Mapping):
        raise PlanError(f"a plan file must hold a JSON object, got {type(d).__name__}")
    if d.get("version") != PLANFILE_VERSION:
        raise PlanError(f"plan file version must be {PLANFILE_VERSION}, got {d.get('version')!r}")
    known = {f.name for f in fields(Plan)} | {"version", "estimate"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise PlanError(f"plan file has unknown field(s) {unknown}")
    try:
        units = tuple(
            UnitSpec(
                u["name"],
                int(u["numel"]),
                tuple(u.get("borrows", ())),
                bool(u.get("backward_needs_weights", True)),
                frozen_numel=int(u.get("frozen_numel", 0)),
                frozen_dtype=u.get("frozen_dtype"),
            )
            for u in d["units"]
        )
        placements = tuple(
            Placement(
                p["unit"],
                _tier(p["weights"], f"placements[{i}].weights"),
                _tier(p["master"], f"placements[{i}].master"),
                _tier(p["moments"], f"placements[{i}].moments"),
                _tier(p.get("grads", "host"), f"placements[{i}].grads"),
            )
            for i, p in enumerate(d["placements"])
        )
    except KeyError as e:
        raise PlanError(f"plan file: a unit or placement lacks the field {e.args[0]!r}") from None
    kw = {
        k: v
        for k, v in d.items()
        if k not in ("version", "estimate", "units", "placements", "notes", "budgets")
    }
    budgets = None
    if d.get("budgets") is not None:
        try:
            budgets = Budgets(**d["budgets"])
        except (TypeError, ValueError) as e:
            raise PlanError(f"plan file: budgets: {e}") from None
    plan = Plan(units=units, placements=placements, notes=tuple(d.get("notes", ())), budgets=budgets, **kw)
    est = None
    if d.get("estimate") is not None:
        e = dict(d["estimate"])
        e["ssd_by_kind"] = tuple(tuple(x) for x in e.get("ssd_by_kind", ()))  # JSON lists
        est = StepEstimate(**e)
    return plan, est


def save_plan(path: str, plan: Plan, estimate: Optional[StepEstimate] = None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(plan_to_dict(plan, estimate), f, indent=2)
        f.write("\n")


def load_plan(path: str) -> tuple[Plan, Optional[StepEstimate]]:
    if not os.path.isfile(path):
        raise PlanError(
            f"plan file {path!r} does not exist (write one with `offloadpp plan ... --json {path}`)"
        )
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {path!r} is not valid JSON: {e}") from None
    return plan_from_dict(d)


__all__ = ["plan_to_dict", "plan_from_dict", "save_plan", "load_plan"]
