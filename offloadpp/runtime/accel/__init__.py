"""The device the runtime computes on, behind one small interface (base.py): the CPU acting as
the device (cpu.py), a torch accelerator such as CUDA (cuda.py: the only module naming
torch.cuda), and a stand-in with a GPU's asynchrony for tests (standin.py); select.py picks one
from the device spec and OFFLOADPP_DEVICE."""

from .base import Accelerator, Done, Event, SitedWait, Stream
from .select import ENV, accelerator, check_spec, device_memory, effective_spec, launch_kind, plan_device
from .standin import StandinAccelerator, StandinRaceError

__all__ = [
    "ENV",
    "Accelerator",
    "Done",
    "Event",
    "SitedWait",
    "StandinAccelerator",
    "StandinRaceError",
    "Stream",
    "accelerator",
    "check_spec",
    "device_memory",
    "effective_spec",
    "launch_kind",
    "plan_device",
]
