"""Decisions made once, at plan time: each is one function here, which the resolve stage, the
planner, the schedule, the cost model's replay and the runtime all call or read the result of
(carried in the Plan or in `Resolved.settings`), so none can disagree with another
(docs/runtime.md, "Decided once", lists them with the other decisions' homes).

Pure (no torch).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .act_candidates import ActChoice, ActPlanner
from .activations import ActUnit, recomputes
from .spec import DTYPE_BYTES

# The prefetch depths where the settings leave them to the planner ("auto"): the deepest the
# default plan tries first, and the optimizer read-ahead of every plan but a deferred one's
# (budgets._streaming_need decides that one).
DEFAULT_PREFETCH = 2
DEFAULT_OPTIM_PREFETCH = 2

# The cost model's prediction error: the bar every configuration of `offloadpp bench
# planner-accuracy` meets (|predicted - measured| / measured; the worst measured is 10%,
# docs/performance.md "Prediction error"). A gain the model predicts below it is one it cannot
# tell from nothing: overlap_pays.
PREDICTION_ERROR = 0.15


def clipping(settings) -> bool:
    """Gradient clipping by global norm is on (Plan.clipping carries it to the runtime: a
    speculative step that clips is redone, so it keeps its gradients until validated)."""
    return settings.gradient_clipping > 0


def speculates(settings) -> bool:
    """Plans are shaped for speculative updates: updates are deferred (clipping, fp16) and the
    settings do not turn speculation off. Whether the plan finally speculates (room on the SSDs
    for the second generation, one rank) is resolve.with_speculation's, carried in Plan.speculative.
    Updates deferred on purpose (Settings.defer_updates) run after backward, never speculatively."""
    return settings.deferred_update and settings.speculate != "off" and not settings.defer_updates


def overlap_share(units: Sequence, compute_dtype: str) -> float:
    """The largest share of a step that running the updates during backward can hide: the
    optimizer's bytes per step against those and the weights forward and backward read.

    Note: why bytes bound it. Per parameter a step's optimizer does a constant amount of work
    (each trainable parameter's gradient out, 4 B; master and moments read and written, 24 B;
    with 16-bit compute its new compute copy written), while forward and backward read every
    parameter's weights, frozen or not (2 x the compute dtype's bytes) and compute with each once
    per token. Only where both stream from the SSD is the optimizer's cost per parameter of the
    same order as the rest, so its share of the bytes is the most its overlap can save; in
    memory its FLOPs are a smaller share still (one Adam pass against 6 FLOPs per parameter per
    token). Placement aside, so it holds for every plan of these units (`units`: UnitSpec, each
    with its trainable `numel` and `frozen_numel`)."""
    d = DTYPE_BYTES[compute_dtype]
    trainable = sum(u.numel for u in units)
    frozen = sum(u.frozen_numel for u in units)
    optimizer = trainable * (4 + 24 + (d if d != 4 else 0))
    weights = 2 * d * (trainable + frozen)
    return optimizer / (optimizer + weights) if optimizer else 0.0


def overlap_pays(settings, units: Sequence) -> bool:
    """Updates may run during backward (not deferred, or speculatively): where the settings leave
    it to the planner (speculate "auto"), only if what that can save, overlap_share, reaches the
    cost model's prediction error. Running them during backward keeps a second generation of the
    optimizer state on SSD (runtime/slots.py: a step that is interrupted must vanish); a gain the
    model cannot tell from its own error is not worth a second copy of the state. A model with no
    frozen parameters always overlaps (its share is at least 28 / 36 B per parameter); a LoRA
    run's trainable state is about 1% of its base's bytes, and its updates run after backward,
    in place (resolve sets Settings.defer_updates, and the plan's notes say why: deferral_note).
    "on" and "off" keep their meaning (spec.py)."""
    return settings.speculate != "auto" or overlap_share(units, settings.compute_dtype) >= PREDICTION_ERROR


def deferral_note(units: Sequence, compute_dtype: str) -> str:
    """The plan's note where overlap_pays says no."""
    trainable = sum(u.numel for u in units)
    total = trainable + sum(u.frozen_numel for u in units)
    return (
        f'speculate "auto": updates run after backward, in place (neither during it nor speculatively): the '
        f"optimizer's work ({trainable:,} trainable of {total:,} parameters) is at most "
        f"{overlap_share(units, compute_dtype):.1%} of a step's bytes, below the cost model's prediction error "
        f"({PREDICTION_ERROR:.0%}), so overlapping it with backward would buy less than the model can tell and keep "
        'a second generation of the optimizer state on SSD; the state keeps one (speculate "on" overlaps them)'
    )


def prefetch_depth(settings) -> int:
    """The weights' prefetch depth the streaming minimum is sized at (the default plan then tries
    shallower ones where the budgets are smaller)."""
    return DEFAULT_PREFETCH if settings.prefetch_depth is None else settings.prefetch_depth


def optim_prefetch_depth(settings) -> int:
    """The optimizer read-ahead the plans start from (the streaming minimum's budgets may fix it
    first: budgets.budgets_for writes its choice into the settings)."""
    return DEFAULT_OPTIM_PREFETCH if settings.optim_prefetch_depth is None else settings.optim_prefetch_depth


def adam_threads(settings, cores: int) -> int:
    """Threads of the fused CPU Adam: the settings', else every core this process may run on
    (resolve writes it into Resolved.settings; an engine given a plan made elsewhere asks here)."""
    return settings.adam_threads or cores


def lazy_runtime(plan) -> bool:
    """Where the runtime applies a deferred step's updates at the next visit
    (OptimizerPipeline.lazy): one rank, on the CPU device and on CUDA (where the device copy of
    a unit's weights is made once its update made them: Slot.updating)."""
    return plan.deferred_update and plan.ranks == 1


def deferred_where(plan) -> str:
    """Where a plan's deferred updates run (the runtime's OptimizerPipeline.lazy), for its notes."""
    if lazy_runtime(plan):
        return (
            "are applied at each unit's next visit (the next forward reads master, moments and gradients once, "
            "updates, and computes with the new weights: runtime/pending.py)"
        )
    if plan.ranks > 1:
        return (
            f"run as a pass after backward over the {plan.ranks} ranks (each rank's shard of every unit: "
            "gradients reduce-scattered, the global norm all-reduced, Adam on the shard; neither at the next "
            "visit nor speculatively, both one process's)"
        )
    return "run as a pass after backward"


def lazy_applies(plan) -> bool:
    """Where the replay does (a speculative plan's replay is of a step that validates)."""
    return lazy_runtime(plan) and not plan.speculative


def activation_choice(acts: ActPlanner, room: int) -> Optional[ActChoice]:
    """The activation policies where the settings leave them "auto" and no search scores them
    (plan "default"; a plan without a model profile: measured_activations): every unit kept if
    that fits `room` device bytes; else the units the settings leave free swapped, to host
    memory on CUDA (to SSD beyond the host memory left for them) and to SSD on the CPU acting as
    the device, keeping along the FLOPs-per-byte ranking what fits (planner/activations.py);
    else the first choice that fits; None where not even the least does."""
    choices = acts.candidates(room)
    if not choices:
        return None
    swap = "host" if acts.device == "cuda" else "ssd"
    return next((c for c in choices if c.label in ("keep", f"swap to {swap}, keep what fits")), choices[0])


def measured_activations(measured: Sequence, requested: Sequence[str], room: Optional[int], *, device: str,
                         host_bytes: Optional[int]) -> tuple[str, ...]:  # fmt: skip
    """The policies of the units a plan leaves "auto" for want of a model profile, from what the
    first step measured (`measured`: each unit's name, saved `bytes` and forward `flops`, forward
    order; runtime/activations/policy.py UnitActProfile): activation_choice within `room` (the
    activation budget less what no unit owns; None: no limit, all kept). The measure knows no
    unit's checkpoint, so the free units are kept or swapped, not recomputed; where not even
    swapping them all fits, they are all swapped (the runtime's accounting then waits or
    raises). `requested`: each unit's policy, "auto" or the one the settings fix (kept)."""
    fixed = {m.name: p for m, p in zip(measured, requested) if p != "auto"}
    if room is None:
        return tuple(fixed.get(m.name, "keep") for m in measured)
    units = [ActUnit(m.name, m.bytes, m.bytes if recomputes(p) else 0, int(m.flops), recomputes(p))
             for m, p in zip(measured, requested)]  # fmt: skip
    acts = ActPlanner(units, fixed, device=device, host_bytes=host_bytes)
    choice = activation_choice(acts, room) or activation_choice(acts, acts.least.need_bytes) or acts.least
    return tuple(p for _, p in choice.policies)


# "auto" takes the vertical plan where a per-micro-batch loop run with it is estimated within this
# share of the horizontal plan's loop: the replays of two plans of one model differ by tenths of
# a percent where nothing that matters differs (rounding of budgets, read-ahead), and a loop
# 1% slower is within any run's noise (decide.accumulation's Note).
LOOP_SLOWDOWN_TOLERANCE = 0.01


def accumulation(settings, horizontal_s: Optional[float], vertical_s: Optional[float],
                 why_not: Optional[str] = None, loop_s: Optional[float] = None) -> bool:  # fmt: skip
    """Whether a window driven whole (train_batch, the Trainer's window) runs vertically
    (Plan.vertical; planner/vertical.py): never with one micro-batch per step; "horizontal" and
    "vertical" as the settings force it ("vertical" refused, naming why, where the window's
    micro-batches cannot fit: `why_not`); "auto" where the vertical window's estimate is the
    shorter (`horizontal_s`, `vertical_s`: seconds per window; without both estimates, no
    model to tell: horizontal, as a per-micro-batch loop runs) and the vertical plan does not
    slow a per-micro-batch loop (`loop_s`, its window run micro-batch by micro-batch, at most
    `horizontal_s` and LOOP_SLOWDOWN_TOLERANCE). A per-micro-batch loop runs horizontally
    whatever this says.

    Note: why "auto" looks at the loop. The plan is made before the engine sees how it is
    driven, and most scripts drive it micro-batch by micro-batch (DeepSpeed's forward, backward,
    step; Accelerate's accumulate); the vertical plan is made for the window (its activation
    policies hold G micro-batches', its placement is one step's), and such a loop runs it
    horizontally, slower where the window's plan is not the loop's (the estimates for a GPT-2 on
    a 1 GB/s SSD, tests/test_resolve.py: up to 4% slower with the same gradient homes, 6x where
    the window's plan had put them on SSD, which resolve now takes from the horizontal plan).
    "auto" takes it only where that loop loses nothing (within LOOP_SLOWDOWN_TOLERANCE), so
    choosing it never makes a script slower; "vertical" takes it where windows are driven whole
    (train_batch, the Trainer's window) whatever a loop costs."""
    from .plan import PlanError

    g = settings.gradient_accumulation_steps
    if g == 1 or settings.accumulation == "horizontal":
        return False
    if why_not is not None:
        if settings.accumulation == "vertical":
            raise PlanError(f'accumulation "vertical": {why_not}; set accumulation "auto" or "horizontal"')
        return False
    if settings.accumulation == "vertical":
        return True
    if horizontal_s is None or vertical_s is None or vertical_s >= horizontal_s:
        return False
    return loop_s is None or loop_s <= horizontal_s * (1 + LOOP_SLOWDOWN_TOLERANCE)


def loop_candidates(candidates: Sequence, picked, horizontal_s: Optional[float]) -> list[tuple]:
    """The vertical window's candidates to ask, in turn, whether a per-micro-batch loop with them
    holds, where the search's pick (`picked`: its estimate) would slow one: those estimated
    faster than the horizontal plan (`horizontal_s`), least estimate first, the pick left out;
    each as (label, activations), the search's Request.prefer. `candidates`: the window search's
    (search.Candidate), least estimate first.

    Note: why the pick is not the window's only plan. The search picks the window's plan for the
    window alone (robustly: robust_pick.py), and "auto" runs it vertically only where a loop
    with it loses nothing (accumulation). A plan only slightly slower for the window can keep the
    loop (the paper's 13B b8 x 4 window: the best, 22.229 s, prefetches one unit and slows a loop
    to 59.2 s against 55.3; the plan at 22.639 s prefetches two and does not); so the choice
    compares the horizontal plan with the best vertical candidate whose loop holds, not with
    whatever the pick's tie-break took (that tie-break once had to give up 2% of the estimate for
    that window to stay vertical, over the 1% that more of a resource may cost: issue 36)."""
    if horizontal_s is None:
        return []
    out, depths = [], set()
    for c in candidates:
        at = (c.plan.prefetch_depth, c.plan.optim_prefetch_depth)
        if c.estimate is picked:
            depths.add(at)
        elif c.estimate.step_s < horizontal_s and at not in depths:
            depths.add(at)
            out.append((c.label, c.activations))
    return out


def loop_pick_note(pick_s: float, pick_loop_s: float) -> str:
    """The vertical plan's note where it is not the window search's pick (loop_candidates)."""
    return (f"the window's plan is the best of its candidates asked whose per-micro-batch loop is no slower than the "
            f"horizontal plan's: the search's pick ({pick_s:.3f} s) would slow one to {pick_loop_s:.3f} s")  # fmt: skip
