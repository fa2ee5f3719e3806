"""A Slot: one flat array of one unit (master weights, a moment, gradients, the compute copy) in
memory, backed by a key in the TensorStore, or resident for the whole run.

The main thread (the one running forward and the autograd hooks) is the only one that changes
a slot; the optimizer's worker only reads and writes the buffer it was handed, and returns the
futures of the writes it started, which the main thread records with `wrote()`.

Note: generations. A step whose updates run during backward must be able to vanish: if it is
interrupted (an exception, Ctrl-C) some units are updated and others not, and the state of the
last completed step is what must remain. A transactional slot (master, moments, the compute
copy) therefore has two keys in the store, `name@0` and `name@1`. Writes made while the engine's
step is open (`Txn.active`) go to the generation the last completed step does not use; reads go
to the newest one; commit() makes the newest the committed one and rollback() forgets it. Each
key is overwritten in place from step to step (fast), at the cost of twice the state on disk
while updates overlap backward. Outside a step (deferred updates, which run after backward,
uninterruptibly; the first weights; a checkpoint being loaded) writes go to the committed
generation and count at once.

Note: holds. Several parties may need a slot's buffer at once: the schedule (the unit computes
soon: COMPUTE), the optimizer (its update is pending: OPTIM), the next step's first visits (the
buffer just updated is reused instead of read back: NEXT), an export (state_dict: EXPORT). A slot
keeps its buffer while any hold is set (WRITE: a write of it is queued, not yet started); when the last goes the buffer returns to its pool,
reusable once the read or write still using it is done, and the work each release named (`after`: a copy to
the device still reading it), whichever hold it dropped. A resident slot never lets go.
"""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
from torch.autograd.profiler import record_function

from offloadpp.planner.traffic import array_kind

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


def tagged(store, array: str, plan):
    """The store as `array`'s slots use it: its puts and gets counted as the array's kind
    (planner/traffic.py), so a step's bytes by kind are counted at the I/O calls."""
    return store.tagged(array_kind(array, plan.separate_weights)) if store is not None else None


class Txn:
    """Whether a step's transaction is open: shared by every slot of an engine."""

    __slots__ = ("active",)

    def __init__(self):
        self.active = False


class Slot:
    def __init__(
        self,
        name: str,
        numel: int,
        dtype: torch.dtype,
        pool: BufferPool,
        store,
        *,
        resident: bool,
        stored: bool = True,
        txn: Optional[Txn] = None,
    ):
        """resident: the buffer lives for the whole run. stored: (not resident) the array's home
        is a key in the store; False: it has none (Plan.homes), the buffer is filled and used
        within a step and never read from or written to the store. txn: the engine's step
        transaction (see the Note on generations); None: not transactional."""
        self.name = name
        # a unit's compute copy whose pending update (runtime/pending.py) is not done: its buffer
        # is not the step's weights yet, so no device copy is made of it (device.CopyWeights)
        self.updating = False
        self.txn = txn  # None: not transactional (gradients, which a new window overwrites)
        self._committed: Optional[int] = None  # generation of the last completed step (None: zeros)
        self._latest: Optional[int] = None  # generation of the newest data
        self.numel = numel
        self.dtype = dtype
        self.home_dtype = dtype  # as built; `retype` may change `dtype` between uses (gradients)
        self._resident_raw: Optional[torch.Tensor] = None  # a resident buffer as allocated (retype)
        self.pool = pool
        self.store = store
        self.resident = resident
        self.stored = stored and not resident
        self.state = SlotState.EMPTY
        self.buffer: Optional[torch.Tensor] = None
        self.holds = Hold.NONE
        self._read: Optional[Waitable] = None
        self._write: Optional[Waitable] = None
        # Work still reading the buffer that a hold's release named (`after`) while other holds
        # kept it: the buffer goes back to the pool only after it, whichever hold goes last.
        self._after: list[Waitable] = []
        self.bytes_read = 0
        # The moments' reads leave their CRC-32C to the fused Adam (set by the unit; docs/io.md
        # "Checksums in the Adam pass"); `check` is the read's DeferredCheck until the buffer goes.
        self.check_in_adam = False
        self.check = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    # ---- generations (see the Note) ------------------------------------------------------------
    def key_of(self, generation: int) -> str:
        return f"{self.name}@{generation}" if self.txn is not None else self.name

    @property
    def key(self) -> str:
        """The store key of the newest data (reads go here)."""
        return self.key_of(self._latest or 0)

    @property
    def on_disk(self) -> bool:
        """The store has the newest data (else it is all zeros: nothing was ever written)."""
        return self._latest is not None

    def write_generation(self) -> int:
        """Where a write decided now goes: in an open step, the generation the last completed
        step does not use; otherwise the committed one."""
        if self.txn is None:
            return 0
        base = self._committed if self._committed is not None else 1
        return 1 - base if self.txn.active else (self._committed or 0)

    @property
    def uncommitted(self) -> bool:
        return self._latest != self._committed

    def commit(self) -> None:
        self._committed = self._latest

    def rollback(self) -> None:
        """Back to the last completed step: the newest data is forgotten, and a buffer that may
        hold it is given back (a resident slot cannot be rolled back: the engine checks)."""
        self._latest = self._committed
        write, self._write = self._write, None
        self.holds = Hold.NONE
        if self.resident or self.state is SlotState.EMPTY:
            return
        # (a write still reading the buffer is waited for, whatever its generation: an aborted
        # step rolls back slots whose committed writes it has just started, transaction.abort)
        self._give_back(self._read, write, *self._after)

    def _give_back(self, *after) -> None:
        """The buffer back to its pool, reusable once `after` (work still using it) is done."""
        self.pool.put(self.buffer, after=after)
        self.buffer = None
        self._read = None
        self._after = []
        self.check = None
        self.state = SlotState.EMPTY

    def __repr__(self) -> str:
        return f"Slot({self.name!r}, {self.state.value}, holds={self.holds}, resident={self.resident})"

    # ---- lifecycle -----------------------------------------------------------------------
    def make_resident(self, initial: Optional[torch.Tensor] = None) -> None:
        """Allocates the permanent buffer of a resident slot (zeros, or a copy of `initial`)."""
        self.buffer = self.pool.get(self.numel, self.dtype)
        self._resident_raw = self.buffer
        if initial is None:
            self.buffer.zero_()
        else:
            self.buffer.copy_(initial)
        self.state = SlotState.READY

    def retype(self, dtype: Optional[torch.dtype]) -> None:
        """Holds `dtype` (None: the dtype it was built with) from its next use on; what it held
        is dropped (the next acquire overwrites or reads zeros). For gradients, which a new window
        overwrites: a vertical window keeps its sums in the compute dtype where a per-micro-batch
        loop of the same plan accumulates fp32 (Plan.window_grad_dtype). The slot must hold
        nothing; a resident one views its buffer, allocated for the dtype it was built with, as
        `dtype` (no wider than that)."""
        dtype = self.home_dtype if dtype is None else dtype
        if dtype == self.dtype:
            return
        if self.txn is not None or self.holds or (not self.resident and self.state is not SlotState.EMPTY):
            raise SlotError(
                f"{self.name}: retype to {dtype} while it holds data ({self.state.value}, {self.holds})"
            )
        if dtype.itemsize > self.home_dtype.itemsize:
            raise SlotError(f"{self.name}: retype to {dtype}, wider than its {self.home_dtype}")
        self.flush()  # (a write of the old dtype's key ends before the key is laid out again)
        self._latest = self._committed = None  # nothing written in the new dtype yet: zeros
        self.dtype = dtype
        if self._resident_raw is not None:
            raw = self._resident_raw
            self.buffer = raw if dtype == raw.dtype else raw.view(torch.uint8)[: self.nbytes].view(dtype)

    def acquire(self, hold: Hold, *, overwrite: bool = False) -> None:
        """Makes sure a buffer is (being) filled with the current data; `overwrite`: the caller
        replaces every element, so nothing is read."""
        self.holds |= hold
        if overwrite:
            self.check = None  # nothing of a read is used: nothing of it to check
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
                elif self.check_in_adam:
                    self._read = self.store.get(self.key, out=self.buffer, defer_check=True)
                    self.check = getattr(self._read, "check", None)
                else:
                    self._read = self.store.get(self.key, out=self.buffer)
            self.bytes_read += self.nbytes
            self.state = SlotState.LOADING

    def wait(self) -> torch.Tensor:
        """The buffer, once its data is there (and checked: a read whose CRC was left to the
        Adam pass is checked here by a pass of its own if no Adam pass has claimed it)."""
        if self.state is SlotState.EMPTY:
            raise SlotError(f"{self.name}: wait() on a slot that was not acquired")
        if self.state is SlotState.LOADING:
            self._read.wait()
            self._read = None
            self.state = SlotState.READY
        if self.check is not None:
            self.check.verify(self.buffer.data_ptr())
        return self.buffer

    @property
    def pending_read(self) -> Optional[Waitable]:
        return self._read if self.state is SlotState.LOADING else None

    @property
    def pending_write(self) -> Optional[Waitable]:
        return self._write if self._write is not None and not self._write.done() else None

    def will_write(self, generation: int) -> None:
        """The buffer, held, is the newest data of `generation` and will be written there later
        (flush_writes): reads until then are served from it, and a commit counts it."""
        self._latest = generation
        if self.txn is None or not self.txn.active:
            self._committed = generation

    def wrote(self, fut: Waitable, generation: int = 0) -> None:
        """Records a write of the buffer to the store, to `generation` (write_generation()
        when it was decided); outside an open step it counts as committed at once."""
        self._write = fut
        self._latest = generation
        if self.txn is None or not self.txn.active:
            self._committed = generation

    def release(self, hold: Hold, after: tuple = ()) -> None:
        """Drops `hold`; with no hold left the buffer goes back to the pool, once `after` (work
        still reading it) and what earlier releases named are done."""
        self.holds &= ~hold
        if self.resident:
            return
        after = [w for w in after if w is not None]
        if self.state is SlotState.EMPTY:
            if after:  # (the work reads a buffer the pool may have handed out already)
                raise SlotError(
                    f"{self.name}: {hold} released naming work that still reads the buffer, which was "
                    "given back already (an earlier release of the slot's last hold did not name it)"
                )
            return
        # (work already done is dropped: a buffer another hold keeps for good, the weights of a
        # unit kept across steps, collected one copy's event per step without end)
        self._after = [w for w in self._after if not w.done()] + after
        if self.holds:
            # (a copy to the device from the buffer may still be queued when another hold goes
            # last: CopyWeights.pump releases COMPUTE while NEXT or WRITE keeps the buffer)
            return
        self._give_back(self._read, self._write, *self._after)

    def flush(self) -> None:
        """Waits for this slot's write, if any."""
        if self._write is not None:
            self._write.wait()
            self._write = None
