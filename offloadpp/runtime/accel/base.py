"""The accelerator interface: what the runtime asks of the device it computes on.

Note: one path, three devices. The runtime never asks which device it runs on; it reads the
properties below and calls the methods. `copies` is the one real difference: on the CPU acting
as the device the device buffer of a unit is its host buffer (nothing to copy, nothing to order),
elsewhere device memory is its own and every copy is asynchronous on a stream, ordered before its
use by an event. CUDA (cuda.py) and the stand-in (standin.py) take that path with the same lines
of the runtime, so a CPU test run on the stand-in executes what a GPU executes.

Note: sites. Every wait that orders a copy before its use, and every stream-ordered free, names
its site (`site="unit.bind"`), as does the one order kept on the host by a flag (`holds_back`). The stand-in skips the one named by OFFLOADPP_STANDIN_SKIP, so
scripts/standin_mutations.py can remove each in turn and see a test catch it; the other
implementations ignore the name.
"""

from __future__ import annotations

import abc
from typing import Callable, Optional

import torch


class Event(abc.ABC):
    """A point in a stream's work: done once the stream has run everything queued before it."""

    @abc.abstractmethod
    def done(self) -> bool: ...

    @abc.abstractmethod
    def wait(self) -> None:
        """The host blocks until the event is done (no site: use Accelerator.synchronize)."""


class Stream:
    """A queue of device work run in order (an implementation's own handle)."""


class Done(Event):
    """An event with nothing before it (the CPU as the device: every copy is done when issued)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class SitedWait:
    """An event as a buffer pool's `Waitable` (memory.py: `after`), its host wait through the
    accelerator under `site`: the pinned host buffer a copy reads goes back only after it."""

    def __init__(self, accel: Accelerator, event: Event, site: str):
        self.accel, self.event, self.site = accel, event, site

    def wait(self) -> None:
        self.accel.synchronize(self.event, site=self.site)

    def done(self) -> bool:
        return self.accel.query(self.event, site=self.site)


class Accelerator(abc.ABC):
    """The device. Properties the runtime and the planner read:

    kind: "cpu", "cuda" or "standin" (reports and messages only; never branched on).
    plan_device: what the planner plans for: "cpu" (device memory is the host's) or "cuda" (a
        device with memory of its own behind a link).
    copies: False where a device buffer is the host buffer itself (no copy, no stream, no event).
    torch_device: where compute runs and device tensors live.
    collective_backend: torch.distributed's backend for device tensors.
    poisons_host_reuse: the runtime's host buffer pools fill a buffer they make reusable with
        0xFF bytes (NaN), as whatever takes it next would overwrite it: a copy still reading it
        that its release did not name (`after`) then delivers NaN at once (the stand-in only).
    """

    kind: str
    plan_device: str
    copies: bool
    torch_device: torch.device
    collective_backend: str = "gloo"
    poisons_host_reuse: bool = False

    # ---- device memory ---------------------------------------------------------------------
    @abc.abstractmethod
    def empty(self, numel: int, dtype: torch.dtype, stream: Optional[Stream] = None) -> torch.Tensor:
        """A device buffer, allocated for `stream`'s use (None: the compute stream's)."""

    @abc.abstractmethod
    def free(self, tensor: torch.Tensor, *, site: Optional[str] = None) -> None:
        """Gives a buffer from empty() back, in stream order: its memory is reused only after
        every stream that used it (record_use) has passed the point where it was freed. No
        site: only the compute stream used it (nothing to order)."""

    @abc.abstractmethod
    def record_use(self, tensor: torch.Tensor, stream: Stream, *, site: Optional[str] = None) -> None:
        """`stream` uses `tensor`: its memory outlives the stream's work queued so far
        (CUDA's record_stream). A side stream's use names its site (the free it orders)."""

    # ---- streams and events ----------------------------------------------------------------
    @abc.abstractmethod
    def new_stream(self) -> Stream: ...

    @abc.abstractmethod
    def compute_stream(self) -> Stream:
        """The stream compute runs on (the calling thread's current one)."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """Queues dst.copy_(src) on `stream` (asynchronous where `copies`)."""

    @abc.abstractmethod
    def run_on(self, stream: Stream, fn: Callable[[], None], *, out: torch.Tensor) -> None:
        """Runs `fn` (a collective on device tensors, writing `out`) in `stream`'s order: after
        what is queued on it, and before what is queued after; `out` is ready at an event
        recorded on `stream` after it."""

    @abc.abstractmethod
    def record(self, stream: Stream) -> Event:
        """An event at the current end of `stream`'s queue."""

    @abc.abstractmethod
    def wait_event(self, stream: Stream, event: Event, *, site: str) -> None:
        """`stream`'s later work waits for `event` (the compute stream: what compute issues next)."""

    @abc.abstractmethod
    def wait_stream(self, stream: Stream, other: Stream, *, site: str) -> None:
        """`stream`'s later work waits for everything queued on `other` so far."""

    @abc.abstractmethod
    def synchronize(self, event: Event, *, site: str) -> None:
        """The host waits for `event`."""

    def query(self, event: Event, *, site: str) -> bool:
        """The host asks whether `event` is done (a pool's `after` does, under `site`)."""
        return event.done()

    def after(self, event: Event, *, site: str) -> SitedWait:
        """`event` as a pool Waitable whose host wait is `site`."""
        return SitedWait(self, event, site)

    def holds_back(self, *, site: str) -> bool:
        """A host-side order the runtime keeps before it queues a copy (a flag, not an event:
        device.CopyWeights waits for a pending update, Slot.updating): True, but where the
        stand-in skips `site`."""
        return True

    # ---- the device as a whole -------------------------------------------------------------
    def set_capacity(self, nbytes: Optional[int]) -> None:  # noqa: B027 - nothing by default
        """The plan's device budget, for an accelerator with no memory size of its own (the
        stand-in's, unless OFFLOADPP_STANDIN_BYTES sets one); the others ignore it."""

    def thread_init(self) -> None:  # noqa: B027 - nothing by default
        """Binds a new worker thread to this device (a new thread's current CUDA device is 0)."""

    def synchronize_device(self) -> None:  # noqa: B027 - nothing by default
        """The host waits for all work queued on the device."""

    @abc.abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) device bytes."""

    @abc.abstractmethod
    def memory_allocated(self) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self) -> int: ...

    @abc.abstractmethod
    def reset_peak_memory(self) -> None: ...

    def rng_state(self) -> Optional[torch.Tensor]:
        """The device's own random generator state (None: compute draws from the CPU's)."""
        return None

    def set_rng_state(self, state: Optional[torch.Tensor]) -> None:  # noqa: B027 - nothing by default
        pass

    def name(self) -> str:
        return self.kind

    def close(self) -> None:  # noqa: B027 - nothing by default
        """Stops what the accelerator runs of its own (the stand-in's stream workers)."""


__all__ = ["Accelerator", "Done", "Event", "SitedWait", "Stream"]
