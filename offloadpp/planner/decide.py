"""Decisions made once, at plan time: each is one function here, which the resolve stage, the
planner, the schedule, the cost model's replay and the runtime all call or read the result of
(carried in the Plan or in `Resolved.settings`), so none can disagree with another
(docs/runtime.md, "Decided once", lists them with the other decisions' homes).

Pure (no torch).
"""

from __future__ import annotations

# The prefetch depths where the settings leave them to the planner ("auto"): the deepest the
# default plan tries first, and the optimizer read-ahead of every plan but a deferred one's
# (resolve._streaming_need decides that one).
DEFAULT_PREFETCH = 2
DEFAULT_OPTIM_PREFETCH = 2


def clipping(settings) -> bool:
    """Gradient clipping by global norm is on (Plan.clipping carries it to the runtime: a
    speculative step that clips is redone, so it keeps its gradients until validated)."""
    return settings.gradient_clipping > 0


def speculates(settings) -> bool:
    """Plans are shaped for speculative updates: updates are deferred (clipping, fp16) and the
    settings do not turn speculation off. Whether the plan finally speculates (room on the SSDs
    for the second generation, one rank) is resolve.with_speculation's, carried in Plan.speculative."""
    return settings.deferred_update and settings.speculate != "off"


def prefetch_depth(settings) -> int:
    """The weights' prefetch depth the streaming minimum is sized at (the default plan then tries
    shallower ones where the budgets are smaller)."""
    return DEFAULT_PREFETCH if settings.prefetch_depth is None else settings.prefetch_depth


def optim_prefetch_depth(settings) -> int:
    """The optimizer read-ahead the plans start from (the streaming minimum's budgets may fix it
    first: resolve._budgets writes its choice into the settings)."""
    return DEFAULT_OPTIM_PREFETCH if settings.optim_prefetch_depth is None else settings.optim_prefetch_depth


def adam_threads(settings, cores: int) -> int:
    """Threads of the fused CPU Adam: the settings', else every core this process may run on
    (resolve writes it into Resolved.settings; an engine given a plan made elsewhere asks here)."""
    return settings.adam_threads or cores


def lazy_runtime(plan) -> bool:
    """Where the runtime applies a deferred step's updates at the next visit
    (OptimizerPipeline.lazy): one rank on the CPU device."""
    return plan.deferred_update and plan.device == "cpu" and plan.ranks == 1


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
    return "run as a pass after backward (not at the next visit, which is the CPU device's)"


def lazy_applies(plan) -> bool:
    """Where the replay does (a speculative plan's replay is of a step that validates)."""
    return lazy_runtime(plan) and not plan.speculative
