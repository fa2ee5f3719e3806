"""Each unit's saved activations in the current step (`UnitActivations`, which the
ActivationManager keeps one of per unit, manager.py) and where backward stands with it."""

from __future__ import annotations

import enum

from torch import nn

from .policy import ActPolicy
from .recompute import Segment
from .records import ParamIndex, RecState, SavedStorage


class ActPhase(enum.Enum):
    IDLE = "idle"  # no saved activations
    FORWARD = "forward"  # its forward ran (or runs) in this step
    BACKWARD = "backward"  # backward reached it
    DONE = "done"  # backward moved past it


class UnitActivations:
    """One unit's saved activations in the current step, and its policy."""

    def __init__(self, name: str, roots: tuple[nn.Module, ...], requested: ActPolicy):
        self.name = name
        self.roots = roots
        self.requested = requested
        self.policy = ActPolicy.HOST if requested is ActPolicy.AUTO else requested  # AUTO: profiled as host
        self.phase = ActPhase.IDLE
        self.position = -1  # in this step's forward order
        self.records: list[SavedStorage] = []  # in pack order
        self.segments: list[Segment] = []
        self.fetch_cursor = 0  # records[:fetch_cursor] are not asked for yet (fetched from the end)
        self.held_back: list[list[SavedStorage]] = []  # partial_host_tail: its last pieces' records
        self.last_piece = -1  # partial_last: the index in segments of its root call's last piece
        self.saved_bytes = 0  # bytes of the storages it saved first, this step
        self.flops = 0
        self.params = ParamIndex()

    def __repr__(self) -> str:
        return f"UnitActivations({self.name!r}, {self.policy.value}, {self.phase.value})"

    def open_piece(self, keep: int) -> list[SavedStorage]:
        """partial_host_tail (policy.py): a piece opens, its records are held back on the device;
        those of the pieces more than `keep` back are returned, to be swapped out now."""
        self.held_back.append([])
        out: list[SavedStorage] = []
        while len(self.held_back) > keep:
            out += [r for r in self.held_back.pop(0) if r.state is RecState.DEVICE]
        return out

    def reset(self) -> None:
        self.phase = ActPhase.IDLE
        self.position = -1
        self.records = []
        self.segments = []
        self.fetch_cursor = 0
        self.held_back = []
        self.last_piece = -1
        self.saved_bytes = 0
