"""The stand-in accelerator's streams, events and queued work (standin.py is the accelerator).

Note: what the host knows. A side stream runs its queue on a worker thread; `completed` is how
far it has got. The host *knows* a point of a stream only once it waited for it or saw it done
(Event.wait, a query that answered True, synchronize): `known`. Compute waiting on an event
blocks the caller here (compute is the caller), yet on a GPU it does not, so it teaches the host
nothing. The difference matters where the runtime gives a host buffer back after a copy: it may
do so only after a host wait (a pool's `after`), never because compute waited. A skipped host
wait (the mutation check) on a point the host does not know is modelled at its worst: each copy
of that event's group (the work queued since the stream's previous event) may run after the
host reuses the buffer: a host-to-device copy delivers garbage (NaN: `poisoned`, or its
destination filled now if it already ran), a device-to-host copy lands late (`held`: its bytes
are written over the buffer's next contents when the host next reads them through the stand-in,
or when the host learns the stream passed it).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .base import Accelerator, Event, Stream

HISTORY = 4096  # items of a stream remembered after they ran (a skipped wait's group is recent)


class StandinRaceError(RuntimeError):
    """Work on a side stream touched memory the compute stream used, unordered (a missing wait)."""


class StandinUseAfterFreeError(RuntimeError):
    """A stream got to a copy whose memory had been freed (a missing record_use)."""


def weak_view(t: torch.Tensor) -> tuple:
    return StorageWeakRef(t.untyped_storage()), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def revive(view: tuple, stream: str, what: str) -> Optional[torch.Tensor]:
    """The tensor of `view` if its memory is still there; gone: None for a source or a late
    write, an error for a destination a stream got to."""
    ref, offset, shape, stride, dtype = view
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    if storage is None and what != "destination":
        return None
    if storage is None:
        raise StandinUseAfterFreeError(
            f"stand-in device: {stream} got to a copy whose {what} had been freed meanwhile (on a GPU the "
            "memory would be another tensor's by then: a missing record_use for this stream)"
        )
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The host address range `t` spans (its storage's, if not contiguous: wider is safe)."""
    if t.is_contiguous():
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def nan_fill(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    else:
        t.fill_(-1 if t.dtype.is_signed else (1 << (8 * t.element_size())) - 1 & 0xFF)


class Item:
    """One piece of a stream's work, run by its worker. A copy or a delivery names its ends for
    the host-side model (the module Note): `host` the host range it reads or writes (None: device
    to device), `to_host` its direction, `dev` (block, generation) of its device destination."""

    __slots__ = (
        "pos",
        "fn",
        "dst",
        "src",
        "data",
        "host",
        "to_host",
        "dev",
        "started",
        "ran",
        "poisoned",
        "held",
    )

    def __init__(self, fn: Optional[Callable[[Item], None]] = None):
        self.fn = fn
        self.pos = 0
        self.dst = self.src = self.data = self.host = self.dev = None
        self.to_host = False
        self.started = self.ran = self.poisoned = self.held = False


class StandinStream(Stream):
    """A worker thread running its queue in order, each item after a random delay."""

    def __init__(self, accel: Accelerator, name: str, rng: Optional[random.Random]):
        # (accel: the StandinAccelerator, its error, delay_s and learn())
        self.accel, self.name, self.rng = accel, name, rng
        self.queued = 0  # items queued so far (an event is a position in this count)
        self.completed = 0
        self.known = 0  # the host knows the stream got this far (the module Note)
        self.last_record = 0  # where the previous event was recorded: an event's group starts there
        self.seen_compute = 0  # the compute epoch this stream last waited for
        self._items: deque[Item] = deque()
        self.history: deque[Item] = deque(maxlen=HISTORY)
        self._kept: deque[tuple[int, torch.Tensor]] = deque()  # record_use: memory held to a point
        self.cond = threading.Condition()
        self._stop = False
        self._thread = None
        if rng is not None:  # (the compute stream has no worker: it is the caller)
            self._thread = threading.Thread(target=self._run, name=f"standin-{name}", daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"StandinStream({self.name!r})"

    @property
    def is_compute(self) -> bool:
        return self._thread is None

    def submit(self, item: Item) -> int:
        with self.cond:
            self.queued += 1
            item.pos = self.queued
            self._items.append(item)
            self.history.append(item)
            self.cond.notify_all()
            return self.queued

    def wait_for(self, pos: int) -> None:
        """Blocks until the stream has run `pos` (device-side: the host learns nothing)."""
        with self.cond:
            while self.completed < pos and self.accel.error is None:
                self.cond.wait(0.05)
        self.accel.check()

    def group(self, start: int, pos: int) -> list[Item]:
        """The remembered items in (start, pos], once none of them is running (cond held)."""
        while True:
            items = [it for it in self.history if start < it.pos <= pos]
            if not any(it.started and not it.ran for it in items):
                return items
            self.cond.wait(0.05)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._items and not self._stop:
                    self.cond.wait()
                if self._stop and not self._items:
                    return
                it = self._items[0]
            time.sleep(self.rng.uniform(0.0, self.accel.delay_s))
            with self.cond:
                it.started = True
            try:
                if it.fn is not None:
                    it.fn(it)
            except BaseException as e:  # surfaced at the next wait, as a device error is
                self.accel.error = self.accel.error or e
            with self.cond:
                self._items.popleft()
                it.ran = True
                self.completed = it.pos
                while self._kept and self._kept[0][0] <= it.pos:
                    self._kept.popleft()
                self.cond.notify_all()

    def keep(self, t: torch.Tensor) -> None:
        """Holds `t`'s memory until the stream has run what is queued now."""
        with self.cond:
            if self.completed < self.queued:
                self._kept.append((self.queued, t))

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join()


class StandinEvent(Event):
    """A point of a stream; `start`: the stream's previous event (this one's group begins after)."""

    def __init__(self, stream: StandinStream, pos: int, start: int = 0):
        self.stream, self.pos, self.start = stream, pos, start

    def done(self) -> bool:
        """A host query: True teaches the host the stream got here."""
        if self.stream.completed >= self.pos:
            self.stream.accel.learn(self.stream, self.pos)
            return True
        return False

    def wait(self) -> None:
        """The host waits: afterwards it knows the stream got here."""
        self.stream.wait_for(self.pos)
        self.stream.accel.learn(self.stream, self.pos)

    def __repr__(self) -> str:
        return f"StandinEvent({self.stream.name}@{self.pos})"


__all__ = [
    "HISTORY",
    "Item",
    "StandinEvent",
    "StandinRaceError",
    "StandinStream",
    "StandinUseAfterFreeError",
    "byte_range",
    "nan_fill",
    "revive",
    "weak_view",
]
