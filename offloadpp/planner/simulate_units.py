"""The replay's per-unit state (planner/simulate.py walks it): a unit's arrays as slots with the
runtime's states and holds (runtime/slots.py), its weights on the device (runtime/device.py,
CpuWeights / CudaWeights), and an optimizer job (runtime/optimizer.py).

Pure (no torch). Its own module so that the replays of pending updates, activations and ranks
(simulate_pending.py, simulate_act.py, simulate_dp.py) build units and jobs without importing the
step's replay that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

from .desim import NOTHING, Done, Pool, Replay, When, done_by
from .plan import DTYPE_BYTES, Plan, Tier

EMPTY, LOADING, READY = 0, 1, 2
COMPUTE, OPTIM, NEXT, WRITE = "compute", "optim", "next", "write"


@dataclass(eq=False, slots=True)  # (thousands made per candidate replayed, read at every step)
class Slot:
    key: str
    nbytes: int
    pool: Pool
    resident: bool
    on_disk: bool
    stored: bool = True  # its home is SSD (Plan.homes): written after its update
    state: int = EMPTY
    holds: set = field(default_factory=set)
    read_done: When = None
    write_done: Optional[Done] = None
    updating: bool = False  # a compute copy its pending update has not made yet (runtime Slot.updating)
    after: float = 0.0  # the latest `after` of the releases while another hold kept the buffer

    # Note: acquire and wait return what `yield from` runs: NOTHING where nothing is to be
    # waited for (most calls: the slot is held already, its buffer free, its read in), a
    # generator only where the replay may wait; it makes thousands of calls per candidate.
    def acquire(self, sim: Replay, hold: str, overwrite: bool = False) -> Iterable:
        self.holds.add(hold)
        if self.state != EMPTY:
            return NOTHING
        got = self.pool.get(sim, self.nbytes)
        if got is not NOTHING:
            return self._load(sim, overwrite, got)
        # (_loaded, inline: most acquires take a free buffer at once)
        if overwrite or not self.on_disk:
            self.state = READY
            return NOTHING
        if sim.costs.io_issue_s:
            return self._issue(sim)
        self._read(sim)
        return NOTHING

    def _load(self, sim: Replay, overwrite: bool, got: Iterable) -> Iterator:
        yield from got
        yield from self._loaded(sim, overwrite)

    def _loaded(self, sim: Replay, overwrite: bool) -> Iterable:
        """The buffer is taken: its contents, read unless overwritten or not on disk."""
        if overwrite or not self.on_disk:
            self.state = READY
            return NOTHING
        if sim.costs.io_issue_s:
            return self._issue(sim)
        self._read(sim)
        return NOTHING

    def _issue(self, sim: Replay) -> Iterator:
        yield ("cpu", sim.costs.io_issue_s)
        # (_read, inline)
        self.read_done = sim.ssd.submit(sim.t, self.nbytes, False, self.key, self.write_done)
        self.state = LOADING

    def _read(self, sim: Replay) -> None:
        # issued once our own write of this key is done (slots._ReadAfterWrite), not blocking
        self.read_done = sim.ssd.submit(sim.t, self.nbytes, False, self.key, self.write_done)
        self.state = LOADING

    def wait(self, sim: Replay) -> Iterable:
        if self.state == LOADING:
            if not done_by((self.read_done,), sim.t):
                return self._wait_read()
            self.state = READY
        return NOTHING

    def _wait_read(self) -> Iterator:
        yield ("wait", (self.read_done,))
        self.state = READY

    def release(self, sim: Replay, hold: str, after: float = 0.0) -> None:
        # every release's `after` counts, whichever hold goes last (runtime Slot.release keeps them)
        if after > self.after:
            self.after = after
        self.holds.discard(hold)
        if self.holds or self.resident or self.state == EMPTY:
            return
        self.pool.put(self.nbytes, self.read_done, self.write_done, self.after)
        self.state, self.after = EMPTY, 0.0

    def wrote(self, done: Done) -> None:
        self.write_done = done
        self.on_disk = True


class CpuWeights:
    uncopied = False  # (nothing to copy: the CPU device computes on the slot's buffer)

    def __init__(self, source: Slot):
        self.source = source

    def acquire(self, sim: Replay) -> Iterable:
        return self.source.acquire(sim, COMPUTE)

    def pump(self, sim: Replay) -> None:
        pass

    def wait(self, sim: Replay) -> Iterable:
        return self.source.wait(sim)

    def release(self, sim: Replay) -> None:
        self.source.release(sim, COMPUTE)


class PairWeights:
    """runtime/device.py PairWeights: a unit's weights and its frozen segment, fetched together."""

    def __init__(self, trainable, frozen):
        self.trainable, self.frozen = trainable, frozen

    def acquire(self, sim: Replay) -> Iterator:
        yield from self.trainable.acquire(sim)
        yield from self.frozen.acquire(sim)

    def pump(self, sim: Replay) -> None:
        self.trainable.pump(sim)
        self.frozen.pump(sim)

    @property
    def uncopied(self) -> bool:
        return self.trainable.uncopied or self.frozen.uncopied

    def wait(self, sim: Replay) -> Iterator:
        yield from self.frozen.wait(sim)
        yield from self.trainable.wait(sim)

    def release(self, sim: Replay) -> None:
        self.trainable.release(sim)
        self.frozen.release(sim)

    def __getattr__(self, name):  # resident, copy_done: the trainable weights'
        return getattr(self.__dict__["trainable"], name)


class CudaWeights:
    def __init__(self, source: Slot, resident: bool):
        self.source, self.resident = source, resident
        self.state = READY if resident else EMPTY
        self.copied = resident
        self.copy_done = 0.0

    def _copy(self, sim: Replay) -> None:
        self.copy_done = sim.h2d.submit(sim.t, self.source.nbytes, False)
        self.copied = True

    def acquire(self, sim: Replay) -> Iterable:
        if self.state != EMPTY:
            return NOTHING
        got = self.source.acquire(sim, COMPUTE)
        if got is not NOTHING:
            return self._acquire(sim, got)
        self._fetched(sim)
        return NOTHING

    def _acquire(self, sim: Replay, got: Iterable) -> Iterator:
        yield from got
        self._fetched(sim)

    def _fetched(self, sim: Replay) -> None:
        self.copied = False
        self.state = LOADING
        self.pump(sim)

    def pump(self, sim: Replay) -> None:
        if self.state == LOADING and not self.copied and not self.source.updating:
            s = self.source
            r = s.read_done  # (done_by((r,), sim.t), inline: every visit pumps every unit held)
            if (
                s.state != LOADING
                or r is None
                or ((r.t is not None and r.t <= sim.t) if r.__class__ is Done else r <= sim.t)
            ):
                s.state = READY if s.state == LOADING else s.state
                self._copy(sim)
                if not s.resident:
                    s.release(sim, COMPUTE, after=self.copy_done)

    @property
    def uncopied(self) -> bool:
        """Fetched, its device copy not started: a pump may start it."""
        return self.state == LOADING and not self.copied

    def wait(self, sim: Replay) -> Iterable:
        if self.state == LOADING:
            if not self.copied:
                got = self.source.wait(sim)
                if got is not NOTHING:
                    return self._wait(sim, got)
                self.pump(sim)
            self.state = READY
        if self.copy_done > sim.t:
            return (("until", self.copy_done),)
        return NOTHING

    def _wait(self, sim: Replay, got: Iterable) -> Iterator:
        yield from got
        self.pump(sim)
        self.state = READY
        if self.copy_done > sim.t:
            yield ("until", self.copy_done)

    def release(self, sim: Replay) -> None:
        if self.resident or self.state == EMPTY:
            return
        if not self.copied:
            self.source.release(sim, COMPUTE)
        self.state = EMPTY


class Unit:
    def __init__(self, sim: Replay, spec, placement, plan: Plan):
        cuda = plan.device == "cuda"
        alias = not plan.separate_weights
        n = spec.padded_numel
        self.name, self.numel, self.padded = spec.name, spec.numel, n
        cdt = DTYPE_BYTES[plan.compute_dtype]
        self.compute_bytes = n * cdt
        master_pool = sim.device_pool if (not cuda and alias) else sim.host_pool

        homes = plan.homes(spec, placement)  # the accounting the plan and the runtime share
        slot = self.slot_for(sim, spec, homes)
        self.adam_numel = spec.numel
        self.accum = None  # (over several ranks: simulate_dp)
        self.reduce_bytes = 0.0
        self.master = slot("master", n * 4, master_pool)
        if alias:
            self.compute = self.master
        else:
            # (runtime Unit's rule: a copy kept in host memory is the host pool's)
            on_device = plan.compute_copy_on_device and homes["weights"] is not Tier.HOST
            pool = sim.device_pool if on_device else sim.host_pool
            self.compute = slot("weights", n * cdt, pool)
        self.exp_avg = slot("exp_avg", n * 4, sim.host_pool)
        self.exp_avg_sq = slot("exp_avg_sq", n * 4, sim.host_pool)
        self.grads_persist = plan.persistent_grads
        self.grads = slot("grads", n * DTYPE_BYTES[plan.grad_dtype], sim.host_pool)
        if cuda:
            self.weights = CudaWeights(self.compute, resident=placement.weights is Tier.DEVICE)
            if placement.weights is Tier.DEVICE:
                sim.resident_device_bytes += n * cdt
        else:
            self.weights = CpuWeights(self.compute)
        if spec.frozen_numel:  # read with the weights, never written (runtime Unit.frozen_slot)
            fb = spec.frozen_bytes(plan.compute_dtype)
            resident = homes["frozen"] is Tier.DEVICE
            fs = Slot(f"{spec.name}.frozen", fb, sim.device_pool if not cuda else sim.host_pool, resident,
                      on_disk=not resident, stored=False)  # fmt: skip
            if resident:
                sim.device_pool.allocated += fb
                sim.device_pool.peak = max(sim.device_pool.peak, sim.device_pool.allocated)
                fs.state = READY
            self.weights = PairWeights(self.weights, CudaWeights(fs, False) if cuda else CpuWeights(fs))
        self.bound = False
        self.phase = "idle"
        # updated speculatively only where its state all lives on SSD (runtime Unit.can_speculate)
        self.can_speculate = (
            self.master.stored and self.compute.stored and self.exp_avg.stored and self.exp_avg_sq.stored
        )
        self.speculated = False
        self.pending = False  # a deferred update to apply at the next visit (simulate_pending)

    @staticmethod
    def slot_for(sim: Replay, spec, homes):
        def slot(array: str, nbytes: int, pool: Pool) -> Slot:
            home = homes[array]
            resident = home is Tier.HOST or home is Tier.DEVICE or nbytes == 0  # (runtime Unit: empty arrays)
            # master and compute copies are on SSD from the start (written at initialisation)
            s = Slot(f"{spec.name}.{array}", nbytes, pool, resident,
                     on_disk=home is Tier.SSD and array in ("master", "weights"), stored=home is Tier.SSD)  # fmt: skip
            if resident:
                pool.allocated += nbytes
                pool.peak = max(pool.peak, pool.allocated)
                s.state = READY
            return s

        return slot

    @property
    def slots(self) -> tuple[Slot, ...]:
        out: list[Slot] = []
        for s in (self.master, self.compute, self.exp_avg, self.exp_avg_sq, self.grads, self.accum):
            if s is None:
                continue
            if all(s is not x for x in out):
                out.append(s)
        return tuple(out)


@dataclass(eq=False, slots=True)
class Job:
    unit: Unit
    before: list = field(default_factory=list)  # times the job waits for
    absorb_s: float = 0.0
    adam_s: float = 0.0
    update: bool = False
    writes: list = field(default_factory=list)  # slots written after the job's work
    grads_ready: float = 0.0  # CUDA: the d2h copy
    done_t: Optional[float] = None
    write_done: list = field(default_factory=list)
    defer_writes: bool = False  # the step's last update: its writes start with the next fetches
    defer_moments: bool = False  # deferred updates, window over every unit: moments wait too
    keep_grads: bool = False  # deferred: gradients stay held for an update among the first
    comm_bytes: float = 0.0  # over several ranks: the gradients reduce-scattered before Adam
    regather_bytes: float = 0.0  # and a resident unit's weights gathered after it
    speculative: bool = False  # an update during backward (its kept units: spec_next_keep)
    lazy: bool = False  # a pending update applied at the unit's next visit (simulate_pending)


def _late(job: Job, s: Slot) -> bool:
    """optimizer._late: a moment whose write waits for flush_writes."""
    return job.defer_moments and (s is job.unit.exp_avg or s is job.unit.exp_avg_sq)
