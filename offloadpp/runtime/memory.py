"""Flat buffers for unit arrays, reused across steps, within a byte budget.

Note: why a pool. A unit's array is fetched and dropped every step; allocating a fresh 100 MiB
buffer each time costs page faults and zeroing in the kernel (tens of ms per buffer, on the CPU
that also computes). Buffers are kept by (numel, dtype) and handed out again. A buffer given
back with work still reading or filling it (a write to SSD, a copy to the device) becomes
reusable only when that work is done: `put(buf, after=[...])`. When a new buffer would exceed
the budget, the pool first frees cached buffers of other sizes, then waits for pending work to
finish, oldest first; the plan checked that the working set fits, so this only paces the step
against the disk. If it still does not fit, the pool allocates anyway and counts the overshoot
(`over_budget_bytes`), so a wrong estimate shows up in the numbers rather than as a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Protocol, Sequence

import torch

log = logging.getLogger("offloadpp.runtime")


class Waitable(Protocol):
    def wait(self) -> object: ...

    def done(self) -> bool: ...


class _Pending:
    __slots__ = ("buf", "after")

    def __init__(self, buf: torch.Tensor, after: Sequence[Waitable]):
        self.buf = buf
        self.after = list(after)

    def done(self) -> bool:
        return all(w.done() for w in self.after)

    def wait(self) -> None:
        for w in self.after:
            w.wait()


class BufferPool:
    """Buffers of one kind of memory (the device, or host) for one engine."""

    def __init__(self, name: str, budget_bytes: int, alloc: Callable[[int, torch.dtype], torch.Tensor]):
        self.name = name
        self.budget_bytes = budget_bytes
        self._alloc = alloc
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self.allocated_bytes = 0  # handed out + pending + free
        self.peak_bytes = 0
        self.over_budget_bytes = 0
        self.wait_s = 0.0  # time spent waiting for pending work to free a buffer
        self.allocations = 0  # buffers allocated (each costs page faults on first touch)

    @staticmethod
    def _nbytes(numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (numel, dtype)
        need = self._nbytes(numel, dtype)
        with self._lock:
            self._reclaim_done()
            if self._free.get(key):
                return self._free[key].pop()
            self._trim_free(need)
            while self.allocated_bytes + need > self.budget_bytes and self._pending:
                p = self._pending.popleft()
                t0 = time.perf_counter()
                p.wait()
                self.wait_s += time.perf_counter() - t0
                self._add_free(p.buf)
                if self._free.get(key):
                    return self._free[key].pop()
                self._trim_free(need)
            if self.allocated_bytes + need > self.budget_bytes:
                over = self.allocated_bytes + need - self.budget_bytes
                if over > self.over_budget_bytes:
                    log.debug("%s pool over budget by %d bytes", self.name, over)
                self.over_budget_bytes = max(self.over_budget_bytes, over)
            self.allocated_bytes += need
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self.allocations += 1
        return self._alloc(numel, dtype)

    def put(self, buf: torch.Tensor, after: Sequence[Waitable] = ()) -> None:
        """Gives `buf` back; it is reused once every waitable in `after` is done."""
        with self._lock:
            after = [w for w in after if w is not None]
            if after:
                self._pending.append(_Pending(buf, after))
            else:
                self._add_free(buf)

    def drain(self) -> None:
        """Waits for all pending work on returned buffers."""
        with self._lock:
            while self._pending:
                p = self._pending.popleft()
                p.wait()
                self._add_free(p.buf)

    def clear(self) -> None:
        """Drains, then frees every cached buffer."""
        self.drain()
        with self._lock:
            for bufs in self._free.values():
                for b in bufs:
                    self.allocated_bytes -= self._nbytes(b.numel(), b.dtype)
            self._free.clear()

    # ---- internals (lock held) -----------------------------------------------------------
    def _add_free(self, buf: torch.Tensor) -> None:
        self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def _reclaim_done(self) -> None:
        while self._pending and self._pending[0].done():
            self._add_free(self._pending.popleft().buf)

    def _trim_free(self, need: int) -> None:
        """Frees cached buffers (of any size) until `need` more bytes fit, or none are left."""
        for key in list(self._free):
            bufs = self._free[key]
            while bufs and self.allocated_bytes + need > self.budget_bytes:
                b = bufs.pop()
                self.allocated_bytes -= self._nbytes(b.numel(), b.dtype)
            if not bufs:
                del self._free[key]
