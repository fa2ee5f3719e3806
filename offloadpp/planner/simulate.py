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
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import offloadpp.planner.simulate_pending as pending

from .decide import lazy_applies
from .desim import NOTHING, Fifo, Pool, Ssd, done_by
from .plan import DTYPE_BYTES, Plan
from .ranks import RankLink
from .schedule import Schedule, cached_schedule, flush_rank
from .simulate_act import ActReplay, ActWork
from .simulate_dp import dp_grads, dp_unit
from .simulate_units import LOADING, NEXT, OPTIM, WRITE, CudaWeights, Job, PairWeights, Slot, Unit, _late


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
                 acts: Optional[ActWork] = None, link: Optional[RankLink] = None):  # fmt: skip
        """acts: what the activation replay is given (simulate_act.ActWork; None: nothing to replay)."""
        acts = acts if acts is not None else ActWork()
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
        self.sched: Schedule = cached_schedule(plan)
        self.units = [dp_unit(Unit, self, u, p, plan) if self.dp else Unit(self, u, p, plan) for u, p in plan]
        self.by_name = {u.name: u for u in self.units}
        self.order = [self.by_name[n] for n in self.sched.absorb_order]  # as gradients complete
        self.update_order = [self.by_name[n] for n in self.sched.update_order]
        self.order_index = {u.name: i for i, u in enumerate(self.order)}
        self.update_index = {u.name: i for i, u in enumerate(self.update_order)}
        self.micro_batches = micro_batches
        # a vertical window's step (planner/vertical.py window_plan): each visit runs this many
        # micro-batches one after another
        self.window = plan.micro_batches if not plan.accumulate_grads else 1
        self.deferred = plan.deferred_update
        # a speculative plan's steps validate: the replay is of a step whose speculation commits
        self.speculating = plan.deferred_update and plan.speculative
        self.optim_prefetch_depth = self.sched.optim_prefetch_depth
        # deferred updates applied at each unit's next visit, in forward order (simulate_pending)
        self.lazy = lazy_applies(plan)
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
        self.fetch_order = _fetch_order(self.sched)
        # per visit, the units it fetches (fetch_order's) and those it waits for (its needs)
        by_name = self.by_name
        self.fetch_units = [[by_name[n] for n in names] for names in self.fetch_order]
        self.need_units = [[by_name[n] for n in v.needs] for v in self.sched.visits]
        # the visit from which the step's last writes start (enter: after the first fetches)
        self.flush_from = min(self.sched.prefetch_depth, self.sched.num_forward - 1)
        self.next_keep_until = [(self.by_name[n], t) for n, t in self.sched.next_keep_until.items()]
        self.marks: list[dict] = []  # per step: times of its phases
        self.adam_busy_s = 0.0
        self.compute_busy_s = 0.0
        self.act = ActReplay(self, acts.policies, acts.saved_bytes, acts.prefetch_units,
                             budgets.activation_bytes if budgets is not None else None, acts.units)  # fmt: skip

    def helpers(self) -> list[Iterator]:
        """The replay's other threads: the optimizer's worker, and the activation mover if any."""
        return [self.worker()] + ([self.act.worker()] if self.act.active else [])

    # ---- the main thread ----------------------------------------------------------------
    def main(self, steps: int) -> Iterator:
        for step in range(steps):
            # (the bytes per key only for the last step, the one reported: cost.replay; the SSD
            # counts them from its start)
            last = step == steps - 1
            if last:
                self.ssd.by_key_dir = {}
            self.ssd.keyed = last
            m = {"start": self.t, "ssd_r0": self.ssd.read_bytes, "ssd_w0": self.ssd.write_bytes,
                 "h2d0": self.h2d.read_bytes, "d2h0": self.d2h.read_bytes, "adam0": self.adam_busy_s,
                 "net0": self.net.read_bytes if self.net is not None else 0,
                 "pool_wait0": self.pool_wait_s}  # fmt: skip
            # (locals, and the one-micro-batch visit's compute yielded here: the loops below run
            # every visit's parts; what `yield from` would run is skipped where it is NOTHING)
            act, costs, window1 = self.act, self.costs, self.window == 1
            forward_s, forward_visit_s = costs.forward_s, costs.forward_visit_s
            backward_s, backward_visit_s = costs.backward_s, costs.backward_visit_s
            for micro in range(self.micro_batches):
                first, boundary = micro == 0, micro == self.micro_batches - 1
                yield from self.begin_micro(first, boundary)
                self.cursor = -1
                nf = self.sched.num_forward
                for v in self.sched.visits[:nf]:
                    unit = v.unit
                    yield from self.enter(v.index)
                    work = forward_s[unit] + forward_visit_s
                    for k, (share, saved) in enumerate(act.forward_parts(unit)):
                        got = act.before_forward(unit, saved)
                        if got:
                            yield from got
                        if window1:
                            yield ("cpu", work * share)  # (compute's)
                        else:
                            yield from self.compute(work * share)
                        act.after_forward(unit, k)
                m.setdefault("forward_end", []).append(self.t)
                for u in self.units:
                    u.grads_pending = True
                self.in_backward = True
                if self.deferred and self.boundary:
                    yield from self.begin_backward()
                for v in self.sched.visits[nf:]:
                    unit = v.unit
                    yield from self.enter(v.index)
                    yield from act.before_backward(unit)
                    work = backward_s[unit] + backward_visit_s + act.recompute_s(unit)
                    for k, share in enumerate(act.backward_parts(unit)):
                        if k:
                            act.next_piece(unit, k)
                        if window1:
                            yield ("cpu", work * share)  # (compute's)
                        else:
                            yield from self.compute(work * share)
                    act.after_backward(unit)
                    yield from self.on_grads(self.by_name[unit])
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
                     adam=self.adam_busy_s - m["adam0"], pool_wait=self.pool_wait_s - m["pool_wait0"])  # fmt: skip
            if last:
                by_dir = dict(self.ssd.by_key_dir)
                by_key: dict[str, int] = {}
                for (k, _), v in by_dir.items():  # (both directions: desim._Tally.by_key)
                    by_key[k] = by_key.get(k, 0) + v
                m.update(by_key=by_key, by_dir=by_dir)
            self.marks.append(m)
        self.closed = True

    # Note: the steps below that often wait for nothing (compute of one micro-batch, the
    # optimizer's windows when they do not move) return what `yield from` runs, as
    # simulate_units' acquire and wait do: a tuple of requests, or a generator only where more
    # than one request or a wait may follow.
    def compute(self, seconds: float) -> Iterable:
        """The device computes for `seconds` of a unit's visit. A vertical window's visit runs
        its micro-batches one at a time, and each micro-batch reaching the unit pumps the held
        weights (the executor's hooks, runtime/executor.py): a prefetched unit's host-to-device
        copy starts once its read is in, within the visit, not at the next one."""
        if self.window == 1:
            return (("cpu", seconds),)
        for u in self.held:  # (no copy to start: the visit's micro-batches at once, as below)
            if u.weights.uncopied:
                return self._compute_window(seconds)
        return (("cpu", seconds * self.window / self.window),)

    def _compute_window(self, seconds: float) -> Iterator:
        for m in range(self.window):
            if m:
                for u in self.held:
                    u.weights.pump(self)
            for u in self.held:  # (no pump to come can start a copy: the rest at once)
                if u.weights.uncopied:
                    break
            else:
                yield ("cpu", seconds * (self.window - m) / self.window)
                return
            yield ("cpu", seconds / self.window)

    def begin_micro(self, first: bool, boundary: bool) -> Iterator:
        self.first_micro, self.boundary = first, boundary
        self.absorb_cursor = self.update_cursor = self.absorbed = self.submitted = 0
        if not any(u.pending for u in self.lazy_order):  # (else at begin_backward)
            yield from self.advance_absorb(self.optim_prefetch_depth + 1)
        if boundary and not self.deferred:
            yield from self.advance_update(self.optim_prefetch_depth + 1)

    def advance_absorb(self, upto: int) -> Iterable:
        if self.absorb_cursor >= min(upto, len(self.order)):
            return NOTHING
        return self._advance_absorb(upto)

    def _advance_absorb(self, upto: int) -> Iterator:
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
        yield from self.advance_absorb(self.optim_prefetch_depth + 1)
        if self.lazy:
            return
        if self.speculating:
            yield from self.advance_update(self.optim_prefetch_depth + 1, order=self.order, sliding=True)
        else:
            yield from self.advance_update(self.optim_prefetch_depth + 1)

    def advance_update(self, upto: int, with_grads: bool = False, order: Optional[list] = None,
                       sliding: bool = False) -> Iterable:  # fmt: skip
        order = self.update_order if order is None else order
        if self.update_cursor >= min(upto, len(order)):
            return NOTHING
        return self._advance_update(upto, with_grads, order, sliding)

    def _advance_update(self, upto: int, with_grads: bool, order: list, sliding: bool) -> Iterator:
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
        held = self.held
        want = self.sched.alive[i]
        for u in held:
            if u.name not in want:  # (something to drop: the units held, in order)
                for u in list(held):
                    if u.name not in want:
                        yield from self.drop(u)
                break
        if self.lazy:  # (else no update is ever pending: simulate_pending.defer is not called)
            yield from pending.apply_pending(self, self.fetch_order[i])
        for u in self.fetch_units[i]:
            if u not in held:  # (units compare by identity)
                yield from u.weights.acquire(self)
                held.append(u)
        for u in held:
            u.weights.pump(self)
        if self.queued_writes and (self.in_backward or i >= self.flush_from):
            n = len(self.queued_writes)
            self.flush_writes()
            if self.costs.io_issue_s:
                yield ("cpu", n * self.costs.io_issue_s)
        # the kept updated weights: held now, or past their first hold
        if not self.in_backward:
            for u, t in self.next_keep_until:
                if i >= t or u in held:
                    u.compute.release(self, NEXT)
        for u in self.need_units[i]:
            if self.lazy:
                yield from pending.wait_pending(self, u)
            yield from u.weights.wait(self)
        self.cursor = i

    def drop(self, u: Unit) -> Iterable:
        """What `yield from` runs to release a held unit: NOTHING outside backward (most drops),
        where no slot is to be held for its update."""
        if self.in_backward and self.boundary:
            return self._drop_in_backward(u)
        u.weights.release(self)
        self.held.remove(u)  # (units compare by identity; each is held once)
        return NOTHING

    def _drop_in_backward(self, u: Unit) -> Iterator:
        if u.name in self.keep_until_update and u.phase not in ("updating", "updated"):
            yield from u.master.acquire(self, OPTIM)  # == its weights: its update needs them
        if self.lazy and u.master is u.compute and u.name in self.next_keep:
            yield from u.compute.acquire(self, NEXT)  # kept for the next forward's pending update
        u.weights.release(self)
        self.held.remove(u)

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
            yield from self.advance_update(self.submitted + self.optim_prefetch_depth + 1)
            self.submit(job)
            return
        if self.dp:
            yield from dp_grads(self, job, u, idx, rate)
            return
        sliding = self.speculating and self.boundary
        spec = sliding and u.can_speculate
        # the deferred window's: gradients held (applied at the next visit: its first units')
        kept = (self.lazy_index if self.lazy else self.update_index)[u.name] < self.optim_prefetch_depth + 1
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
            job.grads_ready = self.d2h.submit(self.t, grad_bytes, False)
            self.host_pool.put(grad_bytes, job.grads_ready)  # back once the job used it: close enough
        job.before.append(job.grads_ready)
        job.absorb_s = 2 * u.numel * 4 / self.costs.memcpy_bps
        if self.deferred and self.boundary and not spec:
            job.absorb_s += u.numel * 4 / self.costs.memcpy_bps  # the squared norm (speculating: in Adam)
        if self.boundary and not self.deferred:
            yield from self.advance_update(idx + 1)
            yield from self.fill_update(job, u, rate)
            self.submitted += 1
            yield from self.advance_update(self.submitted + self.optim_prefetch_depth + 1)
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
        yield from self.advance_absorb(self.absorbed + self.optim_prefetch_depth + 1)
        if sliding:
            yield from self.slide()

    def slide(self) -> Iterable:
        """optimizer._slide: a speculating window moves on as a unit is handed out."""
        self.submitted += 1
        return self.advance_update(
            self.submitted + self.optim_prefetch_depth + 1, order=self.order, sliding=True
        )

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
        job.writes.extend([s for s in slots if s.stored])
        u.phase = "updating"

    def add_before(self, job: Job, *slots: Slot) -> None:
        for s in slots:
            if s.state == LOADING:
                job.before.append(s.read_done)
            w = s.write_done  # (a Done or None: done_by((w,), self.t), inline)
            if w is not None and (w.t is None or w.t > self.t):
                job.before.append(w)

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
        w = u.weights
        if w.__class__ is PairWeights:  # (the frozen segment takes no update)
            w = w.trainable
        refresh = self.cuda and isinstance(w, CudaWeights) and w.resident  # (a resident device copy)
        if job.lazy:
            self.lazy_inflight.discard(u.name)
            u.compute.updating = False
            if refresh:
                w.copy_done = self.h2d.submit(self.t, u.compute_bytes, False)
            # the compute copy first: with fp32 it is the master's slot, and the release that names
            # the refresh's copy must find the buffer still held (runtime/optimizer_completion.py _complete)
            u.compute.release(self, OPTIM, after=w.copy_done if refresh else 0.0)
            for s in (u.master, u.exp_avg, u.exp_avg_sq, u.grads):
                s.release(self, OPTIM)
        elif job.update:
            after = 0.0
            if refresh:
                w.copy_done = self.h2d.submit(self.t, u.compute_bytes, False)
                after = w.copy_done
            if u.name in (self.spec_next_keep if job.speculative else self.next_keep):
                u.compute.holds.add(NEXT)
            u.compute.release(self, OPTIM, after=after)  # (first: as above)
            for s in (u.master, u.exp_avg, u.exp_avg_sq) + (() if job.keep_grads else (u.grads,)):
                s.release(self, OPTIM)
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
            s.wrote(self.ssd.submit(self.t, s.nbytes, True, s.key))
            s.release(self, WRITE)

    def run_deferred(self) -> Iterator:
        todo = [u for u in self.update_order if not u.speculated]
        self.update_cursor = 0
        for i, u in enumerate(todo):
            yield from self.advance_update(i + self.optim_prefetch_depth + 1, with_grads=True, order=todo)
            job = Job(u, defer_writes=i == len(todo) - 1)
            job.defer_moments = self.optim_prefetch_depth + 1 >= len(self.update_order)
            yield from self.fill_update(job, u, self.costs.adam_tail_rate)
            self.submit(job)
            self.submitted += 1
            self.reap()

    # ---- the optimizer's worker ---------------------------------------------------------
    def worker(self) -> Iterator:
        while True:
            if not self.queue:
                yield ("idle", self, self)
                if not self.queue:
                    return
            job = self.queue.popleft()
            if not done_by(job.before, self.t):
                yield ("wait", tuple(job.before))
            if job.absorb_s:
                yield ("cpu", job.absorb_s)
            if job.comm_bytes:  # the ranks' reduction of the unit's gradients (dp/sharded_optimizer.py)
                yield ("until", self.net.submit(self.t, job.comm_bytes, False))
            if job.adam_s:
                t0 = self.t
                yield ("cpu", job.adam_s)
                self.adam_busy_s += self.t - t0
            if job.regather_bytes:
                yield ("until", self.net.submit(self.t, job.regather_bytes, False))
            if not job.defer_writes:
                now = [s for s in job.writes if not _late(job, s)] if job.defer_moments else job.writes
                if now and self.costs.io_issue_s:
                    yield ("cpu", len(now) * self.costs.io_issue_s)
                submit, t = self.ssd.submit, self.t
                job.write_done = [(s, submit(t, s.nbytes, True, s.key)) for s in now]
            job.done_t = self.t


# schedule -> its fetch order: the search replays a plan with several activation choices and on a
# slow SSD, each Sim of it with the same schedule (schedule.cached_schedule); keyed by identity,
# the schedule held in the entry so its id is not reused while it is there
_FETCH_ORDERS: dict[int, tuple[Schedule, list]] = {}
_FETCH_ORDERS_MAX = 64


def _fetch_order(sched: Schedule) -> list[tuple[str, ...]]:
    """Per visit, the units `alive` holds as the executor fetches them: in the order of need,
    units kept between two uses last."""
    e = _FETCH_ORDERS.get(id(sched))
    if e is not None and e[0] is sched:
        return e[1]
    # (the order of need at visit i: by the first visit from i on that needs the unit, then its
    # place in that visit's needs; found from the last visit back, one pass)
    visits = sched.visits
    out: list = [()] * len(visits)
    first_need: dict[str, tuple[int, int]] = {}  # unit -> (its next visit needing it, its place there)
    for i in range(len(visits) - 1, -1, -1):
        for pos, n in reversed(list(enumerate(visits[i].needs))):
            first_need[n] = (i, pos)
        alive = sched.alive[i]
        needed = sorted((first_need[n], n) for n in alive if n in first_need)
        names = [n for _, n in needed]
        names.extend(sorted(alive - set(names)))
        out[i] = tuple(names)
    if len(_FETCH_ORDERS) >= _FETCH_ORDERS_MAX:
        _FETCH_ORDERS.pop(next(iter(_FETCH_ORDERS)))
    _FETCH_ORDERS[id(sched)] = (sched, out)
    return out


__all__ = ["Costs", "Sim"]
