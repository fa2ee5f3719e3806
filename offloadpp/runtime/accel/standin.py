"""A stand-in accelerator for tests: the GPU's asynchrony on the CPU.

Selected by OFFLOADPP_DEVICE=standin (select.py); every test, benchmark or script then runs the
runtime's copy path (`copies`), the lines a GPU runs, with the mistakes a GPU makes of a missing
wait made visible:

- device memory is its own: buffers from empty() are CPU tensors of their own (never a host
  buffer), within a capacity (OFFLOADPP_STANDIN_BYTES, else the plan's device budget set by the
  engine, else unlimited); past it empty() raises torch.OutOfMemoryError as CUDA does;
- fresh and freed buffers are filled with NaN (and the runtime's host buffer pools fill a
  buffer they make reusable with NaN: `poisons_host_reuse`); a freed buffer is reused only after every stream
  that used it (record_use) has passed the point of the free, as record_stream promises;
- each side stream is a worker thread running its queue in order, each item after a random delay
  (seeded: OFFLOADPP_STANDIN_SEED, printed), so a copy lands well after the call that queued it;
  an event is done only when its stream has got there;
- a queued copy holds its tensors' memory weakly, as a GPU does: memory nothing else holds (no
  record_use for the stream) may be gone when the stream gets there: a source gone gives NaN
  (on a GPU: whatever took its memory), a destination gone raises StandinUseAfterFreeError;
- compute is the calling thread: its work is done when the call returns, and the compute stream
  waiting on an event blocks the caller until the event is done; compute is modelled as lagging
  without bound instead: a copy on a side stream into (or out of) memory the compute stream
  used, without that stream having waited for compute since, raises StandinRaceError (on a GPU
  the copy would overtake kernels still queued), and compute's waits teach the host nothing
  (standin_stream.py, what the host knows);
- a collective (run_on) runs on the calling thread once its stream has got there (gloo is
  synchronous), but its result lands in stream order: the output reads NaN until the stream
  gets to the item that delivers it, as a collective kernel's output would.

Note: sites. OFFLOADPP_STANDIN_SKIP=<site> makes the stand-in skip that one wait or free, for
scripts/standin_mutations.py; the first skip of each stand-in appends the site to the file
OFFLOADPP_STANDIN_SKIP_LOG names, if any. A skipped free reclaims the buffer at once, ordered
after no stream (compute's use included); a skipped host wait is taken at its worst
(standin_stream.py); a pool's `after` whose site is skipped is done at once, as if the runtime
had given the buffer back without it; a skipped `holds_back` lets the copy be queued at once.
"""

from __future__ import annotations

import os
import random
import threading
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .base import Accelerator, Event, Stream
from .standin_stream import (
    Item,
    StandinEvent,
    StandinRaceError,
    StandinStream,
    StandinUseAfterFreeError,
    byte_range,
    nan_fill,
    revive,
    weak_view,
)

DEFAULT_SEED = 1234
DEFAULT_DELAY_MS = 2.0  # the most an item of a stream waits before it runs (uniform from 0)


class _Block:
    """A buffer of the stand-in's device memory."""

    def __init__(self, tensor: torch.Tensor, last_compute: int):
        self.numel, self.dtype = tensor.numel(), tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self.weak = StorageWeakRef(tensor.untyped_storage())
        self.ptr = tensor.untyped_storage().data_ptr()
        self.last_compute = last_compute  # compute epoch of its last use on the compute stream
        self.compute_kept = False  # that use was recorded (record_use): a reuse is ordered after it
        self.uses: set[StandinStream] = set()  # side streams that used it since it was handed out
        self.tensor: Optional[torch.Tensor] = None  # held by the stand-in once freed
        self.free_at: list[tuple[StandinStream, int]] = []
        self.gen = 0  # times handed out (a copy's destination is this allocation's, or gone)

    def live(self, gen: int) -> bool:
        return self.gen == gen and self.tensor is None and not self.weak.expired()


class StandinAccelerator(Accelerator):
    kind = "standin"
    plan_device = "cuda"  # (planned as a device with memory of its own behind a link)
    copies = True
    collective_backend = "gloo"
    poisons_host_reuse = True  # (base.py)

    def __init__(self, *, seed: Optional[int] = None, capacity_bytes: Optional[int] = None,
                 delay_ms: Optional[float] = None, skip: Optional[str] = None):  # fmt: skip
        env = os.environ
        self.seed = int(env.get("OFFLOADPP_STANDIN_SEED", DEFAULT_SEED)) if seed is None else seed
        self.delay_s = (float(env.get("OFFLOADPP_STANDIN_DELAY_MS", DEFAULT_DELAY_MS)) if delay_ms is None
                        else delay_ms) / 1e3  # fmt: skip
        cap = env.get("OFFLOADPP_STANDIN_BYTES") if capacity_bytes is None else capacity_bytes
        self.capacity_bytes: Optional[int] = int(cap) if cap is not None else None
        self.skip = env.get("OFFLOADPP_STANDIN_SKIP") if skip is None else skip
        self.skipped: dict[str, int] = {}  # site -> times skipped (the mutation script's proof)
        self.torch_device = torch.device("cpu")
        self.error: Optional[BaseException] = None
        self.epoch = 1  # compute's progress as the stand-in sees it: each compute use ticks it
        self._lock = threading.RLock()
        self._blocks: dict[int, _Block] = {}  # storage address -> block, live or freed
        self._cache: dict[tuple[int, torch.dtype], list[_Block]] = {}
        self._pending: list[_Block] = []  # freed, waiting for their streams
        self._bytes = 0
        self._peak = 0
        self._streams: list[StandinStream] = []
        self._compute = StandinStream(self, "compute", None)
        self._late: list[tuple[StandinStream, Item]] = []  # device-to-host writes landing late
        self._worst: set[tuple[int, int]] = set()  # (stream, event) skipped host waits taken at worst

    def describe(self) -> str:
        cap = (
            f"{self.capacity_bytes} bytes" if self.capacity_bytes is not None else "the plan's device budget"
        )
        skip = f" skip={self.skip}" if self.skip else ""
        return (
            f"offloadpp: device=standin seed={self.seed} delay_ms={self.delay_s * 1e3:g} capacity={cap}{skip}"
        )

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"stand-in device: work on a stream failed: {self.error!r}") from self.error

    def _skips(self, site: str) -> bool:
        if self.skip is not None and site == self.skip:
            self.skipped[site] = self.skipped.get(site, 0) + 1
            log = os.environ.get("OFFLOADPP_STANDIN_SKIP_LOG")
            if log and self.skipped[site] == 1:  # (the mutation script's proof that the site ran)
                with open(log, "a") as f:
                    f.write(f"{site}\n")
            return True
        return False

    def _tick(self) -> int:
        self.epoch += 1
        return self.epoch

    # ---- device memory ---------------------------------------------------------------------
    def set_capacity(self, nbytes: Optional[int]) -> None:
        """The plan's device budget as the capacity, unless OFFLOADPP_STANDIN_BYTES set one."""
        if self.capacity_bytes is None:
            self.capacity_bytes = nbytes

    def _reap(self) -> None:
        """Freed buffers whose streams have passed go to the cache (NaN); buffers the runtime
        dropped without free() (handed to autograd) leave the accounts."""
        still = []
        for b in self._pending:
            if all(s.completed >= pos for s, pos in b.free_at):
                self._to_cache(b)
            else:
                still.append(b)
        self._pending = still
        for ptr, b in list(self._blocks.items()):
            if b.tensor is None and b.weak.expired():
                del self._blocks[ptr]
                self._bytes -= b.nbytes

    def _to_cache(self, b: _Block) -> None:
        nan_fill(b.tensor)
        b.uses.clear()
        b.free_at = []
        self._cache.setdefault((b.numel, b.dtype), []).append(b)

    def empty(self, numel: int, dtype: torch.dtype, stream: Optional[Stream] = None) -> torch.Tensor:
        with self._lock:
            self._reap()
            # memory allocated for the compute stream was last used by compute (it may be reused
            # memory): a side stream writing it must wait for compute first
            last = self._tick() if stream is None or stream.is_compute else 0
            cached = self._cache.get((numel, dtype))
            if cached:
                b = cached.pop()
                t, b.tensor = b.tensor, None
                # Reused memory compute read: CUDA's allocator orders the reuse after that read
                # only if it was recorded (record_use); if not, a side stream writing it races.
                b.last_compute = last if b.compute_kept or last else b.last_compute
                b.compute_kept = False
                b.gen += 1
                if stream is not None and not stream.is_compute:
                    b.uses.add(stream)
                return t
            need = numel * dtype.itemsize
            if self.capacity_bytes is not None and self._bytes + need > self.capacity_bytes:
                for blocks in self._cache.values():  # (empty_cache, as CUDA's allocator does on a miss)
                    for b in blocks:
                        self._blocks.pop(b.ptr, None)
                        self._bytes -= b.nbytes
                self._cache.clear()
                if self._bytes + need > self.capacity_bytes and self._pending:
                    # (as CUDA's allocator does before giving up: waits for the streams holding
                    # freed memory, and takes it back)
                    for b in self._pending:
                        for st, pos in b.free_at:
                            st.wait_for(pos)
                    self._reap()
                    for blocks in self._cache.values():
                        for b in blocks:
                            self._blocks.pop(b.ptr, None)
                            self._bytes -= b.nbytes
                    self._cache.clear()
                if self._bytes + need > self.capacity_bytes:
                    raise torch.OutOfMemoryError(
                        f"stand-in device out of memory: tried to allocate {need} bytes with {self._bytes} in use "
                        f"of a capacity of {self.capacity_bytes} bytes (OFFLOADPP_STANDIN_BYTES, or the plan's "
                        "device budget)"
                    )
            t = torch.empty(numel, dtype=dtype)
            nan_fill(t)
            b = _Block(t, last)
            self._blocks[b.ptr] = b
            if stream is not None and not stream.is_compute:
                b.uses.add(stream)  # (its own stream: a free waits for it too)
            self._bytes += need
            self._peak = max(self._peak, self._bytes)
            return t

    def _block(self, t: torch.Tensor) -> Optional[_Block]:
        if t.device.type != "cpu":
            return None
        b = self._blocks.get(t.untyped_storage().data_ptr())
        return b if b is not None and (b.tensor is not None or not b.weak.expired()) else None

    def free(self, tensor: torch.Tensor, *, site: Optional[str] = None) -> None:
        with self._lock:
            b = self._block(tensor)
            if b is None or b.tensor is not None:
                raise RuntimeError(f"stand-in device: {site}: freeing a buffer it did not hand out, or twice")
            b.tensor = tensor
            if site is not None and self._skips(site):
                # reclaimed now, whatever the streams still do with it: compute's use too (the
                # reuse is not ordered after it)
                b.compute_kept = False
                self._to_cache(b)
                return
            b.free_at = [(s, s.queued) for s in b.uses]
            self._pending.append(b)
            self._reap()

    def record_use(self, tensor: torch.Tensor, stream: Stream, *, site: Optional[str] = None) -> None:
        with self._lock:
            b = self._block(tensor)  # (None: memory compute made, autograd's)
            if stream.is_compute:
                if b is not None:
                    b.last_compute = self._tick()  # (the stand-in sees compute's use either way)
                    b.compute_kept = not (site is not None and self._skips(site))
            elif not self._skips(site):
                stream.keep(tensor)
                if b is not None:
                    b.uses.add(stream)

    # ---- streams and events ----------------------------------------------------------------
    def new_stream(self) -> Stream:
        with self._lock:
            s = StandinStream(
                self, f"side{len(self._streams)}", random.Random(self.seed * 1000 + len(self._streams))
            )
            self._streams.append(s)
            return s

    def compute_stream(self) -> Stream:
        return self._compute

    def _check_order(self, stream: StandinStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._lock:
            bd, bs = self._block(dst), self._block(src)
            if bd is None:
                # device -> host: the source is device memory compute made (or used): the stream
                # must have waited for compute since compute last did anything the stand-in saw
                last = bs.last_compute if bs is not None else self.epoch
            else:
                last = max(bd.last_compute, bs.last_compute if bs is not None else 0)
            if last > stream.seen_compute:
                raise StandinRaceError(
                    f"stand-in device: a copy on {stream.name} touches device memory the compute stream used "
                    f"(epoch {last}) after the stream last waited for compute (epoch {stream.seen_compute}): on a "
                    "GPU it would overtake kernels still queued (a missing wait_stream)"
                )

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        self.check()
        if stream.is_compute:
            dst.copy_(src)
            return
        self._check_order(stream, dst, src)
        it = Item(lambda it: self._run_copy(it, stream))
        it.dst, it.src = weak_view(dst), weak_view(src)
        with self._lock:
            bd, bs = self._block(dst), self._block(src)
            it.to_host = bd is None
            if bd is None or bs is None:
                it.host = byte_range(dst if bd is None else src)
            if bd is not None:
                it.dev = (bd, bd.gen, self.epoch)
        stream.submit(it)

    def _run_copy(self, it: Item, stream: StandinStream) -> None:
        """A copy, on its stream's worker (the module Note; standin_stream.py for the flags)."""
        if it.host is not None:
            (a, b) = it.host  # late writes to its host memory land before it
            self._land(lambda _, late: late.host[0] < b and a < late.host[1])
        dst, src = revive(it.dst, stream.name, "destination"), revive(it.src, stream.name, "source")
        if src is None or it.poisoned:
            nan_fill(dst)  # its memory was freed, or reused: on a GPU, the copy reads someone else's bytes
        elif it.held:  # its destination was given back before the host knew: its bytes land late
            pass  # (_at_worst took them)
        else:
            dst.copy_(src)

    def run_on(self, stream: Stream, fn: Callable[[], None], *, out: torch.Tensor) -> None:
        # The collective runs on the caller once the stream has got to it (its inputs are in
        # place; one stream's items run on one thread, so collectives of two groups queued on it
        # from two threads could pair differently on two ranks), and its result lands in stream
        # order: `out` reads NaN until then.
        if stream.is_compute:
            fn()
            return
        if self._block(out) is not None:
            self._check_order(stream, out, out)
        stream.wait_for(stream.queued)
        fn()
        it = Item(self._deliver)
        it.data, it.dst = out.clone(), weak_view(out)
        with self._lock:
            b = self._block(out)
            if b is not None:
                it.dev = (b, b.gen, self.epoch)
        nan_fill(out)
        stream.submit(it)

    @staticmethod
    def _deliver(it: Item) -> None:
        dst = revive(it.dst, "a stream", "destination")
        if it.poisoned:
            nan_fill(dst)
        else:
            dst.copy_(it.data)
        it.data = None

    def record(self, stream: Stream) -> Event:
        if stream.is_compute:
            return StandinEvent(stream, 0)  # compute's work is done when its call returns
        with stream.cond:
            ev = StandinEvent(stream, stream.queued, stream.last_record)
            stream.last_record = stream.queued
        return ev

    def wait_event(self, stream: Stream, event: Event, *, site: str) -> None:
        self.check()
        if self._skips(site):
            return
        if stream.is_compute:
            # compute is this thread: what it issues next comes after the event (the host
            # learns nothing: on a GPU it would not have waited)
            event.stream.wait_for(event.pos)
            with self._lock:
                self._tick()
        else:
            src, pos = event.stream, event.pos
            stream.submit(Item(lambda _: src.wait_for(pos)))
            if src.is_compute:
                stream.seen_compute = max(stream.seen_compute, self.epoch)

    def wait_stream(self, stream: Stream, other: Stream, *, site: str) -> None:
        self.check()
        if self._skips(site):
            return
        if other.is_compute:
            if not stream.is_compute:  # compute's work so far is done: the stream is after it
                stream.seen_compute = self.epoch
            return
        self.wait_event(stream, self.record(other), site=site)

    def synchronize(self, event: Event, *, site: str) -> None:
        self.check()
        if self._skips(site):
            self._at_worst(event)
            return
        event.wait()

    def holds_back(self, *, site: str) -> bool:
        return not self._skips(site)

    def query(self, event: Event, *, site: str) -> bool:
        if self._skips(site):
            self._at_worst(event)
            return True
        return event.done()

    # ---- what the host knows (standin_stream.py, the module Note) ----------------------------
    def learn(self, stream: StandinStream, pos: int) -> None:
        """The host knows `stream` got to `pos`: device-to-host writes held till then land."""
        if pos > stream.known:
            stream.known = pos
            self._land(lambda s, late: s is stream and late.pos <= pos)

    def _land(self, which: Callable[[StandinStream, Item], bool]) -> None:
        with self._lock:
            landing = [it for s, it in self._late if which(s, it)]
            if not landing:
                return
            self._late = [(s, it) for s, it in self._late if not which(s, it)]
            for it in landing:
                dst = revive(it.dst, "a stream", "late write")
                if dst is not None:
                    dst.copy_(it.data)

    def _at_worst(self, event: Event) -> None:
        """A host wait skipped on a point the host does not know: its group's copies may run
        after the host reuses their host memory (standin_stream.py)."""
        s = event.stream
        if s.is_compute or s.known >= event.pos or (id(s), event.pos) in self._worst:
            return
        self._worst.add((id(s), event.pos))
        with s.cond:
            items = s.group(event.start, event.pos)
            for it in items:
                if it.host is not None and it.to_host and not it.ran:
                    it.held = True
                elif it.dev is not None and not it.ran:
                    it.poisoned = True
        for it in items:
            if it.host is not None and it.to_host:  # its bytes land late, whether it ran or not
                data = revive(it.dst, s.name, "late write") if it.ran else revive(it.src, s.name, "source")
                if data is not None:
                    it.data = data.clone()
                    with self._lock:
                        self._late.append((s, it))
            elif it.ran and it.dev is not None:  # it delivered already: what it read may be the next owner's
                b, gen, epoch = it.dev
                with self._lock:
                    if not b.live(gen):
                        continue  # (its destination is gone: nothing reads what it delivered)
                    if b.last_compute > epoch:  # and compute has read that since: too late for NaN
                        self.error = self.error or StandinRaceError(
                            f"stand-in device: a host wait was left out ({event!r}): the host gave back memory a "
                            f"copy on {s.name} reads before it knew the copy done, and compute has read the copy's "
                            "destination since (on a GPU, possibly the next owner's bytes)"
                        )
                    else:
                        nan_fill(revive(it.dst, s.name, "destination"))

    # ---- the device as a whole -------------------------------------------------------------
    def synchronize_device(self) -> None:
        for s in self._streams:
            pos = s.queued
            s.wait_for(pos)
            self.learn(s, pos)

    def memory_info(self) -> tuple[int, int]:
        import psutil

        with self._lock:
            self._reap()
            total = (
                self.capacity_bytes if self.capacity_bytes is not None else int(psutil.virtual_memory().total)
            )
            return max(0, total - self._bytes), total

    def memory_allocated(self) -> int:
        with self._lock:
            self._reap()
            return self._bytes - sum(b.nbytes for bs in self._cache.values() for b in bs)

    def max_memory_allocated(self) -> int:
        return self._peak

    def reset_peak_memory(self) -> None:
        with self._lock:
            self._peak = self._bytes

    def close(self) -> None:
        for s in self._streams:
            s.stop()
        self._streams = []


__all__ = ["DEFAULT_SEED", "StandinAccelerator", "StandinRaceError", "StandinUseAfterFreeError"]
