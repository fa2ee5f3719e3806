"""A Slot's buffer goes back to its pool only after the work its holds' releases named (`after`),
whichever hold goes last: CopyWeights.pump releases COMPUTE with its host-to-device copy's event
while NEXT (the updated weights kept for the next forward) still holds the buffer; releasing NEXT
must not hand the buffer to the next read while that copy is still queued (on the stand-in, and
on a GPU, the copy then reads another unit's bytes: the flaky
test_quarter_budget_trains_like_keep_within_the_peak[standin])."""

from __future__ import annotations

import pytest
import torch
from waitables import QueuedCopy

from offloadpp.runtime.memory import BufferPool
from offloadpp.runtime.slots import Hold, Slot, SlotError, Txn


def test_rollback_gives_the_buffer_back_only_after_its_write():
    """An aborted step rolls back slots whose writes are still draining from their buffers: those
    it started itself for the last completed step (transaction.abort: the pending updates it
    completes, the queued writes it flushes), to the committed generation, on slots another hold
    kept. The buffer goes back to its pool after the write, or the next read into it lands in
    the committed file."""
    pool = BufferPool("host", 1 << 20, lambda n, dt: torch.empty(n, dtype=dt))
    slot = Slot("u.master", 64, torch.float32, pool, store=None, resident=False, txn=Txn())
    slot.acquire(Hold.COMPUTE)  # (the forward's fetch, which the abort interrupted)
    slot.acquire(Hold.OPTIM, overwrite=True)
    buf = slot.wait()
    write = QueuedCopy()  # the write of `buf` to the committed generation, still under way
    slot.wrote(write, slot.write_generation())
    slot.release(Hold.OPTIM)
    slot.rollback()
    assert slot.buffer is None
    assert pool.get(64, torch.float32).data_ptr() != buf.data_ptr(), "handed out while its write read it"
    write.finish()
    assert pool.get(64, torch.float32).data_ptr() == buf.data_ptr()


def test_a_release_naming_work_on_a_buffer_already_given_back_is_refused():
    """A release that names work still reading the buffer (`after`) after an earlier release let
    the last hold go cannot keep its promise: the buffer is back in the pool. It raises rather
    than drop the work (the optimizer released the master, which with fp32 is the compute copy,
    before the compute copy with the resident refresh's copy: tests/test_runtime_device.py)."""
    pool = BufferPool("host", 1 << 20, lambda n, dt: torch.empty(n, dtype=dt))
    slot = Slot("u.master", 64, torch.float32, pool, store=None, resident=False)
    slot.acquire(Hold.OPTIM)
    slot.wait()
    slot.release(Hold.OPTIM)
    slot.release(Hold.OPTIM)  # (nothing named: a no-op, as before)
    with pytest.raises(SlotError, match="u.master: .*given back already"):
        slot.release(Hold.OPTIM, after=(QueuedCopy(),))


def test_work_a_kept_buffer_collects_is_dropped_once_done():
    """A buffer another hold keeps across steps (the weights of a unit kept for the next forward)
    gets one copy's release per step: the work already done is not kept, or the list grows
    without end (a copy's event per step, for the whole run), and a release still names the
    work that is not done."""
    pool = BufferPool("host", 1 << 20, lambda n, dt: torch.empty(n, dtype=dt))
    slot = Slot("u.weights", 64, torch.float32, pool, store=None, resident=False)
    slot.acquire(Hold.NEXT)
    buf = slot.wait()
    copies = []
    for _ in range(100):
        slot.acquire(Hold.COMPUTE)
        copies.append(QueuedCopy())
        slot.release(Hold.COMPUTE, after=(copies[-1],))
        copies[-1].finish()
    last = QueuedCopy()
    slot.acquire(Hold.COMPUTE)
    slot.release(Hold.COMPUTE, after=(last,))
    assert len(slot._after) <= 2
    slot.release(Hold.NEXT)
    assert pool.get(64, torch.float32).data_ptr() != buf.data_ptr()
    last.finish()
    assert pool.get(64, torch.float32).data_ptr() == buf.data_ptr()


@pytest.mark.parametrize("last", ["release", "rollback"])
def test_buffer_reused_only_after_every_released_holds_work(last):
    pool = BufferPool("host", 1 << 20, lambda n, dt: torch.empty(n, dtype=dt))
    slot = Slot("u.master", 64, torch.float32, pool, store=None, resident=False, txn=Txn())
    slot.acquire(Hold.COMPUTE)
    slot.acquire(Hold.NEXT)
    buf = slot.wait()
    copy = QueuedCopy()
    slot.release(Hold.COMPUTE, after=(copy,))  # a copy to the device still reads `buf`
    assert slot.buffer is buf  # (NEXT keeps it)
    if last == "release":
        slot.release(Hold.NEXT)
    else:
        slot.rollback()
    assert slot.buffer is None
    other = pool.get(64, torch.float32)
    assert other.data_ptr() != buf.data_ptr(), "the buffer was handed out while a copy still read it"
    copy.finish()
    assert pool.get(64, torch.float32).data_ptr() == buf.data_ptr()


def test_a_gradient_slot_takes_a_windows_dtype_between_uses():
    """Slot.retype (a vertical window keeps its gradient sums in the compute dtype where a
    per-micro-batch loop of the same plan accumulates fp32: Plan.window_grad_dtype): an empty
    slot's next buffer has the new dtype and what it held is dropped (zeros, not the old key); a
    resident one views its buffer in it; a slot holding data, a transactional one, or a wider
    dtype are refused; None goes back to the dtype it was built with."""
    pool = BufferPool("host", 1 << 20, lambda n, dt: torch.empty(n, dtype=dt))
    slot = Slot("u.grads", 64, torch.float32, pool, store=None, resident=False)
    slot.acquire(Hold.OPTIM, overwrite=True)
    slot.wait().fill_(3.0)
    slot.will_write(0)  # (its newest data, as a write would record it)
    with pytest.raises(SlotError, match="u.grads: retype to torch.bfloat16 while it holds data"):
        slot.retype(torch.bfloat16)
    slot.release(Hold.OPTIM)
    slot.retype(torch.bfloat16)
    assert slot.nbytes == 128 and not slot.on_disk
    slot.acquire(Hold.OPTIM)
    got = slot.wait()
    assert got.dtype == torch.bfloat16 and got.numel() == 64 and not got.any()
    slot.release(Hold.OPTIM)
    slot.retype(None)
    assert slot.dtype == torch.float32
    with pytest.raises(SlotError, match="wider than its torch.float16"):
        Slot("v.grads", 8, torch.float16, pool, store=None, resident=False).retype(torch.float32)
    with pytest.raises(SlotError, match="while it holds data"):
        Slot("v.master", 8, torch.float32, pool, store=None, resident=False, txn=Txn()).retype(torch.float16)
    home = Slot("w.grads", 64, torch.float32, pool, store=None, resident=True)
    home.make_resident()
    raw = home.buffer
    home.retype(torch.float16)
    assert home.buffer.dtype == torch.float16 and home.buffer.numel() == 64
    assert home.buffer.data_ptr() == raw.data_ptr()
    home.retype(None)
    assert home.buffer is raw
