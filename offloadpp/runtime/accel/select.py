"""Which accelerator a run uses: the device spec, or OFFLOADPP_DEVICE.

Note: OFFLOADPP_DEVICE. It names the device where the config names none; "standin" and "cuda"
also stand in for an explicit "cpu" (the stand-in is the CPU device with a GPU's asynchrony, and
with "cuda" the tests written for the CPU device run on a GPU: tests/conftest.py's on_device,
scripts/gpu_check.sh). It never replaces an explicit "cuda", and says so on stderr whenever it
applies, with the stand-in's seed.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from .base import Accelerator
from .cpu import CpuAccelerator
from .cuda import TorchAccelerator
from .cuda import available as cuda_available
from .standin import StandinAccelerator

ENV = "OFFLOADPP_DEVICE"
KINDS = ("cpu", "cuda", "standin")


def check_spec(spec: str, what: str = "device") -> str:
    """`spec` if it names a device this module can build ("cpu", "standin", "cuda", "cuda:N")."""
    if spec in ("cpu", "standin", "cuda") or (spec.startswith("cuda:") and spec[5:].isdigit()):
        return spec
    raise ValueError(f"{what} must be 'cpu', 'standin', 'cuda' or 'cuda:N', got {spec!r}")


def effective_spec(spec: Optional[str]) -> str:
    """The device a run with device `spec` uses, OFFLOADPP_DEVICE applied (the module Note)."""
    env = os.environ.get(ENV) or None
    if env is not None:
        check_spec(env, f"{ENV}")
        if spec is None or (env != "cpu" and spec == "cpu"):
            return env
    if spec is None:
        return "cuda" if cuda_available() else "cpu"
    return check_spec(spec)


def plan_device(spec: Optional[str]) -> str:
    """What the planner plans for on device `spec`: "cpu" or "cuda" (memory of its own)."""
    return "cpu" if effective_spec(spec) == "cpu" else "cuda"


def device_memory(spec: Optional[str]) -> Optional[tuple[int, int]]:
    """(free, total) bytes of device `spec`'s own memory; None where the CPU is the device. The
    stand-in's: its capacity (OFFLOADPP_STANDIN_BYTES), else half the RAM available now (its
    device memory is RAM, beside the host budget's)."""
    s = effective_spec(spec)
    if s == "cpu":
        return None
    if s == "standin":
        import psutil

        cap = os.environ.get("OFFLOADPP_STANDIN_BYTES")
        if cap is not None:
            return int(cap), int(cap)
        vm = psutil.virtual_memory()
        return int(vm.available) // 2, int(vm.total) // 2
    return TorchAccelerator(s).memory_info()


def launch_kind(spec: Optional[str]) -> str:
    """ "cpu", "standin" or "cuda" for device `spec` (the launcher's device kind: dp/distributed.py)."""
    s = effective_spec(spec)
    return "cuda" if s.startswith("cuda") else s


def accelerator(spec: Optional[str]) -> Accelerator:
    """A new accelerator for device `spec` (the stand-in says so on stderr, with its seed)."""
    s = effective_spec(spec)
    if s == "cpu":
        return CpuAccelerator()
    if s == "standin":
        a = StandinAccelerator()
        print(a.describe(), file=sys.stderr)
        return a
    if spec == "cpu":  # (OFFLOADPP_DEVICE stood in for it: the Note)
        print(f"offloadpp: device={s} ({ENV}; the config named cpu)", file=sys.stderr)
    return TorchAccelerator(s)


__all__ = [
    "ENV",
    "KINDS",
    "accelerator",
    "check_spec",
    "device_memory",
    "effective_spec",
    "launch_kind",
    "plan_device",
]
