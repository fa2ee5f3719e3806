"""The runtime's side of `"plan": "auto"` and `"plan": "PATH"`: a Plan (and its estimate) for the
model the engine was given, from the cached hardware profile and a model profile.

    plan, estimate = plan_for_engine(choice, specs, model, budget=..., hardware_path=..., ...)

The model profile is, in order: a measured one named by the caller (`offloadpp profile --model
... --model-json`), else the analytic one from the model's Hugging Face config (GPT-2, Llama,
Qwen2, Mistral) at the micro-batch shape given. The hardware profile is the JSON `offloadpp
profile` wrote (default: the cache). Errors say which file is missing and the command to make it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from offloadpp.planner import Plan, PlanError, UnitSpec
from offloadpp.planner.cost import StepEstimate
from offloadpp.planner.hardware import HardwareProfile, ProfileError
from offloadpp.planner.model_profile import ModelProfile, ModelProfileError, analytic_profile
from offloadpp.planner.planfile import load_plan
from offloadpp.planner.search import Budget, search

DEFAULT_SEQ_LEN = 512


def model_profile_for(
    model, specs: Sequence[UnitSpec], *, compute_dtype: str, micro_batch: Optional[int], seq_len: Optional[int],
    profile_path: Optional[str] = None,
) -> ModelProfile:  # fmt: skip
    """The model profile for `model` (whose units are `specs`), measured (from the file) or analytic."""
    if profile_path:
        prof = ModelProfile.from_json(profile_path)
    else:
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "to_dict"):
            raise PlanError(
                f"plan 'auto' needs a model profile for {type(model).__name__} (not a Hugging Face model): write one with "
                "`offloadpp profile --dir DIR --model ... --model-json PATH` or offloadpp.profiling.profile_model, "
                "and pass its path as model_profile"
            )
        seq = seq_len or min(
            DEFAULT_SEQ_LEN,
            int(
                getattr(cfg, "n_positions", 0)
                or getattr(cfg, "max_position_embeddings", 0)
                or DEFAULT_SEQ_LEN
            ),
        )
        try:
            prof = analytic_profile(cfg.to_dict(), micro_batch=micro_batch or 1, seq_len=seq, compute_dtype=compute_dtype,
                                    name=str(getattr(cfg, "_name_or_path", "") or cfg.model_type))  # fmt: skip
        except ModelProfileError as e:
            raise PlanError(f"plan 'auto': {e}") from None
    got = list(prof.unit_specs())
    if got != list(specs):
        raise PlanError(
            "plan 'auto': the model profile's units do not match the model's: profile has "
            f"{[(u.name, u.numel) for u in got]}, the model {[(u.name, u.numel) for u in specs]}"
        )
    return prof


def load_hardware(path: Optional[str]) -> HardwareProfile:
    from offloadpp.profiling import default_profile_path

    path = path or default_profile_path()
    try:
        return HardwareProfile.from_json(path)
    except ProfileError as e:
        raise PlanError(f"plan 'auto' needs a hardware profile: {e}") from None


def plan_for_engine(
    choice: str,
    specs: Sequence[UnitSpec],
    model,
    *,
    budget: Budget,
    device: str,
    hardware_path: Optional[str] = None,
    model_profile_path: Optional[str] = None,
    micro_batch: Optional[int] = None,
    seq_len: Optional[int] = None,
) -> tuple[Plan, Optional[StepEstimate]]:
    """`choice` is "auto" or the path of a saved plan. Returns the plan and the step time it was
    estimated at (None for a saved plan written without one)."""
    if choice != "auto":
        return load_plan(choice)
    hw = load_hardware(hardware_path)
    if hw.device != device:
        raise PlanError(f"the hardware profile was measured for device {hw.device!r}, the engine runs on {device!r}: "
                        "re-run `offloadpp profile` on this machine")  # fmt: skip
    prof = model_profile_for(model, specs, compute_dtype=budget.compute_dtype, micro_batch=micro_batch,
                             seq_len=seq_len, profile_path=model_profile_path)  # fmt: skip
    result = search(hw, prof, budget)
    return result.plan, result.best.estimate
