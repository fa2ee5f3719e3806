"""The profiles the resolve stage plans with (planner/resolve.py): the hardware profile to load,
the model profile (measured, or analytic from a Hugging Face config), and their checks. Pure.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

from .hardware import HardwareProfile, ProfileError, default_profile_path
from .model_profile import ModelProfile, ModelProfileError, analytic_profile
from .plan import PlanError, UnitSpec
from .spec import Settings

CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length", "max_sequence_length")


def load_hardware(path: Optional[str]) -> HardwareProfile:
    """The hardware profile at `path`, else the one `offloadpp profile` cached."""
    path = path or default_profile_path()
    try:
        return HardwareProfile.from_json(path)
    except ProfileError as e:
        raise PlanError(f"a hardware profile is needed (plan 'auto', or an estimate): {e}") from None


def model_profile_for(
    hf_config: Optional[Mapping[str, Any]],
    units: Sequence[UnitSpec],
    settings: Settings,
    *,
    name: str = "",
) -> ModelProfile:
    """The model profile: measured (settings.model_profile) or analytic from the model's
    Hugging Face config at settings' micro-batch and sequence length (default: the model's
    context length); its units must be `units`."""
    if settings.model_profile:
        prof = ModelProfile.from_json(settings.model_profile)
    else:
        if hf_config is None:
            raise PlanError(
                "a model profile is needed for a model without a Hugging Face config: write one with "
                "`offloadpp profile --dir DIR --model ... --model-json PATH` and set model_profile to its path"
            )
        ctx = next((hf_config[k] for k in CONTEXT_KEYS if hf_config.get(k)), None)
        if settings.seq_len is None and ctx is None:
            raise PlanError(
                f"the model's config names no context length (none of {list(CONTEXT_KEYS)}): set seq_len "
                "(`offloadpp plan --seq-len N`, or seq_len in the offloadpp block)"
            )
        seq = settings.seq_len or int(ctx)
        try:
            prof = analytic_profile(hf_config, micro_batch=settings.micro_batch or 1, seq_len=seq,
                                    compute_dtype=settings.compute_dtype, name=name)  # fmt: skip
        except ModelProfileError as e:
            raise PlanError(str(e)) from None
        prof = prof.with_frozen_split(units)
    got = list(prof.unit_specs())
    if got != list(units):
        raise PlanError(
            "the model profile's units do not match the model's: profile has "
            f"{[(u.name, u.numel) for u in got]}, the model {[(u.name, u.numel) for u in units]}"
        )
    return prof


def _unsharded(units) -> list:
    return [replace(u, shards=1) for u in units]


def _check_units(model: ModelProfile, units) -> None:
    if list(model.unit_specs()) != _unsharded(units):
        raise PlanError("the model profile's units do not match the model's")


def _check_profiles(hw: HardwareProfile, model: ModelProfile, units, device: str) -> None:
    if hw.device != device:
        raise PlanError(
            f"the hardware profile was measured for device {hw.device!r}, the run is on {device!r}: "
            "re-run `offloadpp profile` on this machine"
        )
    if list(model.unit_specs()) != _unsharded(units):
        raise PlanError("the model profile's units do not match the model's")
