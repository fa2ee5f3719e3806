"""A candidate of the search (search.py): a plan replayed, with its estimate and, where the
search chose them, its activation policies. Its own module so the robust pick (robust_pick.py)
reads it without importing the search back. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from .cost import StepEstimate
from .plan import Plan


@dataclass(frozen=True)
class Candidate:
    label: str
    plan: Plan
    estimate: StepEstimate
    activations: tuple[tuple[str, str], ...] = ()  # (unit, policy) for every unit, when chosen here
