"""The CPU acting as the device: device memory is host memory, so a unit's device buffer is its
host buffer (`copies` False) and nothing is asynchronous: no stream, no event to wait for."""

from __future__ import annotations

from typing import Callable, Optional

import psutil
import torch

from .base import Accelerator, Done, Event, Stream

_DONE = Done()


class CpuStream(Stream):
    def __repr__(self) -> str:
        return "CpuStream()"


class CpuAccelerator(Accelerator):
    kind = "cpu"
    plan_device = "cpu"
    copies = False
    collective_backend = "gloo"

    def __init__(self):
        self.torch_device = torch.device("cpu")
        self._stream = CpuStream()

    def empty(self, numel: int, dtype: torch.dtype, stream: Optional[Stream] = None) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def free(self, tensor: torch.Tensor, *, site: Optional[str] = None) -> None:
        pass  # (the last reference going frees it: nothing runs behind the host)

    def record_use(self, tensor: torch.Tensor, stream: Stream, *, site: Optional[str] = None) -> None:
        pass

    def new_stream(self) -> Stream:
        return self._stream

    def compute_stream(self) -> Stream:
        return self._stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        dst.copy_(src)

    def run_on(self, stream: Stream, fn: Callable[[], None], *, out: torch.Tensor) -> None:
        fn()

    def record(self, stream: Stream) -> Event:
        return _DONE

    def wait_event(self, stream: Stream, event: Event, *, site: str) -> None:
        pass

    def wait_stream(self, stream: Stream, other: Stream, *, site: str) -> None:
        pass

    def synchronize(self, event: Event, *, site: str) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def memory_allocated(self) -> int:
        return 0  # (not tracked: the runtime's pools account the CPU device's buffers)

    def max_memory_allocated(self) -> int:
        return 0

    def reset_peak_memory(self) -> None:
        pass


__all__ = ["CpuAccelerator"]
