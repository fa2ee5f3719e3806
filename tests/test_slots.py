"""A Slot's buffer goes back to its pool only after the work its holds' releases named (`after`),
whichever hold goes last: CopyWeights.pump releases COMPUTE with its host-to-device copy's event
while NEXT (the updated weights kept for the next forward) still holds the buffer; releasing NEXT
must not hand the buffer to the next read while that copy is still queued (on the stand-in, and
on a GPU, the copy then reads another unit's bytes: the flaky
test_quarter_budget_trains_like_keep_within_the_peak[standin])."""

from __future__ import annotations

import pytest
import torch

from offloadpp.runtime.memory import BufferPool
from offloadpp.runtime.slots import Hold, Slot, Txn


class _Copy:
    """A copy still queued on a stream until `finish()`: a pool Waitable."""

    def __init__(self):
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        if not self.finished:
            raise AssertionError("the pool waited for a copy this test never finishes")

    def finish(self) -> None:
        self.finished = True


@pytest.mark.parametrize("last", ["release", "rollback"])
def test_buffer_reused_only_after_every_released_holds_work(last):
    pool = BufferPool("host", 1 << 20, lambda n, dt: torch.empty(n, dtype=dt))
    slot = Slot("u.master", 64, torch.float32, pool, store=None, resident=False, txn=Txn())
    slot.acquire(Hold.COMPUTE)
    slot.acquire(Hold.NEXT)
    buf = slot.wait()
    copy = _Copy()
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
