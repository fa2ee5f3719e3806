"""Plans: where each unit's training state lives (device, host, SSD) and how far ahead the runtime
fetches. Pure Python, no torch: a plan can be made, checked and printed anywhere.
"""

from .default import default_plan, min_budgets, streaming_plan, with_peak_budgets
from .plan import (
    ALIGN_NUMEL,
    InfeasibleError,
    Placement,
    Plan,
    PlanError,
    Tier,
    UnitSpec,
    all_on_ssd,
    flat_numel,
    fmt_bytes,
)
from .schedule import Schedule, Visit, build_schedule, walk_peaks
from .spec import DTYPE_BYTES, PLAN_AUTO, PLAN_DEFAULT, ActivationSettings, Budgets, LossScaling, Settings

__all__ = [
    "ALIGN_NUMEL",
    "ActivationSettings",
    "Budgets",
    "DTYPE_BYTES",
    "InfeasibleError",
    "LossScaling",
    "PLAN_AUTO",
    "PLAN_DEFAULT",
    "Settings",
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
    "walk_peaks",
    "with_peak_budgets",
]

# The cost model and the planner (docs/planner.md). `search.plan` is exported as `auto_plan`: the
# name `plan` is this package's submodule.
from .cost import StepEstimate, estimate  # noqa: E402
from .hardware import HardwareProfile, IOPoint, ProfileError, SsdProfile, default_profile_path  # noqa: E402
from .model_profile import ModelProfile, ModelProfileError, UnitProfile, analytic_profile  # noqa: E402
from .planfile import load_plan, save_plan  # noqa: E402
from .request import Request  # noqa: E402
from .resolve import Machine, Resolved, resolve  # noqa: E402
from .search import SearchResult, search  # noqa: E402
from .search import plan as auto_plan  # noqa: E402

__all__ += [
    "HardwareProfile",
    "Machine",
    "Request",
    "Resolved",
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
    "default_profile_path",
    "resolve",
    "estimate",
    "load_plan",
    "save_plan",
    "search",
]
