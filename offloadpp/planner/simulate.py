"""A discrete-event replay of what the runtime does in a training step, for the cost model.

Pure (no torch). It walks the same Schedule the runtime walks and applies the runtime's rules
(runtime/executor.py, optimizer.py, slots.py, memory.py, device.py) to timed resources instead
of real buffers, so the bytes it moves are the bytes the runtime moves and the waits are the
waits the runtime has.

Note: the resources.
  main thread   runs the visits: device compute (forward / backward of each unit), the hooks'
                fetch and release decisions, the optimizer's submissions and reaps. It blocks
                where the runtime blocks: waiting for weights, for the buffer pool, for the
                optimizer at step(). (A read of a key whose write still drains is issued when
                the write is done, without blocking.)
  worker        the optimizer's single thread: per job, wait for its reads, absorb gradients,
                run Adam, start the writes.
  CPU sharing   on the CPU acting as the device, compute and Adam run on the same cores: while
                both run, compute advances at 1/compute_slowdown_under_adam of its speed and
                Adam at 1/adam_slowdown_under_compute (both measured by `offloadpp profile`).
  SSD           one device bandwidth, reads served before queued writes, as the engine does
                (desim.Ssd): a write's completion is known only once the replay reaches it,
                so waits on SSD requests are on their Done. While the SSD is busy, compute on
                the CPU acting as the device runs at 1/compute_slowdown_under_io.
  link (CUDA)   one FIFO server per direction (host->device, device->host).
Several steps are replayed and the last is reported: writes started by one step's optimizer
drain into the next step's reads, as they do in the runtime.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional

from . import simulate_pending as pending
from .activations import ActUnit
from .desim import Done, Fifo, Pool, Ssd, When, done_by
from .plan import DTYPE_BYTES, Plan, Tier
from .ranks import RankLink
from .schedule import Schedule, build_schedule, flush_rank
from .simulate_act import ActReplay
from .simulate_dp import dp_grads, dp_unit

EMPTY, LOADING, READY = 0, 1, 2
COMPUTE, OPTIM, NEXT, WRITE = "compute", "optim", "next", "write"


@dataclass(eq=False)
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

    def acquire(self, sim: Sim, hold: str, overwrite: bool = False) -> Iterator:
        self.holds.add(hold)
        if self.state != EMPTY:
            return
        yield from self.pool.get(sim, self.nbytes)
        if overwrite or not self.on_disk:
            self.state = READY
        else:
            if sim.costs.io_issue_s:
                yield ("cpu", sim.costs.io_issue_s)
            # issued once our own write of this key is done (slots._ReadAfterWrite), not blocking
            self.read_done = sim.ssd.submit(
                sim.t, self.nbytes, write=False, key=self.key, after=self.write_done
            )
            self.state = LOADING

    def wait(self, sim: Sim) -> Iterator:
        if self.state == LOADING:
            if not done_by((self.read_done,), sim.t):
                yield ("wait", (self.read_done,))
            self.state = READY

    def release(self, sim: Sim, hold: str, after: float = 0.0) -> None:
        self.holds.discard(hold)
        if self.holds or self.resident or self.state == EMPTY:
            return
        self.pool.put(self.nbytes, self.read_done, self.write_done, after)
        self.state = EMPTY

    def wrote(self, done: Done) -> None:
        self.write_done = done
        self.on_disk = True


class CpuWeights:
    def __init__(self, source: Slot):
        self.source = source

    def acquire(self, sim: Sim) -> Iterator:
        yield from self.source.acquire(sim, COMPUTE)

    def pump(self, sim: Sim) -> None:
        pass

    def wait(self, sim: Sim) -> Iterator:
        yield from self.source.wait(sim)

    def release(self, sim: Sim) -> None:
        self.source.release(sim, COMPUTE)


class CudaWeights:
    def __init__(self, source: Slot, resident: bool):
        self.source, self.resident = source, resident
        self.state = READY if resident else EMPTY
        self.copied = resident
        self.copy_done = 0.0

    def _copy(self, sim: Sim) -> None:
        self.copy_done = sim.h2d.submit(sim.t, self.source.nbytes, write=False)
        self.copied = True

    def acquire(self, sim: Sim) -> Iterator:
        if self.state != EMPTY:
            return
        yield from self.source.acquire(sim, COMPUTE)
        self.copied = False
        self.state = LOADING
        self.pump(sim)

    def pump(self, sim: Sim) -> None:
        if self.state == LOADING and not self.copied:
            s = self.source
            if s.state != LOADING or done_by((s.read_done,), sim.t):
                s.state = READY if s.state == LOADING else s.state
                self._copy(sim)
                if not s.resident:
                    s.release(sim, COMPUTE, after=self.copy_done)

    def wait(self, sim: Sim) -> Iterator:
        if self.state == LOADING:
            if not self.copied:
                yield from self.source.wait(sim)
                self.pump(sim)
            self.state = READY
        if self.copy_done > sim.t:
            yield ("until", self.copy_done)

    def release(self, sim: Sim) -> None:
        if self.resident or self.state == EMPTY:
            return
        if not self.copied:
            self.source.release(sim, COMPUTE)
        self.state = EMPTY


class Unit:
    def __init__(self, sim: Sim, spec, placement, plan: Plan):
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
            self.compute = slot("weights", n * cdt, sim.device_pool if not cuda else sim.host_pool)
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
        self.bound = False
        self.phase = "idle"
        # updated speculatively only where its state all lives on SSD (runtime Unit.can_speculate)
        self.can_speculate = all(x.stored for x in (self.master, self.compute, self.exp_avg, self.exp_avg_sq))
        self.speculated = False
        self.pending = False  # a deferred update to apply at the next visit (simulate_pending)

    @staticmethod
    def slot_for(sim: Sim, spec, homes):
        def slot(array: str, nbytes: int, pool: Pool) -> Slot:
            home = homes[array]
            resident = home is Tier.HOST or home is Tier.DEVICE
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


@dataclass(eq=False)
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


@dataclass(frozen=True)
class Costs:
    """Per-unit seconds the replay charges, and the run's settings."""

    forward_s: dict  # unit -> seconds of forward compute (one micro-batch)
    backward_s: dict  # unit -> seconds of backward compute (recompute included)
    adam_rate: float  # params/s at the runtime's Adam threads
    adam_tail_rate: float  # params/s at all cores (the last unit's update, and deferred updates)
    memcpy_bps: float
    compute_slowdown: float
    adam_slowdown: float
    forward_visit_s: float = 0.0  # the runtime's own work per visit
    backward_visit_s: float = 0.0
    io_issue_s: float = 0.0  # CPU time of the issuing thread per SSD request


class Sim:
    def __init__(self, plan: Plan, costs: Costs, ssd: Ssd, h2d: Fifo, d2h: Fifo, *, micro_batches: int,
                 act_policies: Optional[Mapping[str, str]] = None, act_bytes: Optional[Mapping[str, int]] = None,
                 act_prefetch_units: int = 2, act_inputs: Optional[Mapping[str, ActUnit]] = None,
                 link: Optional[RankLink] = None):  # fmt: skip
        self.plan, self.costs = plan, costs
        self.ssd, self.h2d, self.d2h = ssd, h2d, d2h
        self.dp = plan.ranks > 1
        self.link = link if link is not None else RankLink()
        # over several ranks: the collectives' link (ranks.py), one FIFO for the gathers and reductions
        self.net = Fifo(self.link.bus_gbps() * 1e9, self.link.bus_gbps() * 1e9) if self.dp else None
        self.t = 0.0
        self.cuda = plan.device == "cuda"
        budgets = plan.budgets
        self.device_pool = Pool(budgets.buffer_bytes if budgets is not None else 0)
        self.host_pool = Pool(budgets.host_bytes if budgets is not None else 0)
        self.resident_device_bytes = 0
        self.pool_wait_s = 0.0
        self.sched: Schedule = build_schedule(plan)
        self.units = [dp_unit(Unit, self, u, p, plan) if self.dp else Unit(self, u, p, plan) for u, p in plan]
        self.by_name = {u.name: u for u in self.units}
        self.order = [self.by_name[n] for n in self.sched.absorb_order]  # as gradients complete
        self.update_order = [self.by_name[n] for n in self.sched.update_order]
        self.order_index = {u.name: i for i, u in enumerate(self.order)}
        self.update_index = {u.name: i for i, u in enumerate(self.update_order)}
        self.micro_batches = micro_batches
        self.deferred = plan.deferred_update
        # a speculative plan's steps validate: the replay is of a step whose speculation commits
        self.speculating = plan.deferred_update and plan.speculative
        self.q = self.sched.optim_window
        # deferred updates applied at each unit's next visit, in forward order (simulate_pending)
        self.lazy = pending.lazy_applies(plan)
        fwd = self.sched.forward_index
        self.lazy_order = [self.by_name[n] for n in sorted(fwd, key=fwd.get)]
        self.lazy_index = {u.name: i for i, u in enumerate(self.lazy_order)}
        self.lazy_inflight: set = set()
        self.lazy_cursor = self.lazy_submitted = 0
        self.next_keep, self.spec_next_keep = self.sched.next_keep, self.sched.spec_next_keep
        self.keep_until_update = self.sched.keep_until_update
        self.in_backward = False
        self.boundary = True
        self.jobs: deque[Job] = deque()  # submitted, not reaped
        self.queued_writes: list[Slot] = []  # see flush_writes
        self.queue: deque[Job] = deque()  # submitted, not started by the worker
        self.closed = False
        self.held: list[Unit] = []
        self.fetch_order = []  # as the executor: in the order of need, units kept between two uses last
        for i in range(len(self.sched.visits)):
            alive = self.sched.alive[i]
            names: list[str] = []
            for v in self.sched.visits[i:]:
                if len(names) == len(alive):
                    break
                names.extend(n for n in v.needs if n not in names and n in alive)
            names.extend(sorted(alive - set(names)))
            self.fetch_order.append(tuple(names))
        self.marks: list[dict] = []  # per step: times of its phases
        self.adam_busy_s = 0.0
        self.compute_busy_s = 0.0
        self.act = ActReplay(self, act_policies or {}, act_bytes or {}, act_prefetch_units,
                             budgets.activation_bytes if budgets is not None else None, act_inputs)  # fmt: skip

    def helpers(self) -> list[Iterator]:
        """The replay's other threads: the optimizer's worker, and the activation mover if any."""
        return [self.worker()] + ([self.act.worker()] if self.act.active else [])

    # ---- the main thread ----------------------------------------------------------------
    def main(self, steps: int) -> Iterator:
        for _ in range(steps):
            m = {"start": self.t, "ssd_r0": self.ssd.read_bytes, "ssd_w0": self.ssd.write_bytes,
                 "h2d0": self.h2d.read_bytes, "d2h0": self.d2h.read_bytes, "adam0": self.adam_busy_s,
                 "net0": self.net.read_bytes if self.net is not None else 0,
                 "pool_wait0": self.pool_wait_s, "by_key0": dict(self.ssd.by_key),
                 "by_dir0": dict(self.ssd.by_key_dir)}  # fmt: skip
            for micro in range(self.micro_batches):
                first, boundary = micro == 0, micro == self.micro_batches - 1
                yield from self.begin_micro(first, boundary)
                self.cursor = -1
                nf = self.sched.num_forward
                for v in self.sched.visits[:nf]:
                    yield from self.enter(v.index)
                    yield from self.act.before_forward(v.unit)
                    yield ("cpu", self.costs.forward_s[v.unit] + self.costs.forward_visit_s)
                    self.act.after_forward(v.unit)
                m.setdefault("forward_end", []).append(self.t)
                for u in self.units:
                    u.grads_pending = True
                self.in_backward = True
                if self.deferred and self.boundary:
                    yield from self.begin_backward()
                for v in self.sched.visits[nf:]:
                    yield from self.enter(v.index)
                    yield from self.act.before_backward(v.unit)
                    work = (
                        self.costs.backward_s[v.unit]
                        + self.costs.backward_visit_s
                        + self.act.recompute_s(v.unit)
                    )
                    yield ("cpu", work)
                    self.act.after_backward(v.unit)
                    yield from self.on_grads(self.by_name[v.unit])
                self.in_backward = False
                for u in list(self.held):
                    yield from self.drop(u)
                m.setdefault("backward_end", []).append(self.t)
                if not boundary:
                    yield from self.finish()
            if self.deferred:
                yield from self.finish()
                if self.lazy:
                    pending.defer(self)
                else:
                    yield from self.run_deferred()
            yield from self.finish()
            for u in self.units:
                u.phase = "idle"
                if u.speculated:  # the step validated: the gradients kept for a redo go
                    u.grads.release(self, OPTIM)
                    u.speculated = False
            m.update(end=self.t, ssd_r=self.ssd.read_bytes - m["ssd_r0"], ssd_w=self.ssd.write_bytes - m["ssd_w0"],
                     h2d=self.h2d.read_bytes - m["h2d0"], d2h=self.d2h.read_bytes - m["d2h0"],
                     net=(self.net.read_bytes if self.net is not None else 0) - m["net0"],
                     adam=self.adam_busy_s - m["adam0"], pool_wait=self.pool_wait_s - m["pool_wait0"],
                     by_key={k: v - m["by_key0"].get(k, 0) for k, v in self.ssd.by_key.items()},
                     by_dir={k: v - m["by_dir0"].get(k, 0) for k, v in self.ssd.by_key_dir.items()})  # fmt: skip
            self.marks.append(m)
        self.closed = True

    def begin_micro(self, first: bool, boundary: bool) -> Iterator:
        self.first_micro, self.boundary = first, boundary
        self.absorb_cursor = self.update_cursor = self.absorbed = self.submitted = 0
        if not any(u.pending for u in self.lazy_order):  # (else at begin_backward)
            yield from self.advance_absorb(self.q + 1)
        if boundary and not self.deferred:
            yield from self.advance_update(self.q + 1)

    def advance_absorb(self, upto: int) -> Iterator:
        while self.absorb_cursor < min(upto, len(self.order)):
            u = self.order[self.absorb_cursor]
            if self.dp and u.accum_persist:
                yield from u.accum.acquire(self, OPTIM, overwrite=self.first_micro)
            elif not self.dp and u.grads_persist:
                yield from u.grads.acquire(self, OPTIM, overwrite=self.first_micro)
            self.absorb_cursor += 1

    def begin_backward(self) -> Iterator:
        """optimizer.begin_backward: the deferred window is read as backward starts (speculating:
        a window sliding over the order gradients complete in; updates applied at the next
        visit: none, the pending ones are done first)."""
        yield from pending.complete_pending(self)
        yield from self.advance_absorb(self.q + 1)
        if self.lazy:
            return
        if self.speculating:
            yield from self.advance_update(self.q + 1, order=self.order, sliding=True)
        else:
            yield from self.advance_update(self.q + 1)

    def advance_update(self, upto: int, with_grads: bool = False, order: Optional[list] = None,
                       sliding: bool = False) -> Iterator:  # fmt: skip
        order = self.update_order if order is None else order
        while self.update_cursor < min(upto, len(order)):
            u = order[self.update_cursor]
            if sliding and not u.can_speculate:
                self.update_cursor += 1
                continue
            yield from u.master.acquire(self, OPTIM)
            yield from u.exp_avg.acquire(self, OPTIM)
            yield from u.exp_avg_sq.acquire(self, OPTIM)
            if with_grads and not u.speculated:
                yield from u.grads.acquire(self, OPTIM)
            self.update_cursor += 1

    def enter(self, i: int) -> Iterator:
        self.reap()
        want = self.sched.alive[i]
        for u in list(self.held):
            if u.name not in want:
                yield from self.drop(u)
        yield from pending.apply_pending(self, self.fetch_order[i])
        for name in self.fetch_order[i]:
            u = self.by_name[name]
            if all(u is not h for h in self.held):
                yield from u.weights.acquire(self)
                self.held.append(u)
        for u in self.held:
            u.weights.pump(self)
        if self.in_backward or i >= min(self.sched.prefetch_depth, self.sched.num_forward - 1):
            n = len(self.queued_writes)
            self.flush_writes()
            if n and self.costs.io_issue_s:
                yield ("cpu", n * self.costs.io_issue_s)
        # the kept updated weights: held now, or past their first hold
        for name, t in self.sched.next_keep_until.items() if not self.in_backward else ():
            u = self.by_name[name]
            if i >= t or any(u is h for h in self.held):
                u.compute.release(self, NEXT)
        for name in self.sched.visits[i].needs:
            yield from pending.wait_pending(self, self.by_name[name])
            yield from self.by_name[name].weights.wait(self)
        self.cursor = i

    def drop(self, u: Unit) -> Iterator:
        if (
            self.in_backward
            and u.name in self.keep_until_update
            and u.phase not in ("updating", "updated")
            and self.boundary
        ):
            yield from u.master.acquire(self, OPTIM)  # == its weights: its update needs them
        if (
            self.in_backward
            and self.lazy
            and u.master is u.compute
            and u.name in self.next_keep
            and self.boundary
        ):
            yield from u.compute.acquire(self, NEXT)  # kept for the next forward's pending update
        u.weights.release(self)
        self.held = [h for h in self.held if h is not u]

    def on_grads(self, u: Unit) -> Iterator:
        if not u.grads_pending:
            return
        u.grads_pending = False
        idx = self.order_index[u.name]
        yield from self.advance_absorb(idx + 1)
        last = idx == len(self.order) - 1
        job = Job(u, defer_writes=last)
        rate = self.costs.adam_tail_rate if last else self.costs.adam_rate
        if not self.cuda and not u.grads_persist and self.boundary and not self.dp:
            yield from self.advance_update(idx + 1)
            yield from self.fill_update(job, u, rate)
            self.submitted += 1
            yield from self.advance_update(self.submitted + self.q + 1)
            self.submit(job)
            return
        if self.dp:
            yield from dp_grads(self, job, u, idx, rate)
            return
        sliding = self.speculating and self.boundary
        spec = sliding and u.can_speculate
        # the deferred window's: gradients held (applied at the next visit: its first units')
        kept = (self.lazy_index if self.lazy else self.update_index)[u.name] < self.q + 1
        redo = self.plan.clipping  # a speculative step may be redone: its gradients are kept
        if sliding:
            yield from self.advance_update(idx + 1, order=self.order, sliding=True)
        if (
            spec
            and self.first_micro
            and not self.cuda
            and (not redo or last or (kept and not u.grads.resident))
        ):
            # optimizer.on_grads: speculated where autograd left them, the norm in the Adam pass
            if u.grads_persist:
                u.grads.release(self, OPTIM)
            yield from self.fill_update(job, u, rate, direct=True)
            job.speculative = u.speculated = True
            self.submit(job)
            yield from self.slide()
            return
        yield from u.grads.acquire(self, OPTIM, overwrite=self.first_micro or not u.grads_persist)
        if self.cuda:
            grad_bytes = u.numel * DTYPE_BYTES[self.plan.compute_dtype]
            yield from self.host_pool.get(self, grad_bytes)
            job.grads_ready = self.d2h.submit(self.t, grad_bytes, write=False)
            self.host_pool.put(grad_bytes, job.grads_ready)  # back once the job used it: close enough
        job.before.append(job.grads_ready)
        job.absorb_s = 2 * u.numel * 4 / self.costs.memcpy_bps
        if self.deferred and self.boundary and not spec:
            job.absorb_s += u.numel * 4 / self.costs.memcpy_bps  # the squared norm (speculating: in Adam)
        if self.boundary and not self.deferred:
            yield from self.advance_update(idx + 1)
            yield from self.fill_update(job, u, rate)
            self.submitted += 1
            yield from self.advance_update(self.submitted + self.q + 1)
        elif spec:
            yield from self.fill_update(job, u, rate)
            job.speculative = True
            job.keep_grads = kept and redo
            if redo and not kept and u.grads.stored:
                job.writes.append(u.grads)
            u.speculated = True
        elif self.deferred and self.boundary and kept:
            job.keep_grads = True
        elif u.grads_persist and u.grads.stored:
            job.writes.append(u.grads)
        self.add_before(job, u.grads)
        self.submit(job)
        self.absorbed += 1
        yield from self.advance_absorb(self.absorbed + self.q + 1)
        if sliding:
            yield from self.slide()

    def slide(self) -> Iterator:
        """optimizer._slide: a speculating window moves on as a unit is handed out."""
        self.submitted += 1
        yield from self.advance_update(self.submitted + self.q + 1, order=self.order, sliding=True)

    def fill_update(self, job: Job, u: Unit, rate: float, direct: bool = False) -> Iterator:
        job.update = True
        job.adam_s = u.adam_numel / rate
        self.add_before(job, u.master, u.exp_avg, u.exp_avg_sq)
        if self.dp and u.weights.resident:
            job.regather_bytes = u.weights.gather_bytes
        if (u.grads_persist or self.cuda or self.dp) and not direct:
            self.add_before(job, u.grads)
        slots = [u.master, u.exp_avg, u.exp_avg_sq]
        if self.plan.separate_weights:
            # the new compute copy is written by the same pass: its buffer is taken, not read
            yield from u.compute.acquire(self, OPTIM, overwrite=True)
            self.add_before(job, u.compute)
            slots.append(u.compute)
        job.writes.extend(s for s in slots if s.stored)
        u.phase = "updating"

    def add_before(self, job: Job, *slots: Slot) -> None:
        for s in slots:
            if s.state == LOADING:
                job.before.append(s.read_done)
            if not done_by((s.write_done,), self.t):
                job.before.append(s.write_done)

    def submit(self, job: Job) -> None:
        self.jobs.append(job)
        self.queue.append(job)

    def reap(self, block: bool = False) -> None:
        while self.jobs and self.jobs[0].done_t is not None and (block or self.jobs[0].done_t <= self.t):
            self.complete(self.jobs.popleft())

    def finish(self) -> Iterator:
        while self.jobs:
            job = self.jobs[0]
            if job.done_t is None or job.done_t > self.t:
                yield ("cond", lambda job=job: job.done_t is not None)
            self.complete(self.jobs.popleft())

    def complete(self, job: Job) -> None:
        u = job.unit
        for s, done in job.write_done:
            s.wrote(done)
        for s in job.writes:
            if job.defer_writes or _late(job, s):
                s.holds.add(WRITE)  # acquire(WRITE) on a slot that holds its buffer
                self.queued_writes.append(s)
        if job.lazy:
            self.lazy_inflight.discard(u.name)
            for s in (u.master, u.exp_avg, u.exp_avg_sq, u.grads):
                s.release(self, OPTIM)
            u.compute.release(self, OPTIM)
        elif job.update:
            after = 0.0
            if self.cuda and isinstance(u.weights, CudaWeights) and u.weights.resident:
                u.weights.copy_done = self.h2d.submit(self.t, u.compute_bytes, write=False)
                after = u.weights.copy_done
            if u.name in (self.spec_next_keep if job.speculative else self.next_keep):
                u.compute.holds.add(NEXT)
            for s in (u.master, u.exp_avg, u.exp_avg_sq) + (() if job.keep_grads else (u.grads,)):
                s.release(self, OPTIM)
            u.compute.release(self, OPTIM, after=after)
            u.phase = "updated"
        elif not job.keep_grads:
            u.grads.release(self, OPTIM)
        if u.accum is not None:
            u.accum.release(self, OPTIM)

    def flush_writes(self) -> None:
        """The step's last update's writes, started once the next forward's first fetches are."""
        queued, self.queued_writes = self.queued_writes, []
        queued.sort(key=lambda s: flush_rank(s.key))
        for s in queued:
            s.wrote(self.ssd.submit(self.t, s.nbytes, write=True, key=s.key))
            s.release(self, WRITE)

    def run_deferred(self) -> Iterator:
        todo = [u for u in self.update_order if not u.speculated]
        self.update_cursor = 0
        for i, u in enumerate(todo):
            yield from self.advance_update(i + self.q + 1, with_grads=True, order=todo)
            job = Job(u, defer_writes=i == len(todo) - 1)
            job.defer_moments = self.q + 1 >= len(self.update_order)
            yield from self.fill_update(job, u, self.costs.adam_tail_rate)
            self.submit(job)
            self.submitted += 1
            self.reap()

    # ---- the optimizer's worker ---------------------------------------------------------
    def worker(self) -> Iterator:
        while True:
            if not self.queue:
                yield ("cond", lambda: bool(self.queue) or self.closed)
                if not self.queue:
                    return
            job = self.queue.popleft()
            if not done_by(job.before, self.t):
                yield ("wait", tuple(job.before))
            if job.absorb_s:
                yield ("cpu", job.absorb_s)
            if job.comm_bytes:  # the ranks' reduction of the unit's gradients (runtime/sharded_optimizer.py)
                yield ("until", self.net.submit(self.t, job.comm_bytes, write=False))
            if job.adam_s:
                t0 = self.t
                yield ("cpu", job.adam_s)
                self.adam_busy_s += self.t - t0
            if job.regather_bytes:
                yield ("until", self.net.submit(self.t, job.regather_bytes, write=False))
            if not job.defer_writes:
                now = [s for s in job.writes if not _late(job, s)]
                if now and self.costs.io_issue_s:
                    yield ("cpu", len(now) * self.costs.io_issue_s)
                job.write_done = [(s, self.ssd.submit(self.t, s.nbytes, write=True, key=s.key)) for s in now]
            job.done_t = self.t


__all__ = ["Costs", "Sim"]
