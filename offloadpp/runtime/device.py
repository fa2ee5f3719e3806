"""The compute device (runtime/accel/: the CPU acting as one, a GPU, or the stand-in) and each
unit's weights on it.

Note: the CPU as the device. Every path of the runtime runs without a GPU: the device buffer of
a unit is then its host compute-copy buffer itself (no copy: the accelerator's `copies` is
False), and only the byte budget separates "device" from "host". The schedule, the holds and the
hooks are the same code either way; only `CpuWeights` and `CopyWeights` differ, in how a host
buffer becomes device weights.

Note: streams. Where device memory is its own (`copies`: CUDA, the stand-in), host-to-device
copies run on `h2d`, gradients leave on `d2h`, both from pinned host buffers. A copy is ordered
before its use by an event the compute stream waits on; a device buffer used by a stream is
marked (record_use) so its memory is not handed out again before that work is done; a pinned
host buffer goes back to its pool only after the event of the copy that read it (the pool's
`after`). Each such wait names its site (accel/base.py, the sites Note).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from .accel import Accelerator, Event, accelerator
from .slots import Hold, Slot, SlotState


class Device:
    """The run's accelerator, its two copy streams, and the device weights' accounting.

    kind: what the planner plans for ("cpu", or "cuda": memory of its own; the stand-in's too)."""

    def __init__(self, spec: Optional[str], accel: Optional[Accelerator] = None):
        self.accel = accel if accel is not None else accelerator(spec)
        self.torch_device = self.accel.torch_device
        self.copies = self.accel.copies
        self.kind = self.accel.plan_device
        if self.copies:
            self.h2d = self.accel.new_stream()
            self.d2h = self.accel.new_stream()
        self._nan: dict[torch.dtype, torch.Tensor] = {}
        self.bytes_in_use = 0  # device weights buffers (copies), accounted against budget_bytes
        self.peak_bytes = 0
        self.step_peak_bytes = 0
        self.budget_bytes: Optional[int] = None  # the plan's device budget (copies), set by the engine
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """What a parameter points to while its weights are not on the device: its shape, no
        memory, and NaN if anything reads it by mistake."""
        if dtype not in self._nan:
            self._nan[dtype] = torch.full((), float("nan"), dtype=dtype, device=self.torch_device)
        return self._nan[dtype].expand(shape)

    def reserve(self, nbytes: int, what: str) -> None:
        """Accounts `nbytes` of device weights (copies) against the device budget: they are taken
        and given back on the main thread in the schedule's order, so more than the budget
        means the plan does not fit and waiting would not help."""
        if self.budget_bytes is not None and self.bytes_in_use + nbytes > self.budget_bytes:
            from .memory import BudgetExceededError

            raise BudgetExceededError(
                f"device budget: {what} needs {nbytes} bytes more with {self.bytes_in_use} in use; the budget is "
                f"{self.budget_bytes} bytes. The plan does not fit this run: raise the budget, or report it as a bug"
            )
        self.bytes_in_use += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
        self.step_peak_bytes = max(self.step_peak_bytes, self.bytes_in_use)

    def unreserve(self, nbytes: int) -> None:
        self.bytes_in_use -= nbytes

    def alloc(self, numel: int, dtype: torch.dtype, what: str, stream=None) -> torch.Tensor:
        """A device buffer (copies), reserved against the device budget; for `stream`'s use
        (None: the compute stream's)."""
        self.reserve(numel * dtype.itemsize, what)
        return self.accel.empty(numel, dtype, stream)

    def dealloc(self, tensor: torch.Tensor, *, site: Optional[str]) -> None:
        """Gives an alloc() buffer back, in stream order (accel: free)."""
        self.unreserve(tensor.numel() * tensor.element_size())
        self.accel.free(tensor, site=site)

    def compute_stream(self):
        return self.accel.compute_stream()

    def use_on_compute(
        self, tensor: torch.Tensor, event: Optional[Event], *, site: str, keep_site: str
    ) -> torch.Tensor:
        """`tensor`, filled by work that records `event` (None: already ordered), made safe
        for the compute stream: it waits for the event (`site`), and the memory is kept until
        the stream is past it (`keep_site`: the module Note)."""
        stream = self.accel.compute_stream()
        if event is not None:
            self.accel.wait_event(stream, event, site=site)
        self.accel.record_use(tensor, stream, site=keep_site)
        return tensor

    def after(self, event: Optional[Event], *, site: str):
        """`event` as a pool Waitable (None: nothing to wait for)."""
        return self.accel.after(event, site=site) if event is not None else None

    def close(self) -> None:
        self.accel.close()


class Weights(Protocol):
    """A unit's weights on the device, as the executor and the optimizer use them: held from the
    visit that fetches them (acquire; pump moves a fetch on), ready before a visit binds them (wait:
    the device tensor), given back after (release), and brought up to date after an update
    (refresh). CpuWeights (the compute slot's own buffer), CopyWeights (a device copy) and
    sharded.GatheredWeights (all-gathered from every rank's shard) are the three kinds."""

    @property
    def state(self) -> SlotState: ...

    def acquire(self) -> None: ...

    def pump(self) -> None: ...

    def wait(self) -> torch.Tensor: ...

    def release(self) -> None: ...

    def refresh(self) -> None: ...


class CpuWeights:
    """A unit's device weights on the CPU device: its compute-copy slot's buffer, no copy."""

    def __init__(self, source: Slot, device: Device):
        self.source = source
        self.device = device

    @property
    def state(self) -> SlotState:
        return (
            self.source.state
            if Hold.COMPUTE in self.source.holds or self.source.resident
            else SlotState.EMPTY
        )

    def acquire(self) -> None:
        self.source.acquire(Hold.COMPUTE)

    def pump(self) -> None:
        pass

    def wait(self) -> torch.Tensor:
        return self.source.wait()

    def release(self) -> None:
        self.source.release(Hold.COMPUTE)

    def refresh(self) -> None:
        pass  # the update wrote the buffer the device computes with


class PairWeights:
    """A unit's weights and its frozen segment (docs/frozen.md), fetched, waited on and given
    back together; everything else (refresh after an update, residency, the device tensor) is
    the trainable weights': the frozen segment is never written.

    Both start their reads at acquire(), so the frozen segment's read overlaps the other's."""

    def __init__(self, trainable, frozen):
        self.trainable = trainable
        self.frozen = frozen

    @property
    def state(self) -> SlotState:
        a, b = self.trainable.state, self.frozen.state
        return a if a is b else SlotState.LOADING

    def acquire(self) -> None:
        self.trainable.acquire()
        self.frozen.acquire()

    def pump(self) -> None:
        self.trainable.pump()
        self.frozen.pump()

    def wait(self) -> torch.Tensor:
        self.frozen.wait()
        return self.trainable.wait()

    def frozen_tensor(self) -> torch.Tensor:
        """The frozen segment on the device (after wait())."""
        return self.frozen.wait()

    def release(self) -> None:
        self.trainable.release()
        self.frozen.release()

    def __getattr__(self, name):  # resident, tensor, last_copy, refresh, load_resident: the trainable's
        return getattr(self.__dict__["trainable"], name)


class UpcastWeights:
    """A frozen segment stored in a narrower dtype than the device computes in (a 16-bit base
    under fp32 compute: docs/frozen.md, UnitSpec.frozen_dtype_under): `inner` fetches it as
    stored (CpuWeights or CopyWeights); wait() upcasts it into a compute-dtype buffer, held until
    release(). Exact: every bf16 and fp16 value is an fp32 value. The plan counts both buffers
    (UnitSpec.weights_bytes): on the CPU device the copy comes from the device pool, elsewhere it
    is accounted as CopyWeights' buffers are (Device.reserve)."""

    def __init__(self, inner, device: Device, pool, dtype: torch.dtype):
        self.inner = inner
        self.device = device
        self.pool = pool
        self.dtype = dtype
        self.tensor: Optional[torch.Tensor] = None

    @property
    def state(self) -> SlotState:
        return self.inner.state

    def acquire(self) -> None:
        self.inner.acquire()

    def pump(self) -> None:
        self.inner.pump()

    def wait(self) -> torch.Tensor:
        if self.tensor is None:
            src = self.inner.wait()  # (copies: the compute stream waits for its copy)
            if self.device.copies:
                self.tensor = self.device.alloc(src.numel(), self.dtype, "a frozen segment's upcast copy")
            else:
                self.tensor = self.pool.get(src.numel(), self.dtype)
            self.tensor.copy_(src)  # (on the compute stream, which reads it next)
        return self.tensor

    def release(self) -> None:
        if self.tensor is not None:
            if self.device.copies:  # (kept until the compute stream is past it)
                self.device.dealloc(self.tensor, site=None)  # (compute's alone)
            else:
                self.pool.put(self.tensor)
            self.tensor = None
        self.inner.release()

    def refresh(self) -> None:
        pass  # never written


class CopyWeights:
    """A unit's device weights where device memory is its own (`copies`): a device buffer
    filled from the pinned compute copy on the h2d stream.

    resident: the buffer lives for the whole run and is refreshed after each update.
    """

    def __init__(self, source: Slot, device: Device, *, resident: bool):
        self.source = source
        self.device = device
        self.resident = resident
        self.tensor: Optional[torch.Tensor] = None
        self.state = SlotState.EMPTY
        self._event: Optional[Event] = None
        self._copied = False

    def _start_copy(self, host: torch.Tensor) -> None:
        dev, accel = self.device, self.device.accel
        if self.tensor is not None:
            # Overwriting weights in place (a resident unit's refresh): kernels the CPU has
            # queued on the compute stream may still read the old values.
            accel.wait_stream(dev.h2d, dev.compute_stream(), site="weights.refresh_after_compute")
        else:
            self.tensor = dev.alloc(host.numel(), host.dtype, self.source.key, stream=dev.h2d)
        accel.copy(self.tensor, host, dev.h2d)
        self._event = accel.record(dev.h2d)
        dev.h2d_bytes += host.numel() * host.element_size()
        self._copied = True

    def acquire(self) -> None:
        if self.state is not SlotState.EMPTY:
            return
        self.source.acquire(Hold.COMPUTE)
        self._copied = False
        self.state = SlotState.LOADING
        self.pump()

    def pump(self) -> None:
        """Starts the host-to-device copy once the host copy has arrived (and, where a pending
        update makes it, once the update is done: Slot.updating)."""
        if self.state is SlotState.LOADING and not self._copied:
            if self.source.updating and self.device.accel.holds_back(site="weights.after_update"):
                return
            read = self.source.pending_read
            if read is None or read.done():
                self._start_copy(self.source.wait())
                if not self.source.resident:
                    self.source.release(
                        Hold.COMPUTE, after=(self.device.after(self._event, site="weights.host_reuse"),)
                    )

    def wait(self) -> torch.Tensor:
        if self.state is SlotState.EMPTY:
            raise RuntimeError(f"{self.source.key}: device weights waited on before being fetched")
        if self.state is SlotState.LOADING:
            if not self._copied:
                if self.source.updating:  # (the executor binds a unit after its pending update)
                    raise RuntimeError(
                        f"{self.source.key}: device weights waited on before their update is done"
                    )
                self.source.wait()
                self.pump()
            self.state = SlotState.READY
        return self.device.use_on_compute(
            self.tensor, self._event, site="weights.bind", keep_site="weights.keep"
        )

    def release(self) -> None:
        if self.resident or self.state is SlotState.EMPTY:
            return
        if not self._copied:  # never reached the device: give the host copy back as is
            self.source.release(Hold.COMPUTE)
        if self.tensor is not None:
            self.device.dealloc(self.tensor, site="weights.free")  # after the streams that used it
        self.tensor = None
        self._event = None
        self.state = SlotState.EMPTY

    def load_resident(self) -> None:
        """Setup of a resident unit: copies the host copy to the device once."""
        self._start_copy(self.source.wait())
        self.state = SlotState.READY

    def refresh(self) -> None:
        """After an update: a resident device copy takes the new compute copy (source buffer,
        which the caller keeps held until the returned copy is done: see `last_copy`)."""
        if self.resident:
            self._start_copy(self.source.wait())

    @property
    def last_copy(self):
        """The pool Waitable of the last copy from the host buffer (None: none in flight)."""
        return self.copy_done(site="weights.refresh_host_reuse")

    def copy_done(self, *, site: str):
        """last_copy, its host wait named `site`."""
        return self.device.after(self._event, site=site)
