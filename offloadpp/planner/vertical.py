"""Vertical accumulation as the planner sees it: a window of G micro-batches driven whole
(train_batch, the Trainer's window) planned and replayed as one step (Settings.accumulation,
Plan.vertical; docs/planner.md "Vertical accumulation"). Pure (no torch).

Note: a vertical window is one step of G micro-batches' tokens. Forward visits each unit once and
runs it over all G micro-batches while its weights are resident; backward likewise in reverse,
the unit's gradient summed over them on the device and handed to the optimizer once. So per
window, every array moves as in one step of G = 1 (weights read once for forward and once for
backward, or kept between the two; gradients out once; master and moments read and written
once), while the device computes G micro-batches at each visit and holds the activations of G
micro-batches between a unit's forward and its backward. The planner makes and replays that
step with the model profile of the window (`window_profile`: each unit's FLOPs, times and saved
bytes G times one micro-batch's, as a micro-batch of G x b sequences has them) and the plan's
gradients not accumulated across micro-batches in their home (`window_plan`); bytes by kind,
the link, the peaks and the activation policies all come out of the same replay as any step's.
With 16-bit compute the window's gradients are summed in fp32 on the device and rounded once
to the compute dtype as they are handed out (Plan.window_grad_dtype and its Note): they cross
the link, host memory and the SSD (a deferred update's) in 16 bits, as one step's do, where a
per-micro-batch loop with the same plan keeps its fp32 sum in their home (Plan.grad_dtype).

A visit runs its micro-batches one at a time, so what a unit holds at once is what its policy
keeps of the others and one micro-batch's forward or backward (a recompute's G checkpoints and
one micro-batch's recomputed tensors; a swapped unit's one micro-batch fetched back): the
activation need counts that (activations.window_bytes, ModelProfile.window), and so do the
choices and the refusal's largest micro-batch. What this does not see: the replay moves a
unit's G micro-batches' swapped bytes as one copy (out after its forward, back before its
backward) and counts them on the device together, where the runtime pipelines them micro-batch
by micro-batch (the replay is conservative there); the runtime's per-visit cost is counted
once per visit, not per micro-batch (at most G x 1.5 ms a visit on the CPU device).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .model_profile import ModelProfile, UnitProfile
from .peaks import peak_bytes
from .plan import Plan, PlanError, fmt_bytes
from .spec import Budgets, Settings

# The scaled sizes of a unit: the bytes its forward saves and what they are made of, its FLOPs.
_PER_TOKEN = ("forward_flops", "backward_flops", "activation_bytes", "output_bytes", "partial_bytes",
              "partial_extra_bytes", "logits_bytes", "loss_input_bytes")  # fmt: skip


def window_profile(model: ModelProfile, micro_batches: int) -> ModelProfile:
    """The model profile of a vertical window of `micro_batches` micro-batches: every size that
    grows with the tokens a visit runs (FLOPs, measured times, saved bytes and their pieces) G
    times one micro-batch's; the head's loss workspace (a weight-sized buffer) as it is."""
    g = micro_batches
    if g == 1:
        return model

    def unit(u: UnitProfile) -> UnitProfile:
        kw = {k: getattr(u, k) * g for k in _PER_TOKEN}
        kw["pieces"] = tuple(tuple(x * g for x in piece) for piece in u.pieces)
        kw["piece_kept"] = tuple(tuple(x * g for x in kept) for kept in u.piece_kept)
        kw["piece_freed"] = tuple(tuple((a, n * g) for a, n in f) for f in u.piece_freed)
        kw["forward_s"] = u.forward_s * g if u.forward_s is not None else None
        kw["backward_s"] = u.backward_s * g if u.backward_s is not None else None
        return replace(u, **kw)

    return replace(model, micro_batch=model.micro_batch * g, window=model.window * g,
                   units=tuple(unit(u) for u in model.units))  # fmt: skip


def window_settings(settings):
    """The settings a vertical window is planned with: one step (no accumulation across
    micro-batches in the gradients' home), everything else as asked."""
    return settings.model_copy(update={"gradient_accumulation_steps": 1, "accumulation": "horizontal"})


def as_vertical(window: Plan, micro_batches: int) -> Plan:
    """The plan the runtime runs, from the plan of its vertical window (made for window_settings):
    gradients accumulated (a per-micro-batch loop still runs horizontally with it, its gradients
    in the placements' grads tier), vertical over `micro_batches`, the window's activation
    policies for a window run whole and for a per-micro-batch loop alike (one micro-batch needs
    no more room than G)."""
    acts = tuple(window.activations)
    return replace(window, accumulate_grads=True, vertical=True, micro_batches=micro_batches,
                   vertical_activations=acts)  # fmt: skip


def window_plan(plan: Plan) -> Plan:
    """The plan as its vertical window runs (and is replayed): gradients not accumulated in their
    home (summed on the device and kept in Plan.window_grad_dtype), the window's activation
    policies; micro_batches kept."""
    if not plan.vertical:
        raise PlanError("window_plan: the plan is not vertical (Plan.vertical is False)")
    return replace(plan, accumulate_grads=False, vertical=False, activations=plan.vertical_activations)


def fits_per_micro_batch(plan: Plan, settings: Settings) -> tuple[Plan, Optional[str]]:
    """A vertical plan also runs a per-micro-batch loop, horizontally, its gradients accumulated
    in their tier: budgets the settings left "auto" grow to what that needs (the schedule's
    peaks); asked budgets it does not fit make the plan horizontal (the reason)."""
    b = plan.budgets
    assert b is not None
    dev, host = peak_bytes(plan)
    if dev <= b.buffer_bytes and host <= b.host_bytes:
        return plan, None
    asked = [n for n, v, need, have in (("device_budget_bytes", settings.device_budget_bytes, dev, b.buffer_bytes),
                                        ("host_budget_bytes", settings.host_budget_bytes, host, b.host_bytes))
             if v is not None and need > have]  # fmt: skip
    if asked:
        return plan, (
            f"a per-micro-batch loop with its plan (gradients accumulated in their tier) needs {fmt_bytes(dev)} of "
            f"device buffers and {fmt_bytes(host)} of host buffers, beyond the asked {' and '.join(asked)}"
        )
    act = b.activation_bytes
    dev_b = max(b.device_bytes, dev + (act or 0))  # (the activations' part as planned, the buffers the rest)
    return replace(plan, budgets=Budgets(dev_b, max(b.host_bytes, host), activation_bytes=act)), None


def window_note(
    g: int, vertical: bool, h_s: Optional[float], v_s: Optional[float], why: Optional[str]
) -> str:
    """The plan's note on how a window of g micro-batches runs."""
    if why is not None:
        return f"a window of {g} micro-batches runs horizontally (train_batch too): vertical is impossible: {why}"
    if h_s is None or v_s is None:
        return (f"a window of {g} micro-batches driven whole (train_batch) runs "
                f"{'vertically' if vertical else 'horizontally'} (no estimate to compare the two)")  # fmt: skip
    gain = h_s / v_s
    if vertical:
        return (f"a window of {g} micro-batches driven whole (train_batch, the Trainer's window) runs vertically: "
                f"{v_s:.3f} s against {h_s:.3f} s horizontally ({gain:.2f}x); a per-micro-batch loop "
                "(forward/backward/step) runs horizontally")  # fmt: skip
    return (f"a window of {g} micro-batches runs horizontally: {h_s:.3f} s against {v_s:.3f} s vertically "
            f"({1 / gain:.2f}x)")  # fmt: skip


def loop_grads_homes(vplan: Plan, hplan: Plan) -> Plan:
    """A vertical plan with the horizontal plan's gradient homes, where its window does not use
    them (no deferred update: the window's sums go to the optimizer once, never through a home).
    Its plan was made for one step of the window (window_settings), where nothing kept gradients
    between micro-batches and their home was free to be anywhere (on SSD); a per-micro-batch loop
    run with it accumulates there, and moved every unit's gradients through the SSD at each
    micro-batch (GPT-2 on a 1 GB/s SSD: 6x the horizontal plan's loop)."""
    if vplan.deferred_update:
        return vplan
    homes = {p.unit: p.grads for p in hplan.placements}
    placements = tuple(replace(p, grads=homes.get(p.unit, p.grads)) for p in vplan.placements)
    return vplan if placements == vplan.placements else replace(vplan, placements=placements)


__all__ = [
    "as_vertical",
    "fits_per_micro_batch",
    "loop_grads_homes",
    "window_note",
    "window_plan",
    "window_profile",
    "window_settings",
]
