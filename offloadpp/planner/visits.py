"""A step's visits and the schedule that orders them (`Visit`, `Schedule`): the frozen result of
planner/schedule.py's walk (its Notes say what each field means), read by the runtime's executor
and optimizer and by planner/holds.py. Pure (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Visit:
    index: int
    unit: str
    backward: bool
    needs: tuple[str, ...]  # units whose weights must be on the device while this visit runs


@dataclass(frozen=True)
class Schedule:
    visits: tuple[Visit, ...]  # forward visits, then backward visits
    alive: tuple[frozenset[str], ...]  # weights held while visit i runs (needed by visits i..i+k)
    update_order: tuple[str, ...]  # units in the order the optimizer updates them (see Note)
    prefetch_depth: int  # k: alive[i] spans visits i..i+k
    next_keep: frozenset[str]  # updated weights kept in memory for the next forward (see Note)
    keep_until_update: frozenset[str]  # weights (== master) kept from an early backward use to the update
    optim_prefetch_depth: int  # q: state of updates i..i+q is read ahead
    peak_device_bytes: int  # runtime buffers on the device (weights, one unit's grads)
    peak_host_bytes: int  # runtime buffers in host memory, resident arrays included
    absorb_order: tuple[str, ...] = ()  # units in the order their gradients complete (backward)
    # a speculative plan: the units next_keep names for a step that speculates (its updates run in
    # backward, so a kept unit is held through the rest of it; next_keep is the deferred step's)
    spec_next_keep: frozenset[str] = frozenset()
    forward_index: Mapping[str, int] = field(compare=False, repr=False, default_factory=dict)
    backward_index: Mapping[str, int] = field(compare=False, repr=False, default_factory=dict)
    next_keep_until: Mapping[str, int] = field(compare=False, repr=False, default_factory=dict)

    @property
    def num_forward(self) -> int:
        return len(self.forward_index)

    def window_at(self, submitted: int) -> tuple[str, ...]:
        """Units whose optimizer state is wanted once `submitted` updates were handed out."""
        n = len(self.update_order)
        return self.update_order[max(0, submitted - 1) : min(n, submitted + self.optim_prefetch_depth + 1)]
