"""The replay's units over data-parallel ranks (runtime/dp/sharded.py's, with times for buffers).

Pure (no torch). One rank is replayed (every rank runs the same plan at the same time): its
shards of master, moments and compute copy are read and written as on one rank, at shard size;
a fetch reads the shard, then gathers the whole unit over the link (the `net` FIFO, at the
ranks' bus bandwidth, ranks.RankLink); the boundary's gradients are reduce-scattered on the
worker before the shard's Adam, and a unit resident on the device is gathered again after it.
"""

from __future__ import annotations

from typing import Iterator

from .desim import done_by
from .plan import DTYPE_BYTES, Plan, Tier

EMPTY, LOADING, READY = 0, 1, 2
COMPUTE, OPTIM = "compute", "optim"


class GatherWeights:
    """A unit's whole weights in device memory, gathered from every rank's shard."""

    def __init__(self, unit, source, full_bytes: int, gather_bytes: float, resident: bool):
        self.unit, self.source = unit, source
        self.full_bytes, self.gather_bytes = full_bytes, gather_bytes
        self.resident = resident
        self.state = READY if resident else EMPTY
        self.started = resident
        self.copy_done = 0.0

    def acquire(self, sim) -> Iterator:
        if self.state != EMPTY:
            return
        yield from self.source.acquire(sim, COMPUTE)
        if not sim.cuda:
            yield from sim.device_pool.get(sim, self.full_bytes)
        self.started = False
        self.state = LOADING
        self.pump(sim)

    def pump(self, sim) -> None:
        """The gather starts once the shard is read (the runtime's fetch channel)."""
        if self.state == LOADING and not self.started:
            s = self.source
            if s.state != LOADING or done_by((s.read_done,), sim.t):
                s.state = READY if s.state == LOADING else s.state
                self.copy_done = sim.net.submit(sim.t, self.gather_bytes, False)
                self.started = True
                s.release(sim, COMPUTE, after=self.copy_done)

    @property
    def uncopied(self) -> bool:
        """Its shard fetched, the gather not started: a pump may start it."""
        return self.state == LOADING and not self.started

    def wait(self, sim) -> Iterator:
        if self.state == LOADING:
            if not self.started:
                yield from self.source.wait(sim)
                self.pump(sim)
            self.state = READY
        if self.copy_done > sim.t:
            yield ("until", self.copy_done)

    def release(self, sim) -> None:
        if self.resident or self.state == EMPTY:
            return
        if not self.started:
            self.source.release(sim, COMPUTE)
        if not sim.cuda:
            sim.device_pool.put(self.full_bytes, self.copy_done)
        self.state = EMPTY


def dp_unit(unit_cls, sim, spec, placement, plan: Plan):
    """simulate_units.Unit laid out as one rank's shards (`unit_cls` is simulate_units.Unit)."""
    u = unit_cls.__new__(unit_cls)
    cdt = DTYPE_BYTES[plan.compute_dtype]
    s_n, f_n = spec.shard_numel, spec.padded_numel
    u.name, u.numel, u.padded = spec.name, spec.numel, f_n
    u.adam_numel = spec.numel / plan.ranks  # this rank's part of the parameters (on average)
    u.compute_bytes = f_n * cdt
    homes = plan.homes(spec, placement)
    slot = unit_cls.slot_for(sim, spec, homes)
    u.master = slot("master", s_n * 4, sim.host_pool)
    u.compute = u.master if not plan.separate_weights else slot("weights", s_n * cdt, sim.host_pool)
    u.exp_avg = slot("exp_avg", s_n * 4, sim.host_pool)
    u.exp_avg_sq = slot("exp_avg_sq", s_n * 4, sim.host_pool)
    u.accum = slot("grads", f_n * 4, sim.host_pool)
    u.grads = slot("grad_shard", s_n * 4, sim.host_pool)
    u.grads_persist = plan.persistent_grads
    u.accum_persist = plan.accumulate_grads
    resident = placement.weights is Tier.DEVICE
    u.weights = GatherWeights(u, u.compute, f_n * cdt, sim.link.ring_bytes(f_n * cdt), resident)
    if resident:
        if sim.cuda:
            sim.resident_device_bytes += f_n * cdt
        else:
            sim.device_pool.allocated += f_n * cdt
            sim.device_pool.peak = max(sim.device_pool.peak, sim.device_pool.allocated)
    u.reduce_bytes = sim.link.ring_bytes(f_n * 4)
    u.bound = False
    u.phase = "idle"
    u.can_speculate = u.speculated = False  # several ranks never speculate (planner/resolve.py)
    u.pending = False  # (several ranks never defer to the next visit: decide.lazy_applies)
    return u


def dp_grads(sim, job, u, idx: int, rate: float) -> Iterator:
    """ShardedOptimizerPipeline.on_grads: the whole gradients absorbed into `accum`; at the
    boundary reduce-scattered into the shard, then the shard's update (or, deferred, kept)."""
    yield from u.accum.acquire(sim, OPTIM, overwrite=sim.first_micro or not u.accum_persist)
    if sim.cuda:
        grad_bytes = u.numel * DTYPE_BYTES[sim.plan.compute_dtype]
        yield from sim.host_pool.get(sim, grad_bytes)
        job.grads_ready = sim.d2h.submit(sim.t, grad_bytes, False)
        sim.host_pool.put(grad_bytes, job.grads_ready)
    job.before.append(job.grads_ready)
    job.absorb_s = 2 * u.numel * 4 / sim.costs.memcpy_bps
    sim.add_before(job, u.accum)
    if sim.boundary:
        job.comm_bytes = u.reduce_bytes
        yield from u.grads.acquire(sim, OPTIM, overwrite=True)
        if sim.deferred:
            job.absorb_s += u.adam_numel * 4 / sim.costs.memcpy_bps  # the shard's squared norm
        if not sim.deferred:
            yield from sim.advance_update(idx + 1)
            yield from sim.fill_update(job, u, rate)
            sim.submitted += 1
            yield from sim.advance_update(sim.submitted + sim.optim_prefetch_depth + 1)
        elif sim.update_index[u.name] < sim.update_cursor:
            job.keep_grads = True
        elif u.grads.stored:
            job.writes.append(u.grads)
    elif u.accum_persist and u.accum.stored:
        job.writes.append(u.accum)
    sim.submit(job)
    sim.absorbed += 1
    yield from sim.advance_absorb(sim.absorbed + sim.optim_prefetch_depth + 1)


__all__ = ["GatherWeights", "dp_grads", "dp_unit"]
