"""A pool Waitable for tests of buffers given back with work still reading them (`after`):
runtime/memory.py's BufferPool and runtime/slots.py's Slot."""

from __future__ import annotations


class QueuedCopy:
    """A copy still queued on a stream until `finish()`. The tests finish it themselves: a pool
    that waits for it instead (a buffer taken before its work is done) fails the test."""

    def __init__(self):
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        if not self.finished:
            raise AssertionError("the pool waited for a copy this test never finishes")

    def finish(self) -> None:
        self.finished = True
