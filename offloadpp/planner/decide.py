"""Decisions made once, at plan time, from the Plan alone: the runtime, the schedule and the cost
model's replay all read them here, so the three cannot disagree (docs/runtime.md, "Decided once").

Pure (no torch).
"""

from __future__ import annotations


def lazy_runtime(plan) -> bool:
    """Where the runtime applies a deferred step's updates at the next visit
    (OptimizerPipeline.lazy): one rank on the CPU device."""
    return plan.deferred_update and plan.device == "cpu" and plan.ranks == 1


def lazy_applies(plan) -> bool:
    """Where the replay does (a speculative plan's replay is of a step that validates)."""
    return lazy_runtime(plan) and not plan.speculative
