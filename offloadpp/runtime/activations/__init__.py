"""Activation swapping and recomputation (DESIGN.md, idea 2): what happens to the tensors autograd
saves in each unit's forward.

    manager.py    ActivationManager: the saved-tensor hooks, the per-unit state, backward's prefetch
    swap.py       Swapper: device -> host -> SSD and back, within the activation budget
    records.py    what is saved (SavedStorage, SavedRef, ParamView) and its states
    recompute.py  recompute segments (a unit's forward run again in backward) and the FLOP counter
    policy.py     the policies and what a step measures for auto (pure)
"""

from .manager import ActivationManager, ActivationStats
from .policy import ActPolicy, UnitActProfile
from .records import ActivationError

__all__ = [
    "ActPolicy",
    "ActivationError",
    "ActivationManager",
    "ActivationStats",
    "UnitActProfile",
]
