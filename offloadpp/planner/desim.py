"""The discrete-event kernel of the cost model's replay (simulate.py): the SSD as the I/O engine
serves it (reads before queued writes), FIFO servers for the link, the runtime's buffer pool with
times instead of buffers; desim_loop.run runs the replay's threads (generators) on shared cores
with them (the requests, events and CPU sharing below are its).

Pure (no torch).

Note: the requests a thread yields.
  ("cpu", seconds)   work on the cores; how fast it advances depends on who else works (below).
  ("until", t)       wait for a known time (an I/O completion).
  ("cond", fn)       wait until fn() is true (a job done, a queue not empty).
  ("idle", q, sim)   a worker with nothing to do: wait until q.queue is not empty or sim.closed
                     (a "cond" the loop checks without a call: idle workers are checked at
                     every pass).
  ("wait", items)    wait until every item is done: times, and SSD requests' Done (whose time is
                     known only once the SSD has served them: a later read can delay a write).
Events: the loop moves its clock to the next time a thread can go on (its CPU work done, the
time it waits for, the last of the requests it waits for) or the SSD's state matters: where a
thread waits for an SSD request not served yet, and where the SSD's work slows compute (the CPU
device, below). Elsewhere a request the SSD finishes is served when the clock passes it
(Ssd.advance serves each at its own time; a submit serves all before it): a "cond" never reads
the SSD's state, only what the threads set.
CPU sharing: the main thread's work is the device's compute; the helpers' (the optimizer's
worker, the activation mover) is memory-bound CPU work. On the CPU acting as the device, while
compute and helpers work at once, compute advances at 1/compute_slowdown and the helpers share
1/helper_slowdown (the measured pairwise contention; two helpers split what one would get).
Without compute, helpers run at full speed. While the SSD serves a request, compute advances
a further 1/io_slowdown (the I/O thread and the kernel's block layer take their share of the
cores). On a GPU all these factors are 1.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator, Optional, Protocol, Union


class Replay(Protocol):
    """What the resources here read of the replay that runs them (simulate.Sim is the one): its
    clock, its SSD and the counters they add to."""

    t: float
    ssd: Ssd
    pool_wait_s: float
    compute_busy_s: float


class Done:
    """When an SSD request finishes: `t` is None until the SSD has served it. Also the request
    itself, as the SSD holds it (Ssd.submit: one object a request, thousands a replay): its
    bytes, those left to serve, its direction and the write it is issued after."""

    __slots__ = ("t", "nbytes", "left", "write", "after")

    def __init__(self, t: Optional[float] = None, nbytes: int = 0, write: bool = False,
                 after: Optional[Done] = None):  # fmt: skip
        self.t, self.nbytes, self.left, self.write, self.after = t, nbytes, float(nbytes), write, after


# What a step of the replay that may wait returns for `yield from`: NOTHING (nothing to wait
# for, done at once), a tuple of requests, or a generator (simulate_units.py, Pool.get)
NOTHING: tuple = ()
When = Union[float, Done, None]  # a time, a request's completion, or nothing to wait for
INF = float("inf")


def when(x: When) -> float:
    """The time `x` is done at: inf while an SSD request is not served yet; 0 for nothing."""
    if x is None:
        return 0.0
    if x.__class__ is Done:
        return INF if x.t is None else x.t
    return x


def done_by(items: Iterable[When], t: float) -> bool:
    # (the replay's innermost test: a plain loop, no generator)
    for x in items:
        if x is None:
            continue
        if x.__class__ is Done:
            if x.t is None or x.t > t:
                return False
        elif x > t:
            return False
    return True


class _Tally:
    """The bytes a server moved: per direction, per key in both directions, and per (key,
    write?) (the step's bytes by kind, planner/traffic.py)."""

    def __init__(self) -> None:
        self.read_bytes = 0
        self.write_bytes = 0
        self.busy_s = 0.0
        self.by_key_dir: dict[tuple[str, bool], int] = {}
        # whether by_key_dir counts what moves now (the replay counts the bytes per key of its
        # last step only, the one it reports: a tuple and a dict update per request saved)
        self.keyed = True

    @property
    def by_key(self) -> dict[str, int]:
        """Bytes per key, both directions (in the order the keys first moved)."""
        out: dict[str, int] = {}
        for (key, _), n in self.by_key_dir.items():
            out[key] = out.get(key, 0) + n
        return out

    def _count(self, nbytes: int, write: bool, key: str) -> None:
        if write:
            self.write_bytes += nbytes
        else:
            self.read_bytes += nbytes
        if key and self.keyed:
            k = (key, write)
            self.by_key_dir[k] = self.by_key_dir.get(k, 0) + nbytes


class Ssd(_Tally):
    """The SSD as io/engine serves it: one device bandwidth, requests in two queues, and each
    free block slot goes to the oldest queued read before any queued write. A read that arrives
    while a write is served waits only for the write's blocks already in flight
    (`inflight_bytes`: block size x queue depth), then the write resumes behind the reads.
    A request that finds the device idle also pays its round trip (`latency_s`).

    Note: why not a FIFO. With reads first, the completion time of a write depends on reads
    submitted after it (the optimizer's next state reads, the next forward's fetches), so it is
    known only when the replay reaches it: submit() returns a Done, the replay's loop (run)
    calls advance() as its clock moves and wakes whoever waits on it."""

    def __init__(
        self, read_bps: float, write_bps: float, latency_s: float = 0.0, inflight_bytes: int = 8 << 20
    ):
        self.read_bps, self.write_bps, self.latency_s = read_bps, write_bps, latency_s
        self.inflight_bytes = inflight_bytes
        self.reads: deque[Done] = deque()
        self.writes: deque[Done] = deque()
        self.held: list[Done] = []  # reads issued once their key's write is done
        self.cur: Optional[Done] = None
        self.cur_start = self.cur_end = self.cur_lat = 0.0
        super().__init__()

    @property
    def busy(self) -> bool:
        return self.cur is not None

    def next_event(self) -> float:
        return self.cur_end if self.cur is not None else INF

    def submit(self, t: float, nbytes: int, write: bool, key: str = "", after: Optional[Done] = None) -> Done:
        """Queues a request at `t` (the replay's now); with `after` (a write's Done) it is queued
        once that is done, as slots._ReadAfterWrite issues a read of a key whose write drains."""
        if self.cur is not None and self.cur_end <= t:
            self.advance(t)
        if write:  # (_count, inline: a replay submits thousands)
            self.write_bytes += nbytes
        else:
            self.read_bytes += nbytes
        if key and self.keyed:
            k = (key, write)
            self.by_key_dir[k] = self.by_key_dir.get(k, 0) + nbytes
        req = Done(None, nbytes, write, after)
        if after is not None and (after.t is None or after.t > t):  # (when(after) > t)
            self.held.append(req)
            return req
        # (_queue and _start, inline: the replay's most frequent request)
        cur = self.cur
        if cur is None:
            self.cur, self.cur_start = req, t
            self.cur_lat = lat = self.latency_s
            self.cur_end = t + lat + req.left / (self.write_bps if write else self.read_bps)
        else:
            (self.writes if write else self.reads).append(req)
            if not write and cur.write:
                # the next free block slot goes to the read: the write keeps its blocks in flight
                start = self.cur_start + self.cur_lat
                cut = (t if t > start else start) + self.inflight_bytes / self.write_bps
                if cut < self.cur_end:
                    self.cur_end = cut
        return req

    def advance(self, t: float) -> None:
        """Serves everything that ends by `t`."""
        cur = self.cur
        while cur is not None and self.cur_end <= t:
            end, start = self.cur_end, self.cur_start
            self.busy_s += end - start
            served = end - start - self.cur_lat
            cur.left -= (served if served > 0.0 else 0.0) * (self.write_bps if cur.write else self.read_bps)
            self.cur = None
            if cur.left > 0.5:  # a write that let reads pass: it goes on first among the writes
                self.writes.appendleft(cur)
            else:
                cur.t = end
                held = self.held
                if held:  # (reads held for a write: each `after` is that write's Done)
                    go = [r for r in held if r.after.t is not None and r.after.t <= end]
                    if go:
                        self.held = [r for r in held if r.after.t is None or r.after.t > end]
                        for r in go:
                            self._queue(r, end, idle=False)
            if self.cur is None:  # (_start, inline)
                q = self.reads or self.writes
                if q:
                    nxt = q.popleft()
                    self.cur, self.cur_start, self.cur_lat = nxt, end, 0.0
                    self.cur_end = end + nxt.left / (self.write_bps if nxt.write else self.read_bps)
            cur = self.cur

    def _queue(self, req: Done, t: float, idle: bool) -> None:
        (self.writes if req.write else self.reads).append(req)
        if self.cur is None:
            self._start(t, idle)
        elif not req.write and self.cur.write:
            # the next free block slot goes to the read: the write keeps its blocks in flight
            cut = max(t, self.cur_start + self.cur_lat) + self.inflight_bytes / self.write_bps
            self.cur_end = min(self.cur_end, cut)

    def _start(self, t: float, idle: bool) -> None:
        q = self.reads or self.writes
        if self.cur is not None or not q:
            return
        req = q.popleft()
        self.cur, self.cur_start = req, t
        self.cur_lat = self.latency_s if idle else 0.0
        self.cur_end = t + self.cur_lat + req.left / (self.write_bps if req.write else self.read_bps)


class Fifo(_Tally):
    """A FIFO server: each request takes bytes / rate after the previous one ends, plus the
    device's round-trip latency when it arrives at an idle device."""

    def __init__(self, read_bps: float, write_bps: float, latency_s: float = 0.0):
        self.read_bps, self.write_bps, self.latency_s = read_bps, write_bps, latency_s
        self.free_t = 0.0
        super().__init__()

    def submit(self, t: float, nbytes: int, write: bool, key: str = "") -> float:
        # The round trip of a request is exposed only when it finds the device idle; queued
        # behind others it is overlapped with their transfers (the engine keeps several blocks
        # in flight).
        dur = nbytes / (self.write_bps if write else self.read_bps)
        if t >= self.free_t:
            dur += self.latency_s
        start = self.free_t if self.free_t > t else t
        self.free_t = start + dur
        self.busy_s += dur
        if write:  # (_count, inline: the link's copies are most of a replay's requests)
            self.write_bytes += nbytes
        else:
            self.read_bytes += nbytes
        if key and self.keyed:
            k = (key, write)
            self.by_key_dir[k] = self.by_key_dir.get(k, 0) + nbytes
        return self.free_t


class Pool:
    """runtime/memory.py's BufferPool, with times instead of buffers (main thread only). Where
    the runtime's pool would raise (nothing pending and still over budget) this one allocates:
    the replay scores plans, and an infeasible one shows up in its peaks."""

    def __init__(self, budget: int):
        self.budget = budget
        self.allocated = 0
        self.peak = 0
        self.free: dict[int, int] = {}
        self.pending: deque[tuple[int, tuple[When, ...]]] = deque()  # (bytes, done when all are)

    def get(self, sim: Replay, n: int) -> Iterable:
        """A buffer of `n` bytes, as `yield from pool.get(sim, n)`: where none needs waiting for
        (the common case) it is taken at once and nothing is yielded (an empty tuple: the replay
        makes no generator for it), else the rest is a generator that waits (_get_waiting)."""
        pending = self.pending
        free = self.free
        if pending:
            t = sim.t
            while pending:
                for x in pending[0][1]:  # (done_by, inline)
                    if x is None:
                        continue
                    if x.__class__ is Done:
                        x = x.t
                        if x is None:
                            break
                    if x > t:
                        break
                else:
                    m = pending.popleft()[0]  # (_add_free, inline)
                    free[m] = free.get(m, 0) + 1
                    continue
                break
        c = free.get(n)
        if c:
            free[n] = c - 1
            return NOTHING
        if free:
            self._trim(n)
        while self.allocated + n > self.budget and pending:
            if not done_by(pending[0][1], sim.t):
                return self._get_waiting(sim, n)
            self._add_free(pending.popleft()[0])
            if self.free.get(n):
                self.free[n] -= 1
                return NOTHING
            self._trim(n)
        self.allocated += n
        if self.allocated > self.peak:
            self.peak = self.allocated
        return NOTHING

    def _get_waiting(self, sim: Replay, n: int) -> Iterator:
        while self.allocated + n > self.budget and self.pending:
            m, ready = self.pending.popleft()
            if not done_by(ready, sim.t):
                t0 = sim.t
                yield ("wait", ready)
                sim.pool_wait_s += sim.t - t0
            self._add_free(m)
            if self.free.get(n):
                self.free[n] -= 1
                return
            self._trim(n)
        self.allocated += n
        if self.allocated > self.peak:
            self.peak = self.allocated

    def put(self, n: int, *ready: When) -> None:
        self.pending.append((n, ready))

    def _add_free(self, n: int) -> None:
        self.free[n] = self.free.get(n, 0) + 1

    def _trim(self, need: int) -> None:
        # (free buffers of each size, oldest size first, until `need` fits; sizes left with
        # none are dropped: the order of the rest is the order they are trimmed in next time)
        free, budget = self.free, self.budget
        alloc = self.allocated
        if alloc + need <= budget:  # (nothing to free: only the sizes left with none dropped)
            if 0 in free.values():
                for k in [k for k, c in free.items() if not c]:
                    del free[k]
            return
        for k, c in list(free.items()):
            if c and alloc + need > budget:
                while c and alloc + need > budget:
                    c -= 1
                    alloc -= k
                free[k] = c
            if not c:
                del free[k]
        self.allocated = alloc


__all__ = ["INF", "NOTHING", "Done", "Fifo", "Pool", "Ssd", "When", "done_by", "when"]
