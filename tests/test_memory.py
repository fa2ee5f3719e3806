"""runtime/memory.py: whose waits a pool counts as time the device did not compute."""

from __future__ import annotations

import threading
import time

import torch
from waitables import QueuedCopy

from offloadpp.runtime.memory import BufferPool, timed_elsewhere


class _Slow:
    """Work still filling a returned buffer: done after `s` seconds of waiting."""

    def __init__(self, s: float):
        self.s, self.waited = s, False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:
        time.sleep(self.s)
        self.waited = True


def _pool_with_pending(s: float) -> BufferPool:
    pool = BufferPool("host", 4096, lambda n, dt: torch.empty(n, dtype=dt))
    pool.put(pool.get(1024, torch.float32), after=[_Slow(s)])
    return pool


def test_only_the_owner_threads_untimed_waits_count():
    """The owner's wait counts; one inside a hook that times its own waits (the executor's) does not,
    nor one on another thread (the optimizer's worker applying pending updates): counting those
    made a deferred step's compute 0.000 in its StepReport."""
    pool = _pool_with_pending(0.05)
    pool.get(512, torch.float32)  # needs the pending buffer's room: waits for it
    assert pool.wait_s >= 0.04

    pool = _pool_with_pending(0.05)
    with timed_elsewhere():
        pool.get(512, torch.float32)
    assert pool.wait_s == 0.0

    pool = _pool_with_pending(0.05)
    t = threading.Thread(target=pool.get, args=(512, torch.float32))
    t.start()
    t.join()
    assert pool.wait_s == 0.0


def test_the_longest_wait_for_room_is_reported_on_any_thread():
    """A request that waits for room is timed whole, on any thread, and reset per step: the
    StepReport's BudgetUse.longest_wait_s, which tells a plan that under-counts (a run paced on a
    release) before the pool's RELEASE_WAIT_S turns it into an error (issue 37)."""
    pool = BufferPool("device", 4096, lambda n, dt: torch.empty(n, dtype=dt))
    held = pool.get(1024, torch.float32)  # the whole budget
    threading.Timer(0.2, pool.put, args=(held,)).start()  # given back by another thread
    t = threading.Thread(target=pool.get, args=(512, torch.float32))
    t.start()
    t.join()
    assert 0.15 <= pool.longest_wait_s < 5 and pool.step_longest_wait_s == pool.longest_wait_s
    pool.reset_step_peak()
    assert pool.step_longest_wait_s == 0.0 and pool.longest_wait_s >= 0.15

    pool = BufferPool("device", 4096, lambda n, dt: torch.empty(n, dtype=dt))
    pool.get(512, torch.float32)
    pool.charge(1024)  # fits: no wait
    assert pool.longest_wait_s == 0.0


def test_a_poisoning_pool_fills_a_buffer_with_nan_once_it_is_reusable_not_before():
    """The stand-in's host pools (Accelerator.poisons_host_reuse): a buffer is NaN from the moment
    the pool may hand it out, so a copy still reading it that no `after` named reads NaN at
    once; a buffer whose work is still under way keeps its bytes until that work is done."""
    pool = BufferPool("host", 1 << 20, lambda n, dt: torch.empty(n, dtype=dt), poison=True)
    buf = pool.get(64, torch.float32)
    buf.fill_(1.0)
    copy = QueuedCopy()
    pool.put(buf, after=[copy])
    other = pool.get(64, torch.float32)  # (not `buf`: its copy is under way)
    assert other.data_ptr() != buf.data_ptr() and torch.all(buf == 1.0)
    copy.finish()
    pool.put(other)
    assert torch.isnan(other).all()
    assert pool.get(64, torch.float32).data_ptr() in (buf.data_ptr(), other.data_ptr())
    assert torch.isnan(buf).all()  # reclaimed by that get: poisoned as it became reusable

    plain = BufferPool("host", 1 << 20, lambda n, dt: torch.empty(n, dtype=dt))
    b = plain.get(64, torch.float32)
    b.fill_(1.0)
    plain.put(b)
    assert torch.all(b == 1.0)  # (a pool that does not poison leaves the bytes)


class _FailingWrite:
    """A write under way that fails: its error is its owner's (the store keeps it)."""

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        raise OSError(28, "No space left on device")


def test_a_buffer_whose_write_failed_is_reusable_and_the_get_does_not_raise_its_error():
    """An aborted step's rollback gives a buffer back after its write (Slot.rollback), which may be
    the write that failed: the pool waits for it to be over, and the error stays with the store
    (the step's interruption reported it), not with the next get that waits for room."""
    pool = BufferPool("host", 256, lambda n, dt: torch.empty(n, dtype=dt))
    buf = pool.get(64, torch.float32)  # the whole budget
    pool.put(buf, after=[_FailingWrite()])
    assert pool.get(32, torch.float32).numel() == 32  # waited for the write, then made room
