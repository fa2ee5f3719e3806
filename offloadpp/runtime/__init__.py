"""The out-of-core training runtime: executes a finished Plan, streaming unit weights to the
device ahead of use and running the CPU optimizer on each unit as soon as its gradients are
complete. It is handed the plan (offloadpp/assemble.py, planner/resolve.py) and never decides
placement or budgets itself.

    from offloadpp.runtime import OffloadEngine, RuntimeConfig, StepReport
"""

from .config import BudgetUse, RuntimeConfig, StepReport
from .engine import OffloadEngine
from .memory import BudgetExceededError
from .partition import UnitDef, UnitDiscoveryError, find_units, layout_units, unit_specs
from .preflight import PreflightError

__all__ = [
    "BudgetExceededError",
    "BudgetUse",
    "OffloadEngine",
    "PreflightError",
    "RuntimeConfig",
    "StepReport",
    "UnitDef",
    "UnitDiscoveryError",
    "find_units",
    "layout_units",
    "unit_specs",
]
