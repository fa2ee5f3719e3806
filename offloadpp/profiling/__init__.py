"""Measuring the machine and the model for the planner (uses torch; the planner itself does not).

from offloadpp.profiling import profile_hardware, profile_model
"""

from __future__ import annotations


def __getattr__(name: str):
    # torch-using entry points load on first use, so `import offloadpp.profiling` stays light
    if name == "profile_hardware":
        from .hardware import profile_hardware

        return profile_hardware
    if name == "profile_model":
        from .model import profile_model

        return profile_model
    raise AttributeError(name)


__all__ = ["profile_hardware", "profile_model"]
