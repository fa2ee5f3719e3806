"""The discrete-event kernel of the cost model's replay (simulate.py): FIFO servers for the SSD
and the link, the runtime's buffer pool with times instead of buffers, and the loop that runs the
replay's threads (generators) on shared cores.

Pure (no torch).

Note: the requests a thread yields.
  ("cpu", seconds)   work on the cores; how fast it advances depends on who else works (below).
  ("until", t)       wait for a known time (an I/O completion).
  ("cond", fn)       wait until fn() is true (a job done, a queue not empty).
CPU sharing: the main thread's work is the device's compute; the helpers' (the optimizer's
worker, the activation mover) is memory-bound CPU work. On the CPU acting as the device, while
compute and helpers work at once, compute advances at 1/compute_slowdown and the helpers share
1/helper_slowdown (the measured pairwise contention; two helpers split what one would get).
Without compute, helpers run at full speed. On a GPU both factors are 1.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from .simulate import Sim


class Fifo:
    """A FIFO server: each request takes bytes / rate after the previous one ends, plus the
    device's round-trip latency when it arrives at an idle device."""

    def __init__(self, read_bps: float, write_bps: float, latency_s: float = 0.0):
        self.read_bps, self.write_bps, self.latency_s = read_bps, write_bps, latency_s
        self.free_t = 0.0
        self.read_bytes = 0
        self.write_bytes = 0
        self.busy_s = 0.0
        self.by_key: dict[str, int] = {}  # bytes moved per key (both directions)

    def submit(self, t: float, nbytes: int, write: bool, key: str = "") -> float:
        # The round trip of a request is exposed only when it finds the device idle; queued
        # behind others it is overlapped with their transfers (the engine keeps several blocks
        # in flight).
        dur = nbytes / (self.write_bps if write else self.read_bps)
        if t >= self.free_t:
            dur += self.latency_s
        start = max(t, self.free_t)
        self.free_t = start + dur
        self.busy_s += dur
        if write:
            self.write_bytes += nbytes
        else:
            self.read_bytes += nbytes
        if key:
            self.by_key[key] = self.by_key.get(key, 0) + nbytes
        return self.free_t


class Pool:
    """runtime/memory.py's BufferPool, with times instead of buffers (main thread only)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.allocated = 0
        self.peak = 0
        self.free: dict[int, int] = {}
        self.pending: deque[tuple[int, float]] = deque()

    def get(self, sim: Sim, n: int) -> Iterator:
        while self.pending and self.pending[0][1] <= sim.t:
            self._add_free(self.pending.popleft()[0])
        if self.free.get(n):
            self.free[n] -= 1
            return
        self._trim(n)
        while self.allocated + n > self.budget and self.pending:
            m, ready = self.pending.popleft()
            if ready > sim.t:
                sim.pool_wait_s += ready - sim.t
                yield ("until", ready)
            self._add_free(m)
            if self.free.get(n):
                self.free[n] -= 1
                return
            self._trim(n)
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def put(self, n: int, ready: float) -> None:
        self.pending.append((n, ready))

    def _add_free(self, n: int) -> None:
        self.free[n] = self.free.get(n, 0) + 1

    def _trim(self, need: int) -> None:
        for k in list(self.free):
            while self.free[k] and self.allocated + need > self.budget:
                self.free[k] -= 1
                self.allocated -= k
            if not self.free[k]:
                del self.free[k]


def run(sim: Sim, main: Iterator, helpers: Sequence[Iterator], *, compute_slowdown: float,
        helper_slowdown: float) -> None:  # fmt: skip
    """Runs `main` and the `helpers` together until `main` is done."""
    procs: list[list] = [[g, None, 0.0] for g in (main, *helpers)]  # [generator, request, remaining cpu work]

    def resume(p: list) -> None:
        try:
            req = next(p[0])
        except StopIteration:
            p[1] = ("done",)
            return
        p[1] = req
        p[2] = req[1] if req[0] == "cpu" else 0.0

    for p in procs:
        resume(p)
    first = procs[0]
    guard = 0
    while first[1][0] != "done":
        guard += 1
        if guard > 10_000_000:
            raise RuntimeError("cost model replay did not finish (internal error)")
        progressed = False
        for p in procs:  # requests that are already satisfied resume at once
            req = p[1]
            if (
                (req[0] == "cond" and req[1]())
                or (req[0] == "until" and req[1] <= sim.t)
                or (req[0] == "cpu" and p[2] <= 1e-12)
            ):
                resume(p)
                progressed = True
        if progressed:
            continue
        computing = first[1][0] == "cpu"
        busy_helpers = sum(1 for p in procs[1:] if p[1][0] == "cpu")
        rates = [1.0 / compute_slowdown if computing and busy_helpers else 1.0]
        helper_rate = 1.0 / (helper_slowdown * busy_helpers) if computing and busy_helpers else 1.0
        rates += [helper_rate] * (len(procs) - 1)
        nxt, first_done = float("inf"), None
        for p, r in zip(procs, rates):
            if p[1][0] == "cpu" and sim.t + p[2] / r < nxt:
                nxt, first_done = sim.t + p[2] / r, p
            elif p[1][0] == "until" and p[1][1] < nxt:
                nxt, first_done = p[1][1], None
        if nxt == float("inf"):
            waits = ", ".join(p[1][0] for p in procs)
            raise RuntimeError(f"cost model replay deadlocked (internal error): threads wait on {waits}")
        dt = nxt - sim.t
        for p, r in zip(procs, rates):
            if p[1][0] == "cpu":
                p[2] = max(0.0, p[2] - dt * r)
        if first_done is not None:
            first_done[2] = 0.0  # exactly done, whatever the rounding of t + work / rate
        if computing:
            sim.compute_busy_s += dt
        sim.t = nxt


__all__ = ["Fifo", "Pool", "run"]
