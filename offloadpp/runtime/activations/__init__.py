"""Activation swapping and recomputation (DESIGN.md, idea 2): what happens to the tensors autograd
saves in each unit's forward.

    manager.py    ActivationManager: the saved-tensor hooks, pack and unpack, recompute segments' wiring
    backward.py   its backward side: entering units, fetching ahead within the budget, releasing
    units.py      each unit's saved activations in a step (UnitActivations)
    reports.py    ActivationStats, and the auto policies resolved from the first forward
    swap.py       Swapper: device -> host -> SSD and back, within the activation budget
    records.py    what is saved (SavedStorage, SavedRef, ParamView) and its states
    recompute.py  recompute segments (a unit's forward run again in backward)
    nested.py     a nested recompute's pieces, run again one at a time
    partial.py    selective recomputation's operator log (Recorder, Replayer)
    states.py     a segment's states and the RNG state it runs again from
    flops.py      the FLOP counter of the probe
    policy.py     the policies and what a step measures for auto (pure)
"""

from .manager import ActivationManager
from .policy import ActPolicy, UnitActProfile
from .records import ActivationError
from .reports import ActivationStats

__all__ = [
    "ActPolicy",
    "ActivationError",
    "ActivationManager",
    "ActivationStats",
    "UnitActProfile",
]
