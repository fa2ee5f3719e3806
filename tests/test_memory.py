"""runtime/memory.py: whose waits a pool counts as time the device did not compute."""

from __future__ import annotations

import threading
import time

import torch

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
