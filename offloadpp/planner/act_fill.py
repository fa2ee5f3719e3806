"""What a plan says about its activations, filled in by resolve: each unit's policy (the plan's
own, else the settings') and, with a model profile, each unit's saved and checkpoint bytes
(what `offloadpp plan` prints). Pure."""

from __future__ import annotations

from dataclasses import replace

from .activations import act_units, recomputes
from .model_profile import ModelProfile
from .plan import Plan, PlanError
from .spec import Settings


def with_activation_sizes(plan: Plan, model: ModelProfile) -> Plan:
    """The plan with each unit's saved and checkpoint bytes from the model profile (printout);
    a partial unit's kept bytes count its pieces' checkpoints beyond its own inputs (the second
    norm's: what it moves is inputs + kept); its tail (its last pieces' checkpoints and kept
    outputs) is what partial_last moves beside its first checkpoint; its pieces' checkpoints are
    what recompute_pieces moves (activations.sized_split)."""
    sizes = {a.name: (a.saved, a.checkpoint, a.partial + a.partial_inputs - a.inputs if a.partial else 0, a.partial_extra,
                      a.tail if a.partial else 0, a.partial_inputs if a.pieces else 0)
             for a in act_units(model)}  # fmt: skip
    return replace(plan, activation_sizes=tuple(sizes.get(u.name, (0,) * 6) for u in plan.units))


def with_activation_policies(plan: Plan, settings: Settings) -> Plan:
    """The plan with each unit's activation policy: the plan's own if it names them, else the
    settings' policy and per-unit overrides ("auto": "keep" where no budget limits them). A unit
    whose backward reads none of its weights (embedding lookups) cannot run its forward again:
    "recompute" (and its swapped-checkpoint forms) becomes "keep" there."""
    act = settings.activations
    names = [u.name for u in plan.units]
    unknown = sorted(set(act.overrides) - set(names))
    if unknown:
        raise PlanError(
            f"activations.overrides names units the model does not have: {unknown}; units are {names}"
        )
    chosen = tuple(plan.activations) or tuple(act.overrides.get(n, act.policy) for n in names)
    unlimited = plan.budgets is None or plan.budgets.activation_bytes is None
    out, notes = [], []
    for u, p in zip(plan.units, chosen):
        if p == "auto" and unlimited:  # nothing to fit: keep
            p = "keep"
        if recomputes(p) and not u.backward_needs_weights:
            notes.append(
                f"unit {u.name!r}: its backward reads no weights, so it cannot recompute: activations kept"
            )
            p = "keep"
        out.append(p)
    if "auto" in out:
        notes.append('activations "auto": decided by planner/decide.py measured_activations from the sizes the first '
                     "step measures (no model profile at plan time: a hardware profile brings one)")  # fmt: skip
    return replace(plan, activations=tuple(out), notes=plan.notes + tuple(notes))
