"""The replay of deferred updates applied at the unit's next visit (runtime/pending.py), for
simulate.Sim: step() leaves every unit's update pending; the next forward's fetch of a unit hands
its update to the worker (its moments and gradients read in a window of q+1 units in forward
order, its master with the weights where they are one buffer), and the visit waits for it.
Pure (no torch)."""

from __future__ import annotations

from typing import Iterator

from .simulate_units import OPTIM, Job


def defer(sim) -> None:
    """step(): every unit's update pending (a unit without gradients has none: all get them here)."""
    sim.lazy_cursor = sim.lazy_submitted = 0
    for u in sim.lazy_order:
        u.pending = True
        u.compute.updating = True  # (no device copy of its weights until the update made them)
        # the replay is of a steady step: moments with a home on SSD were written by the update
        # before (a replay of two steps applies its first update in the second, from zeros)
        for s in (u.exp_avg, u.exp_avg_sq):
            s.on_disk = s.on_disk or s.stored


def _read(sim, upto: int) -> Iterator:
    while sim.lazy_cursor < min(upto, len(sim.lazy_order)):
        u = sim.lazy_order[sim.lazy_cursor]
        if u.pending:
            yield from u.exp_avg.acquire(sim, OPTIM)
            yield from u.exp_avg_sq.acquire(sim, OPTIM)
            yield from u.grads.acquire(sim, OPTIM)
            if u.master is not u.compute:
                yield from u.master.acquire(sim, OPTIM)
        sim.lazy_cursor += 1


def apply_pending(sim, names) -> Iterator:
    """Executor.before_fetch: the pending updates of `names` (and those before them) submitted."""
    want = set(names)
    last = max((i for i, u in enumerate(sim.lazy_order) if u.pending and u.name in want), default=-1)
    while sim.lazy_submitted <= last:
        u = sim.lazy_order[sim.lazy_submitted]
        sim.lazy_submitted += 1
        if u.pending:
            yield from _submit(sim, u)
    if last >= 0 or sim.lazy_submitted:
        yield from _read(sim, sim.lazy_submitted + sim.optim_prefetch_depth + 1)


def _submit(sim, u) -> Iterator:
    yield from _read(sim, sim.lazy_submitted)
    u.pending = False
    yield from u.master.acquire(sim, OPTIM)
    job = Job(u, lazy=True)
    phase = u.phase
    yield from sim.fill_update(job, u, sim.costs.adam_rate)
    u.phase = phase
    sim.lazy_inflight.add(u.name)
    sim.submit(job)


def wait_pending(sim, u) -> Iterator:
    """Executor.before_bind: the unit's pending update is done before its weights are used."""
    if u.pending:
        yield from apply_pending(sim, (u.name,))
    yield from _wait(sim, lambda: u.name not in sim.lazy_inflight)


def complete_pending(sim) -> Iterator:
    if any(u.pending for u in sim.lazy_order):
        yield from apply_pending(sim, [u.name for u in sim.lazy_order])
    yield from _wait(sim, lambda: not sim.lazy_inflight)


def _wait(sim, done) -> Iterator:
    while not done():
        job = sim.jobs[0]
        if job.done_t is None or job.done_t > sim.t:
            yield ("cond", lambda job=job: job.done_t is not None)
        sim.complete(sim.jobs.popleft())
