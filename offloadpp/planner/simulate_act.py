"""The replay of activation swapping and recomputation (runtime/activations.py, act_swap.py).

Pure (no torch). Per unit, the policy says what happens to what its forward saves for backward:
  keep       nothing moves.
  host       forward: a swap-out job copies the bytes to host memory (on the CPU device a memmove
             on the activation worker's thread; on CUDA a device->host copy); backward: they are
             handed back (CPU: no copy; CUDA: a host->device copy).
  ssd        as host, then the worker writes them to SSD; backward reads them back ahead of use.
  recompute  nothing is saved: backward runs the unit's forward again first.
Backward fetches the activations of the unit it reaches and of the next `prefetch_units` units
(in backward order). A fetch finds a swap-out job still queued: it is cancelled (the bytes never
left). Still copying: ready when the copy ends. Still in host memory (host policy, or an SSD write
not yet finished): ready at once. On SSD: a read, queued behind whatever the SSD is doing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping, Optional

from .desim import When, done_by, when

if TYPE_CHECKING:
    from .simulate import Sim

POLICIES = ("keep", "host", "ssd", "recompute")


@dataclass(eq=False)
class _Out:
    unit: str
    nbytes: int
    to_ssd: bool
    started: bool = False
    cancelled: bool = False
    copy_done: Optional[float] = None
    write_done: When = None


class ActReplay:
    def __init__(
        self, sim: Sim, policies: Mapping[str, str], act_bytes: Mapping[str, int], prefetch_units: int
    ):
        bad = {u: p for u, p in policies.items() if p not in POLICIES}
        if bad:
            raise ValueError(f"activation policies must be one of {POLICIES}, got {bad}")
        self.sim = sim
        self.policies = dict(policies)
        self.act_bytes = dict(act_bytes)
        self.prefetch = prefetch_units
        self.backward_order = [v.unit for v in sim.sched.visits if v.backward]
        self.queue: deque[_Out] = deque()
        self.out: dict[str, _Out] = {}
        self.ready: dict[str, tuple[When, bool]] = {}  # unit -> (its read or time, a h2d copy to follow)
        self.swapped_bytes = 0

    def policy(self, unit: str) -> str:
        return self.policies.get(unit, "keep")

    @property
    def active(self) -> bool:
        return any(p != "keep" for p in self.policies.values())

    def recompute_s(self, unit: str) -> float:
        if self.policy(unit) != "recompute":
            return 0.0
        return self.sim.costs.forward_s[unit] + self.sim.costs.forward_visit_s

    # ---- forward -------------------------------------------------------------------------
    def after_forward(self, unit: str) -> None:
        pol = self.policy(unit)
        n = self.act_bytes.get(unit, 0)
        if pol in ("host", "ssd") and n > 0:
            job = _Out(unit, n, pol == "ssd")
            self.out[unit] = job
            self.queue.append(job)
            self.ready.pop(unit, None)

    # ---- backward ------------------------------------------------------------------------
    def before_backward(self, unit: str) -> Iterator:
        """At the unit's backward visit: fetch it and the next units', then wait for its own."""
        i = self.backward_order.index(unit)
        for name in self.backward_order[i : i + self.prefetch + 1]:
            self._fetch(name)
        r = self.ready.get(unit)
        if r is None and unit in self.out:  # fetched while its copy was running: ready when it ends
            yield ("cond", lambda: self.out[unit].copy_done is not None)
            self._fetch(unit)
            r = self.ready.get(unit)
        if r is not None:
            got, h2d = r
            if not done_by((got,), self.sim.t):
                yield ("wait", (got,))
            if h2d:  # CUDA: copied up once the bytes are in host memory (the read's end)
                t = self.sim.h2d.submit(when(got), self.act_bytes[unit], write=False)
                if t > self.sim.t:
                    yield ("until", t)
        self.out.pop(unit, None)
        self.ready.pop(unit, None)

    def _fetch(self, unit: str) -> None:
        job = self.out.get(unit)
        if job is None or unit in self.ready:
            return
        sim = self.sim
        if not job.started:  # never left: the bytes are still on the device
            job.cancelled = True
            self.queue = deque(j for j in self.queue if j is not job)
            self.ready[unit] = (sim.t, False)
            return
        if job.copy_done is None:  # copying now: continued when the copy ends (before_backward)
            return
        on_ssd = job.to_ssd and job.write_done is not None and done_by((job.write_done,), sim.t)
        if on_ssd:
            done: When = sim.ssd.submit(sim.t, job.nbytes, write=False, key=f"act.{unit}")
        else:
            done = sim.t
        self.ready[unit] = (done, sim.cuda)

    # ---- the activation worker -------------------------------------------------------------
    def worker(self) -> Iterator:
        sim = self.sim
        while True:
            if not self.queue:
                yield ("cond", lambda: bool(self.queue) or sim.closed)
                if not self.queue:
                    return
            job = self.queue.popleft()
            job.started = True
            if sim.cuda:
                done = sim.d2h.submit(sim.t, job.nbytes, write=False)
                if done > sim.t:
                    yield ("until", done)
            else:
                yield ("cpu", job.nbytes / sim.costs.memcpy_bps)
            self.swapped_bytes += job.nbytes
            if job.to_ssd:
                job.write_done = sim.ssd.submit(sim.t, job.nbytes, write=True, key=f"act.{job.unit}")
            job.copy_done = sim.t


__all__ = ["ActReplay", "POLICIES"]
