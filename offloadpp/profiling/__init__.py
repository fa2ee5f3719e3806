"""Measuring the machine and the model for the planner (uses torch; the planner itself does not).

from offloadpp.profiling import profile_hardware, profile_model, default_profile_path
"""

from __future__ import annotations

import os


def default_profile_path() -> str:
    """Where `offloadpp profile` caches the hardware profile and the planner looks for it:
    $OFFLOADPP_CACHE_DIR/hardware.json, else ~/.cache/offloadpp/hardware.json."""
    root = os.environ.get("OFFLOADPP_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "offloadpp"
    )
    return os.path.join(root, "hardware.json")


def __getattr__(name: str):
    # torch-using entry points load on first use, so `import offloadpp.profiling` stays light
    if name == "profile_hardware":
        from .hardware import profile_hardware

        return profile_hardware
    if name == "profile_model":
        from .model import profile_model

        return profile_model
    raise AttributeError(name)


__all__ = ["default_profile_path", "profile_hardware", "profile_model"]
