"""The out-of-core training runtime: executes a Plan, streaming unit weights to the device ahead
of use and running the CPU optimizer on each unit as soon as its gradients are complete.

    from offloadpp.runtime import OffloadEngine, RuntimeConfig, StepReport
"""

from .config import RuntimeConfig, StepReport
from .engine import OffloadEngine
from .preflight import PreflightError
from .units import UnitDef, UnitDiscoveryError, find_units, layout_units

__all__ = [
    "OffloadEngine",
    "PreflightError",
    "RuntimeConfig",
    "StepReport",
    "UnitDef",
    "UnitDiscoveryError",
    "find_units",
    "layout_units",
]
