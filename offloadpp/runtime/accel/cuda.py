"""A torch accelerator (CUDA, ROCm builds presenting as "cuda", or another that torch supports)
through torch's device-generic API: torch.Stream, torch.Event, torch.accelerator, and the device
module (torch.get_device_module(type)) for memory, random state and the current device. A new
device needs a device string, nothing more. The only module that may name torch.cuda.

Note: ordering on such a device. A copy is queued on a side stream and ordered before its use by
an event the compute stream waits on; a device buffer used by a stream is marked with
record_stream, so the caching allocator does not hand it out again before that stream is past
the point recorded; freeing is dropping the last reference (the allocator orders it).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .base import Accelerator, Event, Stream


def available(device_type: str = "cuda") -> bool:
    try:
        return torch.get_device_module(device_type).is_available()
    except Exception:  # a broken driver install must not break CPU-only use
        return False


class TorchStream(Stream):
    def __init__(self, stream: torch.Stream):
        self.stream = stream

    def __repr__(self) -> str:
        return f"TorchStream({self.stream!r})"


class TorchEvent(Event):
    def __init__(self, event: torch.Event):
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class TorchAccelerator(Accelerator):
    plan_device = "cuda"  # (a device with memory of its own behind a link)
    copies = True

    def __init__(self, spec: str):
        dev = torch.device(spec)
        self.kind = dev.type
        self.module = torch.get_device_module(dev.type)
        if not available(dev.type):
            raise RuntimeError(f"device {spec!r} asked for, but torch sees no {dev.type} device")
        if dev.index is None:
            dev = torch.device(dev.type, self.module.current_device())
        self.torch_device = dev
        self.collective_backend = "nccl" if dev.type == "cuda" else "gloo"

    # ---- device memory ---------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype, stream: Optional[Stream] = None) -> torch.Tensor:
        if stream is None:
            return torch.empty(numel, dtype=dtype, device=self.torch_device)
        with stream.stream:  # the caching allocator keeps a pool per stream
            return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def free(self, tensor: torch.Tensor, *, site: Optional[str] = None) -> None:
        pass  # record_use marked its streams: the allocator reuses it after them

    def record_use(self, tensor: torch.Tensor, stream: Stream, *, site: Optional[str] = None) -> None:
        tensor.record_stream(stream.stream)

    # ---- streams and events ----------------------------------------------------------------
    def new_stream(self) -> Stream:
        return TorchStream(torch.Stream(device=self.torch_device))

    def compute_stream(self) -> Stream:
        return TorchStream(torch.accelerator.current_stream(self.torch_device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        with stream.stream:
            dst.copy_(src, non_blocking=True)

    def run_on(self, stream: Stream, fn: Callable[[], None], *, out: torch.Tensor) -> None:
        with stream.stream:
            fn()

    def record(self, stream: Stream) -> Event:
        ev = torch.Event(device=self.torch_device)
        ev.record(stream.stream)
        return TorchEvent(ev)

    def wait_event(self, stream: Stream, event: Event, *, site: str) -> None:
        stream.stream.wait_event(event.event)

    def wait_stream(self, stream: Stream, other: Stream, *, site: str) -> None:
        stream.stream.wait_stream(other.stream)

    def synchronize(self, event: Event, *, site: str) -> None:
        event.event.synchronize()

    # ---- the device as a whole -------------------------------------------------------------
    def thread_init(self) -> None:
        torch.accelerator.set_device_index(self.torch_device.index)

    def synchronize_device(self) -> None:
        torch.accelerator.synchronize(self.torch_device)

    def memory_info(self) -> tuple[int, int]:
        free, total = self.module.mem_get_info(self.torch_device)
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return int(torch.accelerator.memory_allocated(self.torch_device))

    def max_memory_allocated(self) -> int:
        return int(torch.accelerator.max_memory_allocated(self.torch_device))

    def reset_peak_memory(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.torch_device)

    def rng_state(self) -> Optional[torch.Tensor]:
        return self.module.get_rng_state(self.torch_device)

    def set_rng_state(self, state: Optional[torch.Tensor]) -> None:
        if state is not None:
            self.module.set_rng_state(state, self.torch_device)

    def name(self) -> str:
        return str(self.module.get_device_name(self.torch_device))


def rng_states_all() -> Optional[list]:
    """Every CUDA device's random state (a DeepSpeed checkpoint's "cuda" entry), None without one."""
    return torch.cuda.get_rng_state_all() if available() else None


def set_rng_states_all(states: list) -> None:
    if available():
        torch.cuda.set_rng_state_all(states)


def device_names() -> list[str]:
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available() else []


def limit_memory(gib: float, index: int) -> int:
    """Caps this process's share of device `index` to `gib` GiB (the A/B's fairness cap); the
    bytes it may use."""
    total = torch.cuda.get_device_properties(index).total_memory
    cap = int(gib * 2**30)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    return min(cap, total)


__all__ = [
    "TorchAccelerator",
    "available",
    "device_names",
    "limit_memory",
    "rng_states_all",
    "set_rng_states_all",
]
