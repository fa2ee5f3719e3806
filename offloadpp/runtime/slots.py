"""A Slot: one flat array of one unit (master weights, a moment, gradients, the compute copy) in
memory, backed by a key in the TensorStore, or resident for the whole run.

The main thread (the one running forward and the autograd hooks) is the only one that changes
a slot; the optimizer's worker only reads and writes the buffer it was handed, and returns the
futures of the writes it started, which the main thread records with `wrote()`.

Note: holds. Several parties may need a slot's buffer at once: the schedule (the unit computes
soon: COMPUTE), the optimizer (its update is pending: OPTIM), the next step's first visits (the
buffer just updated is reused instead of read back: NEXT), an export (state_dict: EXPORT). A slot
keeps its buffer while any hold is set (WRITE: a write of it is queued, not yet started); when the last goes the buffer returns to its pool,
reusable once the read or write still using it is done. A resident slot never lets go.
"""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
from torch.autograd.profiler import record_function

from .memory import BufferPool, Waitable


class Hold(enum.Flag):
    NONE = 0
    COMPUTE = enum.auto()
    OPTIM = enum.auto()
    NEXT = enum.auto()
    EXPORT = enum.auto()
    WRITE = enum.auto()  # a write of the buffer is queued but not started yet


class SlotState(enum.Enum):
    EMPTY = "empty"  # no buffer: the data is only at its home (the store)
    LOADING = "loading"  # a buffer is being filled from the store
    READY = "ready"  # the buffer holds the current data


class SlotError(RuntimeError):
    pass


_issuer: Optional[ThreadPoolExecutor] = None
_issuer_lock = threading.Lock()


def _read_after_write_issuer() -> ThreadPoolExecutor:
    global _issuer
    with _issuer_lock:
        if _issuer is None:
            _issuer = ThreadPoolExecutor(1, thread_name_prefix="offloadpp-raw")
        return _issuer


class _ReadAfterWrite:
    """A read of a key whose own write is still draining: issued (on a helper thread) as soon as
    that write completes, so the caller does not block.

    Note: why not just wait. The runtime fetches weights k units ahead from the main thread; with
    deferred updates the step's last writes are those very keys, and waiting for them there
    stalls forward (docs/runtime.md has the measurement). Here the read starts the moment
    the write is done and forward only waits if it reaches the unit before the read is done."""

    def __init__(self, write: Waitable, issue: Callable[[], Waitable]):
        def run() -> Waitable:
            write.wait()
            return issue()

        self._f: Future = _read_after_write_issuer().submit(run)

    def done(self) -> bool:
        return self._f.done() and self._f.result().done()

    def wait(self) -> object:
        return self._f.result().wait()


class Slot:
    def __init__(
        self,
        key: str,
        numel: int,
        dtype: torch.dtype,
        pool: BufferPool,
        store,
        *,
        resident: bool,
        stored: bool = True,
    ):
        """resident: the buffer lives for the whole run. stored: (not resident) the array's home
        is a key in the store; False: it has none (Plan.homes), the buffer is filled and used
        within a step and never read from or written to the store."""
        self.key = key
        self.numel = numel
        self.dtype = dtype
        self.pool = pool
        self.store = store
        self.resident = resident
        self.stored = stored and not resident
        self.state = SlotState.EMPTY
        self.buffer: Optional[torch.Tensor] = None
        self.holds = Hold.NONE
        self.on_disk = False  # the store has a current copy (else the content is all zeros)
        self._read: Optional[Waitable] = None
        self._write: Optional[Waitable] = None
        self.bytes_read = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"Slot({self.key!r}, {self.state.value}, holds={self.holds}, resident={self.resident})"

    # ---- lifecycle -----------------------------------------------------------------------
    def make_resident(self, initial: Optional[torch.Tensor] = None) -> None:
        """Allocates the permanent buffer of a resident slot (zeros, or a copy of `initial`)."""
        self.buffer = self.pool.get(self.numel, self.dtype)
        if initial is None:
            self.buffer.zero_()
        else:
            self.buffer.copy_(initial)
        self.state = SlotState.READY

    def acquire(self, hold: Hold, *, overwrite: bool = False) -> None:
        """Makes sure a buffer is (being) filled with the current data; `overwrite`: the caller
        replaces every element, so nothing is read."""
        self.holds |= hold
        if self.state is not SlotState.EMPTY:
            return
        with record_function("offloadpp::pool_get"):
            self.buffer = self.pool.get(self.numel, self.dtype)
        if overwrite:
            self.state = SlotState.READY
        elif not self.on_disk:
            self.buffer.zero_()
            self.state = SlotState.READY
        else:
            write = self._write if self._write is not None and not self._write.done() else None
            with record_function("offloadpp::store_get"):
                if write is not None:  # our own write of this key is still draining: read after it
                    key, buf = self.key, self.buffer
                    self._read = _ReadAfterWrite(write, lambda: self.store.get(key, out=buf))
                else:
                    self._read = self.store.get(self.key, out=self.buffer)
            self.bytes_read += self.nbytes
            self.state = SlotState.LOADING

    def wait(self) -> torch.Tensor:
        """The buffer, once its data is there."""
        if self.state is SlotState.EMPTY:
            raise SlotError(f"{self.key}: wait() on a slot that was not acquired")
        if self.state is SlotState.LOADING:
            self._read.wait()
            self._read = None
            self.state = SlotState.READY
        return self.buffer

    @property
    def pending_read(self) -> Optional[Waitable]:
        return self._read if self.state is SlotState.LOADING else None

    @property
    def pending_write(self) -> Optional[Waitable]:
        return self._write if self._write is not None and not self._write.done() else None

    def wrote(self, fut: Waitable) -> None:
        """Records a write of the buffer to the store (started by the optimizer's worker)."""
        self._write = fut
        self.on_disk = True

    def release(self, hold: Hold, after: tuple = ()) -> None:
        """Drops `hold`; with no hold left the buffer goes back to the pool."""
        self.holds &= ~hold
        if self.holds or self.resident or self.state is SlotState.EMPTY:
            return
        self.pool.put(self.buffer, after=(self._read, self._write, *after))
        self.buffer = None
        self._read = None
        self.state = SlotState.EMPTY

    def flush(self) -> None:
        """Waits for this slot's write, if any."""
        if self._write is not None:
            self._write.wait()
            self._write = None
