"""Aligned (and, with CUDA, pinned) host buffers, and pools that reuse them.

Note: pinning. C++ has no CUDA. When CUDA is present, aligned buffers come from torch's pinned
allocator (page-locked, DMA-able) over-allocated by one alignment unit and sliced to an aligned
start; otherwise from offloadpp._C.AlignedBuffer (posix_memalign), wrapped without a copy by
torch.frombuffer, which keeps the allocation alive as long as any view of it.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from typing import Optional, Sequence, Union

import torch

import offloadpp._C as _C

from .errors import EINVAL, swap_error

ALIGNMENT: int = int(_C.ALIGNMENT)


def align_up(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


def cuda_present() -> bool:
    try:
        return torch.accelerator.is_available()  # (pinning needs one)
    except Exception:  # a broken driver install must not break CPU-only use
        return False


def is_direct_capable(t: torch.Tensor) -> bool:
    """True if `t` can be the buffer of an O_DIRECT transfer as is: CPU, contiguous, aligned start."""
    return t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0


# Process-wide registry of allocations made here: [start, end) ranges, so that any view of an
# aligned_empty() tensor is recognised (AsyncIOHandle.is_pinned, as DeepSpeed's pin manager).
_registry_lock = threading.Lock()
_starts: list[int] = []
_ends: dict[int, int] = {}


def _register(start: int, end: int, owner: object) -> None:
    with _registry_lock:
        bisect.insort(_starts, start)
        _ends[start] = end
    weakref.finalize(owner, _unregister, start)


def _unregister(start: int) -> None:
    with _registry_lock:
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:
            _starts.pop(i)
            _ends.pop(start, None)


def is_managed(t: torch.Tensor) -> bool:
    """True if all bytes of `t` lie inside one buffer allocated by aligned_empty()."""
    if t.device.type != "cpu":
        return False
    ptr = t.data_ptr()
    end = ptr + t.numel() * t.element_size()
    with _registry_lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        return i >= 0 and end <= _ends[_starts[i]]


def _aligned_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 CPU tensor of align_up(nbytes) bytes starting at an ALIGNMENT boundary."""
    cap = align_up(max(nbytes, 1))
    if pin:
        raw = torch.empty(cap + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
        skip = (-raw.data_ptr()) % ALIGNMENT
        out = raw[skip : skip + cap]
        owner: object = raw  # every view keeps its base tensor alive
    else:
        buf = _C.AlignedBuffer(cap)
        out = torch.frombuffer(buf, dtype=torch.uint8)
        owner = buf
    _register(out.data_ptr(), out.data_ptr() + cap, owner)
    return out


def aligned_empty(
    shape_or_numel: Union[int, Sequence[int], torch.Size],
    dtype: torch.dtype = torch.float32,
    pin: Optional[bool] = None,
) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on a 4096-byte boundary.

    Its storage is rounded up to a multiple of 4096 bytes. pin=None pins (page-locks) it when
    CUDA is available; pin=True without CUDA raises.
    """
    if isinstance(shape_or_numel, int):
        shape: tuple[int, ...] = (shape_or_numel,)
    else:
        shape = tuple(int(s) for s in shape_or_numel)
    if any(s < 0 for s in shape):
        raise swap_error(EINVAL, f"aligned_empty(shape={shape}) (negative size)")
    numel = math.prod(shape)
    itemsize = dtype.itemsize
    if pin is None:
        pin = cuda_present()
    elif pin and not cuda_present():
        raise swap_error(EINVAL, "aligned_empty(pin=True) (no CUDA device to pin memory for)")
    raw = _aligned_bytes(numel * itemsize, pin)
    return raw[: numel * itemsize].view(dtype).view(shape)


class BounceCache:
    """Aligned scratch buffers of varying sizes for unaligned or non-contiguous tensors.

    acquire(n) reuses the smallest free buffer of at least n bytes or allocates one (rounded to
    1 MiB); release() keeps it for reuse while the cached total stays under max_cached_bytes.
    """

    _GRAIN = 1 << 20

    def __init__(self, max_cached_bytes: int, pin: Optional[bool] = None):
        self.max_cached_bytes = max_cached_bytes
        self.pin = pin
        self._free: list[torch.Tensor] = []  # sorted by size
        self._cached = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.numel() >= nbytes:
                    self._cached -= b.numel()
                    return self._free.pop(i)
        size = align_up(max(nbytes, 1), self._GRAIN if nbytes > self._GRAIN else ALIGNMENT)
        return aligned_empty(size, torch.uint8, self.pin)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._cached + buf.numel() > self.max_cached_bytes:
                return  # dropped: freed when the last reference goes
            sizes = [b.numel() for b in self._free]
            self._free.insert(bisect.bisect_left(sizes, buf.numel()), buf)
            self._cached += buf.numel()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._cached = 0


class HeaderBuffers:
    """A free list of single-block (4096-byte) aligned buffers for file headers and tails."""

    def __init__(self):
        self._free: list[_C.AlignedBuffer] = []
        self._lock = threading.Lock()

    def acquire(self) -> _C.AlignedBuffer:
        with self._lock:
            if self._free:
                return self._free.pop()
        return _C.AlignedBuffer(ALIGNMENT)

    def release(self, buf: _C.AlignedBuffer) -> None:
        with self._lock:
            if len(self._free) < 1024:
                self._free.append(buf)
