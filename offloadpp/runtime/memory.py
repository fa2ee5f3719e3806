"""Flat buffers for unit arrays, reused across steps, within a byte budget.

Note: why a pool. A unit's array is fetched and dropped every step; allocating a fresh 100 MiB
buffer each time costs page faults and zeroing in the kernel (tens of ms per buffer, on the CPU
that also computes). Buffers are kept by (numel, dtype) and handed out again. A buffer given
back with work still reading or filling it (a write to SSD, a copy to the device) becomes
reusable only when that work is done: `put(buf, after=[...])`.

Note: a budget is a promise. The pool never holds more than its budget. When a new buffer would
pass it, the pool first frees cached buffers of other sizes, then waits for pending work to
finish, oldest first, then has its owner give buffers back (`reclaim`: the optimizer completes
its oldest job, which releases that unit's state), then waits for another thread to give a
buffer back. The plan checked that the working set fits while the optimizer keeps up with
backward; where it falls behind, this is what keeps the promise, pacing backward to the worker
and the disk. If nothing comes back within RELEASE_WAIT_S the plan was wrong for this run:
BudgetExceededError names the pool, its budget, what it holds and the request.

Note: bytes outside the buffers. On the CPU device the gradients autograd leaves are device
memory the pool did not hand out; the optimizer charges them (`charge`) until they are dropped
(`uncharge`), so that they count against the device budget and a pool short of room waits for
them to go (the owner's reclaim waits for the oldest drop).

Note: whose waits count. `wait_s` is time the compute thread did not compute (the StepReport
subtracts it from forward and backward): only the owner's waits count, and not those inside
a wait already being timed on that thread (an executor hook, `timed_elsewhere`). The
optimizer's worker waiting for a buffer while it applies pending updates is not the device
idling; counting it made a deferred step's `compute` 0.000 (the worker's waits outran forward
and backward). `longest_wait_s` is another measure: the longest one call waited for room, on
any thread. A plan that counts what the runtime holds keeps it short (pending I/O, the worker's
oldest job); a long one is a plan that under-counts, which the StepReport's budgets show
(BudgetUse.longest_wait_s) before RELEASE_WAIT_S turns it into an error.

Note: a pace below the budget. A speculative plan's budgets hold what a step that speculates
holds; a step of the same run that defers its updates (it clips) needs less. Where the pool is
given a `pace_bytes` below its budget, work still under way (writes draining, the optimizer's
oldest job) is waited for before the pool grows past the pace; where nothing is under way it
grows up to the budget. So a run that always clips stays near a deferred plan's memory
(a write queue never fills the room a speculating step would use), and a step's working set is
never refused for the pace.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from typing import Callable, Optional, Protocol, Sequence

import torch

from offloadpp.planner import fmt_bytes

log = logging.getLogger("offloadpp.runtime")

RELEASE_WAIT_S = 60.0

_timed = threading.local()  # this thread's waits already timed by an enclosing hook: depth


class timed_elsewhere:
    """`with timed_elsewhere():` the pools' waits on this thread inside are timed by the caller
    (the module Note, whose waits count)."""

    def __enter__(self) -> None:
        _timed.depth = getattr(_timed, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _timed.depth -= 1


class BudgetExceededError(RuntimeError):
    """A buffer would have taken a pool past its budget, and nothing was released in time."""


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
            try:
                w.wait()
            except OSError:  # the buffer is free once the work is over, failed or not: a failed
                pass  # write is its owner's to report (the store keeps it), not this get's


class BufferPool:
    """Buffers of one kind of memory (the device, or host) for one engine, within a byte budget."""

    def __init__(self, name: str, budget_bytes: int, alloc: Callable[[int, torch.dtype], torch.Tensor],
                 *, poison: bool = False):  # fmt: skip
        """poison: a buffer made reusable is filled with 0xFF bytes (NaN) first (the stand-in
        accelerator's `poisons_host_reuse`: a copy still reading it that no `after` named then
        reads NaN at once, not only when the buffer is reused in time)."""
        self.name = name
        self.poison = poison
        self.budget_bytes = budget_bytes
        self.pace_bytes: Optional[int] = None  # see the module Note; None: the budget
        self._alloc = alloc
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._pending: deque[_Pending] = deque()
        self._cv = threading.Condition()
        self.allocated_bytes = 0  # handed out + pending + free + charged
        self.charged_bytes = 0  # held outside the pool's buffers (charge())
        self.peak_bytes = 0
        self.step_peak_bytes = 0  # since reset_step_peak()
        self.wait_s = 0.0  # time spent waiting for pending work or a release to free a buffer
        # the longest one get() or charge() waited for room, any thread, since the engine started
        # and in the current step (the waits Note)
        self.longest_wait_s = 0.0
        self.step_longest_wait_s = 0.0
        self.allocations = 0  # buffers allocated (each costs page faults on first touch)
        self.release_wait_s = RELEASE_WAIT_S
        # Called (without the pool's lock, on the owner's thread) to have buffers given back;
        # returns False when there is nothing left to give.
        self.reclaim: Optional[Callable[[], bool]] = None
        self.owner = threading.get_ident()

    def _count_wait(self, t0: float) -> None:
        if threading.get_ident() == self.owner and not getattr(_timed, "depth", 0):
            self.wait_s += time.perf_counter() - t0

    def _note_wait(self, t0: Optional[float]) -> None:
        """One call's whole wait for room, from `t0` (None: it did not wait)."""
        if t0 is not None:
            w = time.perf_counter() - t0
            self.longest_wait_s = max(self.longest_wait_s, w)
            self.step_longest_wait_s = max(self.step_longest_wait_s, w)

    @staticmethod
    def _nbytes(numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (numel, dtype)
        need = self._nbytes(numel, dtype)
        if need > self.budget_bytes:
            raise BudgetExceededError(
                f"{self.name} pool: a buffer of {fmt_bytes(need)} ({need} bytes) is larger than the whole "
                f"{self.name} budget of {fmt_bytes(self.budget_bytes)} ({self.budget_bytes} bytes)"
            )
        with self._cv:
            waited = None
            while True:
                self._reclaim_done()
                if self._free.get(key):
                    self._note_wait(waited)
                    return self._free[key].pop()
                limit = self._limit()
                self._trim_free(need, limit)
                if self.allocated_bytes + need <= limit:
                    break
                t0 = time.perf_counter()
                waited = t0 if waited is None else waited
                if self._pending:  # work still using a returned buffer: wait for the oldest
                    self._wait_oldest_pending()
                elif self.reclaim is not None and threading.get_ident() == self.owner and self._reclaim():
                    pass
                elif self.allocated_bytes + need <= self.budget_bytes:
                    break  # nothing under way to pace on: the budget holds
                elif not self._cv.wait(self.release_wait_s):  # a buffer handed out must come back
                    self._count_wait(t0)
                    self._note_wait(waited)
                    raise BudgetExceededError(
                        f"{self.name} pool: {fmt_bytes(need)} ({need} bytes) more would pass the {self.name} budget "
                        f"of {fmt_bytes(self.budget_bytes)} ({self.budget_bytes} bytes): {fmt_bytes(self.allocated_bytes)} "
                        f"held and nothing was given back for {self.release_wait_s:.0f} s. The plan does not fit "
                        "this run: raise the budget, or report the model and config as a bug"
                    )
                self._count_wait(t0)
            self._note_wait(waited)
            self.allocated_bytes += need
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self.step_peak_bytes = max(self.step_peak_bytes, self.allocated_bytes)
            self.allocations += 1
        return self._alloc(numel, dtype)

    def charge(self, nbytes: int) -> None:
        """Counts `nbytes` that the owner holds outside the pool's buffers against the budget
        (on the CPU device: the gradients autograd left, until the optimizer has absorbed and
        dropped them; uncharge() gives them back). Past the pace it waits, as get() does, for
        work under way: pending buffers, then the owner's reclaim (the optimizer's oldest job,
        then the oldest drop of gradients). It never refuses: the bytes exist already, and the
        plan holds room for the gradients of the visit that made them."""
        with self._cv:
            t0 = time.perf_counter()
            waited = None
            while True:
                self._reclaim_done()
                limit = self._limit()
                self._trim_free(nbytes, limit)
                if self.allocated_bytes + nbytes <= limit:
                    break
                waited = time.perf_counter() if waited is None else waited
                if self._pending:
                    self._wait_oldest_pending()
                elif not (
                    self.reclaim is not None and threading.get_ident() == self.owner and self._reclaim()
                ):
                    break
            self._count_wait(t0)
            self._note_wait(waited)
            self.allocated_bytes += nbytes
            self.charged_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self.step_peak_bytes = max(self.step_peak_bytes, self.allocated_bytes)

    def charge_until_dropped(self, tensors) -> None:
        """charge() the tensors' bytes, each given back (uncharge) when it is dropped, by
        whichever thread drops it last."""
        total = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            weakref.finalize(t, self.uncharge, n)
            total += n
        if total:
            self.charge(total)

    def uncharge(self, nbytes: int) -> None:
        """`nbytes` charged earlier are gone (any thread)."""
        with self._cv:
            self.allocated_bytes -= nbytes
            self.charged_bytes -= nbytes
            self._cv.notify_all()

    def _reclaim(self) -> bool:
        self._cv.release()
        try:
            return bool(self.reclaim())
        finally:
            self._cv.acquire()

    def put(self, buf: torch.Tensor, after: Sequence[Waitable] = ()) -> None:
        """Gives `buf` back; it is reused once every waitable in `after` is done."""
        with self._cv:
            after = [w for w in after if w is not None]
            if after:
                self._pending.append(_Pending(buf, after))
            else:
                self._add_free(buf)
            self._cv.notify_all()

    def reset_step_peak(self) -> None:
        with self._cv:
            self.step_peak_bytes = self.allocated_bytes
            self.step_longest_wait_s = 0.0

    def drain(self) -> None:
        """Waits for all pending work on returned buffers."""
        with self._cv:
            while self._pending:
                p = self._pending.popleft()
                p.wait()
                self._add_free(p.buf)

    def clear(self) -> None:
        """Drains, then frees every cached buffer."""
        self.drain()
        with self._cv:
            for bufs in self._free.values():
                for b in bufs:
                    self.allocated_bytes -= self._nbytes(b.numel(), b.dtype)
            self._free.clear()

    # ---- internals (lock held) -----------------------------------------------------------
    def _add_free(self, buf: torch.Tensor) -> None:
        if self.poison:
            buf.view(torch.uint8).fill_(0xFF)
        self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def _wait_oldest_pending(self) -> None:
        """Waits (lock released meanwhile) for the oldest work on a returned buffer, then caches it."""
        p = self._pending.popleft()
        self._cv.release()
        try:
            p.wait()
        finally:
            self._cv.acquire()
        self._add_free(p.buf)

    def _reclaim_done(self) -> None:
        while self._pending and self._pending[0].done():
            self._add_free(self._pending.popleft().buf)

    def _limit(self) -> int:
        pace = self.pace_bytes
        return self.budget_bytes if pace is None else min(pace, self.budget_bytes)

    def _trim_free(self, need: int, limit: int) -> None:
        """Frees cached buffers (of any size) until `need` more bytes fit under `limit`, or none
        are left."""
        for key in list(self._free):
            bufs = self._free[key]
            while bufs and self.allocated_bytes + need > limit:
                b = bufs.pop()
                self.allocated_bytes -= self._nbytes(b.numel(), b.dtype)
            if not bufs:
                del self._free[key]
