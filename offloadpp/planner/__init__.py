"""Plans: where each unit's training state lives (device, host, SSD) and how far ahead the runtime
fetches. Pure Python, no torch: a plan can be made, checked and printed anywhere.
"""

from .default import default_plan, min_budgets, streaming_plan
from .plan import (
    ALIGN_NUMEL,
    DTYPE_BYTES,
    Placement,
    Plan,
    PlanError,
    Tier,
    UnitSpec,
    all_on_ssd,
    flat_numel,
    fmt_bytes,
)
from .schedule import Schedule, Visit, build_schedule

__all__ = [
    "ALIGN_NUMEL",
    "DTYPE_BYTES",
    "Placement",
    "Plan",
    "PlanError",
    "Schedule",
    "Tier",
    "UnitSpec",
    "Visit",
    "all_on_ssd",
    "build_schedule",
    "default_plan",
    "flat_numel",
    "fmt_bytes",
    "min_budgets",
    "streaming_plan",
]

# The cost model and the planner (docs/planner.md). `search.plan` is exported as `auto_plan`: the
# name `plan` is this package's submodule.
from .cost import StepEstimate, estimate  # noqa: E402
from .hardware import HardwareProfile, IOPoint, ProfileError, SsdProfile  # noqa: E402
from .model_profile import ModelProfile, ModelProfileError, UnitProfile, analytic_profile  # noqa: E402
from .planfile import load_plan, save_plan  # noqa: E402
from .search import Budget, SearchResult, search  # noqa: E402
from .search import plan as auto_plan  # noqa: E402

__all__ += [
    "Budget",
    "HardwareProfile",
    "IOPoint",
    "ModelProfile",
    "ModelProfileError",
    "ProfileError",
    "SearchResult",
    "SsdProfile",
    "StepEstimate",
    "UnitProfile",
    "analytic_profile",
    "auto_plan",
    "estimate",
    "load_plan",
    "save_plan",
    "search",
]
