"""What a recompute Segment and its nested pieces share: the states they go through, and the
RNG state each runs again from."""

from __future__ import annotations

import contextlib
import enum
from typing import Optional

import torch


class SegState(enum.Enum):
    RECORDING = "recording"  # its forward is running
    SAVED = "saved"  # forward done: arguments and RNG state held, nothing else
    RECOMPUTED = "recomputed"  # backward ran it again; its saved tensors wait to be unpacked
    DONE = "done"  # every saved tensor was unpacked, or backward ended


def rng_states(device: torch.device):
    dev = torch.get_device_module(device.type).get_rng_state(device) if device.type != "cpu" else None
    return torch.get_rng_state(), dev


@contextlib.contextmanager
def rng_from(device: torch.device, cpu: torch.Tensor, dev: Optional[torch.Tensor]):
    """Runs with the RNG state (cpu, dev); the global RNG is left as it was."""
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.get_device_module(device.type).set_rng_state(dev, device)
        yield
