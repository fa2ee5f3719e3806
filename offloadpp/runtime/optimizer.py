"""The optimizer side of a step: gradients into host buffers, the fused CPU Adam on a worker
thread, the new state written back, all while backward goes on.

Note: the flow of one unit. Its gradients are complete when every parameter's
post-accumulate-grad hook has fired (or backward ended). The main thread then takes them off
the parameters (on CUDA, starts their copy to a pinned buffer) and submits a job to the single
worker: add them into the unit's fp32 gradient buffer (copy on the first micro-batch of a
window), take their squared norm if a global quantity is needed, and, on an accumulation
boundary without a deferred update, run Adam over the unit's master weights and moments, which
were read from SSD ahead of time, and start writing master, moments and, with 16-bit compute,
the new compute copy back. Jobs run in submission order. The main thread reaps finished jobs at
every visit: it records the writes on the slots and drops its holds, so buffers go back to the
pool (reusable once the writes are done).

Note: the read-ahead window. State is read for the units `update_order[s-1 .. s+q]` once s
updates are submitted: the first q+1 units' state at the start of the boundary micro-batch's
forward (deferred updates: of its backward, see begin_backward), then one more each time a unit
is submitted. Gradients kept on SSD between micro-batches
use the same window on every micro-batch.

Note: deferred updates (clipping, fp16). The global norm (and the overflow check) need every
gradient first. During backward the jobs only absorb gradients and take norms. The updates
then run after backward, largest unit first (`update_order`): the window's first q+1 units have
their state read during backward (begin_backward) and their gradients kept in memory; the others'
gradients are written to SSD (where they live there) and read back with their state, q ahead.
Exact torch semantics, at the cost of running Adam and part of the state traffic after backward
instead of during it (docs/runtime.md has the numbers).

Note: speculative updates (runtime/speculation.py). A speculating step reads state as updates
that are not deferred do, q units ahead in the order gradients complete (from the start of
backward), and updates each unit as its gradients complete, with the raw gradients, its norm
taken in the Adam pass, its writes going to the new generation. With clipping (a step may be
redone) its gradients stay until the step is validated: in memory for the deferred window's units
(update_order[:q+1], as deferring keeps them), at their home for the others. Units whose state
lives in memory, and a redo, are updated after backward as deferred updates are (run_deferred).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
from torch.autograd.profiler import record_function

from offloadpp.optim import AdamHyper
from offloadpp.planner.decide import lazy_runtime
from offloadpp.planner.plan import Plan
from offloadpp.planner.schedule import Schedule

from .device import Device
from .jobs import _Job, _work, _yield_to_compute
from .memory import BufferPool
from .optimizer_completion import JobCompletion
from .pending import PendingUpdates
from .slots import Hold, Slot
from .unit import Unit, UnitPhase


class OptimizerPipeline(JobCompletion, PendingUpdates):
    def __init__(
        self,
        units: list[Unit],
        schedule: Schedule,
        plan: Plan,
        hypers: tuple[AdamHyper, ...],
        store,
        host_pool: BufferPool,
        device: Device,
    ):
        """units: the engine's, in forward order; the orders, the read-ahead and what is kept
        after an update are the schedule's, the rest the plan's decisions: deferred updates,
        a redo of a speculative step that clips (Plan.clipping: it keeps its gradients until
        validated), updates applied at each unit's next visit in forward order (decide.lazy_runtime,
        runtime/pending.py), the Adam threads."""
        by_name = {u.name: u for u in units}
        self.order = [by_name[n] for n in schedule.absorb_order]  # the order gradients complete in (backward)
        self.update_order = [by_name[n] for n in schedule.update_order]
        self.optim_prefetch_depth = schedule.optim_prefetch_depth
        self.next_keep = schedule.next_keep
        self.spec_next_keep = schedule.spec_next_keep  # what a speculative update keeps
        self.hypers = hypers  # one per param group; Unit.groups says which each parameter takes
        self.store = store
        self.host_pool = host_pool
        self.device = device
        self.deferred = plan.deferred_update
        self.separate = plan.separate_weights
        self.redo = plan.clipping
        if plan.adam_threads is None:
            raise ValueError("the plan has no adam_threads (OffloadEngine fills them: decide.adam_threads)")
        threads = self.threads = plan.adam_threads
        self.tail_threads = max(threads, len(os.sched_getaffinity(0)))
        self._worker = ThreadPoolExecutor(
            1, thread_name_prefix="offloadpp-adam", initializer=None if device.copies else _yield_to_compute
        )
        self._freer = ThreadPoolExecutor(
            1, thread_name_prefix="offloadpp-free", initializer=None if device.copies else _yield_to_compute
        )
        self._jobs: deque[tuple[_Job, Future]] = deque()
        self._drops: deque[Future] = deque()  # gradients handed to the freer, oldest first
        # On the CPU device the gradients autograd leaves are the device's memory: charged to
        # its pool until dropped (_charge_grads), set by the engine; None elsewhere.
        self.grad_pool: Optional[BufferPool] = None
        self._queued_writes: list[tuple[Slot, torch.Tensor, int, Optional[int]]] = []  # see flush_writes
        self.boundary = False
        self.first_micro = True
        self.speculating = False  # this window's deferred updates run speculatively (speculation.py)
        self._spec_asked = False  # (asked for the window; speculating: on its boundary)
        self.grad_scale = 1.0  # fp16: the loss scale the speculative updates divide by
        # a vertical window's gradient dtype, set for it (Plan.window_grad_dtype); None: the slots' own
        self.window_grads: Optional[torch.dtype] = None
        # deferred windows: the units whose state is read during backward and whose gradients stay
        # in memory until their update (update_order[:q+1]); a speculating step keeps theirs too
        self._kept: frozenset = frozenset()
        self._absorb_cursor = 0
        self._update_cursor = 0
        self._absorbed = 0
        self._submitted = 0
        self.adam_s = 0.0
        self.absorb_s = 0.0
        self.lazy = lazy_runtime(plan) and self.deferred
        fwd = schedule.forward_index
        self._init_pending([by_name[n] for n in sorted(fwd, key=fwd.get)])

    # ---- the window ----------------------------------------------------------------------
    def begin_micro(
        self, *, first: bool, boundary: bool, speculate: bool = False, grad_scale: float = 1.0
    ) -> None:
        """At the first forward visit of a micro-batch: start reading what its backward needs.
        speculate: (deferred updates, on the boundary) update during backward with the raw
        gradients divided by grad_scale, to be validated after it (speculation.py)."""
        self.first_micro, self.boundary = first, boundary
        self._spec_asked, self.grad_scale = speculate, grad_scale
        self.speculating = speculate and boundary and self.deferred
        self._absorb_cursor = self._update_cursor = self._absorbed = self._submitted = 0
        if first:
            for u in self.order:
                u.start_window()
        if not self.pending:  # (else at begin_backward: the pending updates read the gradients first)
            self._advance_absorb(self.optim_prefetch_depth + 1)
        if boundary and not self.deferred:
            self._advance_update(self.optim_prefetch_depth + 1)

    def set_boundary(self, boundary: bool) -> None:
        """The micro-batch whose forward began as (not) the end of the window turns out otherwise
        (before its backward): start reading the state its updates need, or drop what was read
        for updates that will not run now."""
        if boundary == self.boundary:
            return
        self.boundary = boundary
        self.speculating = self._spec_asked and boundary and self.deferred
        if self.deferred:
            return  # a deferred update's state is read from begin_backward on
        if boundary:
            self._advance_update(self.optim_prefetch_depth + 1)
            return
        for u in self.update_order[: self._update_cursor]:
            for s in (u.master, u.exp_avg, u.exp_avg_sq):
                s.release(Hold.OPTIM)
        self._update_cursor = 0

    def begin_backward(self) -> None:
        """At the start of backward: a deferred update's window is read now, not at forward.

        Note: why not earlier. The previous step's deferred updates write every unit's state
        as that step ends; read at the next forward, the same files would be read back while
        those writes still drain (a read waits for the write of its file). Started here, the
        reads find the writes done and still have all of backward to complete in.
        """
        self.complete_pending()
        self._advance_absorb(self.optim_prefetch_depth + 1)
        if self.lazy and not self.speculating:
            # applied at the next forward's visits (pending.py): the gradients kept in memory are
            # those of its first units, whose state that forward reads first; none is read now
            self._kept = frozenset(u.name for u in self.lazy_order[: self.optim_prefetch_depth + 1])
            return
        self._kept = frozenset(u.name for u in self.update_order[: self.optim_prefetch_depth + 1])
        if self.boundary and self.speculating:
            # the window slides over the order gradients complete in, as where updates are not
            # deferred (holds._speculative_holds)
            self._advance_update(self.optim_prefetch_depth + 1, order=self.order, sliding=True)
        elif self.boundary and self.deferred:
            self._advance_update(self.optim_prefetch_depth + 1)

    def _advance_absorb(self, upto: int) -> None:
        while self._absorb_cursor < min(upto, len(self.order)):
            u = self.order[self._absorb_cursor]
            if u.grads_persist:
                self._acquire_grads(u, overwrite=self.first_micro)
            self._absorb_cursor += 1

    def _acquire_grads(self, u: Unit, *, overwrite: bool) -> None:
        """The gradient buffer held; a window's first gradients (overwrite) in its dtype."""
        if overwrite:
            u.grads.retype(self.window_grads)
        u.grads.acquire(Hold.OPTIM, overwrite=overwrite)

    def _advance_update(
        self, upto: int, *, with_grads: bool = False, order: Optional[list] = None, sliding: bool = False
    ) -> None:
        """Reads the state (and, for a deferred update, the gradients kept so far) of the
        units up to `upto` in `order` (update order); sliding: the window of a speculating step,
        over the order gradients complete in."""
        order = self.update_order if order is None else order
        while self._update_cursor < min(upto, len(order)):
            u = order[self._update_cursor]
            if sliding and not u.can_speculate:
                self._update_cursor += 1  # updated after backward: its state is read then
                continue
            with record_function("offloadpp::read_state"):
                u.master.acquire(Hold.OPTIM)
                u.exp_avg.acquire(Hold.OPTIM)
                u.exp_avg_sq.acquire(Hold.OPTIM)
                if with_grads and u.held_grads is None:
                    u.grads.acquire(Hold.OPTIM)
            self._update_cursor += 1

    # ---- submission ----------------------------------------------------------------------
    def on_grads(self, u: Unit) -> None:
        """A unit's gradients for this micro-batch are complete (main/autograd thread)."""
        idx = self.order.index(u)
        self._advance_absorb(idx + 1)
        grads = u.take_grads()
        last = idx == len(self.order) - 1  # backward is over: Adam may take every core
        speculate = self.speculating and u.can_speculate
        if not speculate:
            self._charge_grads(grads)
        job = _Job(
            u, before=[], first_micro=self.first_micro, threads=self.tail_threads if last else self.threads
        )
        job.defer_writes = last
        u.phase = UnitPhase.GRADS_READY
        if not self.device.copies and not u.grads_persist and self.boundary:
            # Note: on the CPU device the gradients already are in host memory, and without
            # accumulation or a deferred update nothing needs them flat: Adam reads each one
            # where autograd left it (no copy, no buffer).
            self._advance_update(idx + 1)
            self._fill_update(job, u, clip_coef=1.0, grad_scale=1.0, direct=grads)
            self._submitted += 1
            self._advance_update(self._submitted + self.optim_prefetch_depth + 1)
            self._submit(job)
            return
        kept = u.name in self._kept
        if self.speculating:
            self._advance_update(idx + 1, order=self.order, sliding=True)
        if (
            speculate
            and self.first_micro
            and not self.device.copies
            and (not self.redo or last or (kept and not u.grads.resident))
        ):
            # Note: speculated gradients on the CPU device. They already are in host memory, and
            # without accumulation they are the unit's whole gradient: Adam reads them where
            # autograd left them and takes their norm in the same pass. With clipping (a redo may
            # need them) they are kept as they are until the step is validated instead of copied
            # into the gradient buffer that would keep them otherwise (given back: the same
            # bytes, held as long). The last unit's are kept so even where the buffer is
            # resident: its update is the optimizer's time after backward, which without clipping
            # has no copy either.
            if u.grads_persist:
                u.grads.release(Hold.OPTIM)  # (_advance_absorb took the buffer; unused)
            u.held_grads = grads if self.redo else None
            self._speculate(job, u, kept=True, direct=grads)
            self._submit(job)
            self._slide()
            return
        self._acquire_grads(u, overwrite=self.first_micro or not u.grads_persist)
        if self.device.copies and grads:
            job.staging, job.grads_event, grads = self._grads_to_host(grads)
        job.grads = grads
        job.gbuf = u.grads.buffer
        if self.boundary and not self.deferred:
            self._advance_update(idx + 1)
            self._fill_update(job, u, clip_coef=1.0, grad_scale=1.0)
            self._submitted += 1
            self._advance_update(self._submitted + self.optim_prefetch_depth + 1)
        elif speculate:
            self._speculate(job, u, kept=kept)
        elif self.deferred and self.boundary:
            job.norm = u.norm_pieces(job.gbuf)
            if kept:
                job.keep_grads = True  # its update is among the first after backward: no round trip
            elif u.grads.stored:
                job.writes.append((u.grads, u.grads.buffer, u.grads.write_generation()))
        elif u.grads_persist and u.grads.stored:
            job.writes.append((u.grads, u.grads.buffer, u.grads.write_generation()))
        self._add_before(job, u.grads)
        self._submit(job)
        self._absorbed += 1
        self._advance_absorb(self._absorbed + self.optim_prefetch_depth + 1)
        if self.speculating:
            self._slide()

    def _charge_grads(self, grads) -> None:
        """Note: why the gradients count. On the CPU device autograd's gradients are device
        memory outside the pool: the plan holds room for the gradients of one backward visit,
        but where the worker falls behind backward (a loaded machine: it runs at nice 10), each
        unit's stay alive in their job until it has absorbed them, then in the freer's queue:
        1-3 units' more at GPT-2 2.3B, 0.3 GiB each, past the device budget. Charged to the pool
        here and given back when dropped (whichever thread drops them), backward waits at the
        budget for the worker and the freer instead. (A speculated unit's gradients are kept in
        place of its host gradient buffer, which the plan counts: not charged.)"""
        pool = self.grad_pool
        if pool is None or not grads:
            return
        pool.charge_until_dropped(g for _, _, g in grads)

    def reclaim(self) -> bool:
        """A pool short of room (memory.py's Note): the oldest job completed, else the oldest
        drop of gradients waited for. False when neither is under way."""
        if self.reap_one():
            return True
        while self._drops:
            f = self._drops.popleft()
            if not f.done():
                f.result()
                return True
        return False

    def _slide(self) -> None:
        """A speculating window: one more unit handed out, the state window moves on."""
        self._submitted += 1
        self._advance_update(self._submitted + self.optim_prefetch_depth + 1, order=self.order, sliding=True)

    def _speculate(self, job: _Job, u: Unit, *, kept: bool, direct: Optional[list] = None) -> None:
        """The unit's update with the raw gradients, its norm taken in the same pass; its writes
        go to the new generation (the step's transaction is open). With clipping (a redo may
        follow) its gradients stay until the step is validated: held where `kept` (the deferred
        window's units: deferring holds them too), else written to their home, to be read back by
        a redo. Without (fp16 alone: an overflow skips the step) they are let go after it."""
        job.keep_grads = kept and self.redo
        job.speculative = True
        if self.redo and not kept and direct is None and u.grads.stored:
            job.writes.append((u.grads, u.grads.buffer, u.grads.write_generation()))
        self._fill_update(job, u, clip_coef=1.0, grad_scale=self.grad_scale, direct=direct, norm=True)
        u.speculated = True

    def _grads_to_host(self, grads):
        dev = self.device
        total = sum(s.numel for _, s, _ in grads)
        staging = self.host_pool.get(total, grads[0][2].dtype)
        out = []
        off = 0
        a = dev.accel
        a.wait_stream(dev.d2h, dev.compute_stream(), site="grads.out_after_compute")
        for i, s, g in grads:
            view = staging[off : off + s.numel]
            a.copy(view, g.reshape(-1), dev.d2h)
            a.record_use(g, dev.d2h, site="grads.keep")  # autograd's gradient, dropped below
            out.append((i, s, view))
            off += s.numel
        ev = a.record(dev.d2h)
        dev.d2h_bytes += total * staging.element_size()
        return staging, a.after(ev, site="grads.out_done"), out

    def _fill_update(
        self,
        job: _Job,
        u: Unit,
        *,
        clip_coef: float,
        grad_scale: float,
        direct: Optional[list] = None,
        norm: bool = False,
        segments: Optional[list] = None,
    ) -> None:
        """An update job; norm: it also takes the gradients' norm (fused into Adam where every
        updated parameter is at the same step, else a pass of its own first); segments: the
        unit's segments decided earlier (a pending update), else Unit.segments() now."""
        job.update = True
        u.phase = UnitPhase.UPDATING
        job.hypers = self.hypers
        job.step_args = dict(clip_coef=clip_coef, grad_scale=grad_scale)
        if direct is not None:
            by_index = {i: g for i, _, g in direct}
            job.direct = [
                (s.offset, s.offset + s.numel, u.steps[i], by_index.get(i), u.groups[i])
                for i, (_, s) in enumerate(u.params)
            ]
            job.segments = [(a, b, step, g is not None, grp) for a, b, step, g, grp in job.direct]
        else:
            job.segments = u.segments() if segments is None else segments
            job.gbuf = u.grads.buffer if job.gbuf is None else job.gbuf
            self._add_before(job, u.grads)
        job.master = u.master.buffer
        job.exp_avg, job.exp_avg_sq = u.exp_avg.buffer, u.exp_avg_sq.buffer
        self._add_before(job, u.master, u.exp_avg, u.exp_avg_sq)
        # CRC-32C in the Adam pass (jobs.py, the Note): the moments' reads, and the writes' seals
        job.checks = [
            (f"{s.name.rsplit('.', 1)[1]}_in", s.check) for s in (u.exp_avg, u.exp_avg_sq) if s.check
        ]
        job.seal = bool(getattr(getattr(self.store, "config", None), "checksum", False))
        done = u.weights.copy_done(site="optimizer.write_after_copy") if self.device.copies else None
        if done is not None:
            job.before.append(done)  # a copy to the device may still read the buffer
        if self.separate:
            u.compute.acquire(Hold.OPTIM, overwrite=True)
            self._add_before(job, u.compute)
            job.half = u.compute.buffer
        if norm:
            job.norm = u.norm_pieces(job.gbuf, direct)
            ranges = [
                (s.offset, s.offset + s.numel, u.steps[i], u.groups[i])
                for i, (_, s) in enumerate(u.params)
                if u.got_grad[i]
            ]
            if ranges and len({(t, g) for _, _, t, g in ranges}) == 1:  # one Adam call: one step, one group
                job.fused = (
                    [(a, b, g) for (a, b, _, _), g in zip(ranges, job.norm)],
                    ranges[0][2],
                    ranges[0][3],
                )
        if not any(upd for _, _, _, upd, _ in job.segments):
            return  # no parameter of the unit got a gradient: nothing changed, nothing to write
        for s in (u.master, u.exp_avg, u.exp_avg_sq) + ((u.compute,) if self.separate else ()):
            if s.stored:  # (a compute copy resident on the device has no home: it is copied up only)
                job.writes.append((s, s.buffer, s.write_generation()))

    @staticmethod
    def _add_before(job: _Job, *slots: Slot) -> None:
        for s in slots:
            for w in (s.pending_read, s.pending_write):
                if w is not None and all(w is not x for x in job.before):
                    job.before.append(w)

    def _submit(self, job: _Job) -> None:
        self._jobs.append((job, self._worker.submit(_work, job, self.store)))

    def run_deferred(self, *, clip_coef: float, grad_scale: float) -> None:
        """After backward, in deferred mode: the updates of the units not updated yet (all, but
        for those a validated speculation updated), in update order, state read ahead."""
        todo = [u for u in self.update_order if not u.speculated]
        self._update_cursor = 0  # state of the first units is held already; now their grads too
        for i, u in enumerate(todo):
            self._advance_update(i + self.optim_prefetch_depth + 1, with_grads=True, order=todo)
            job = _Job(u, before=[], threads=self.tail_threads)
            job.defer_writes = i == len(todo) - 1
            # Note: with every unit's state in the window (q covers them all) the moments stay
            # held anyway until the last update; their writes then wait for flush_writes, so
            # the masters, which the next forward reads back, are not queued behind them.
            job.defer_moments = self.optim_prefetch_depth + 1 >= len(self.update_order)
            if u.held_grads is not None:  # kept where autograd left them (a redo of the last unit)
                self._fill_update(job, u, clip_coef=clip_coef, grad_scale=grad_scale, direct=u.held_grads)
            else:
                job.gbuf = u.grads.buffer
                self._fill_update(job, u, clip_coef=clip_coef, grad_scale=grad_scale)
            self._submit(job)
            self._submitted += 1
            self.reap()

    def skip_update(self) -> None:
        """fp16 overflow: no update; what was read for it is dropped."""
        self.finish()
        for u in self.order:
            for s in u.slots:
                s.release(Hold.OPTIM)
            u.phase = UnitPhase.IDLE
        self.release_grads()

    # ---- speculation (speculation.py) ------------------------------------------------------
    def speculated(self) -> list[Unit]:
        return [u for u in self.order if u.speculated]

    def forget(self, units: list[Unit], steps: dict) -> None:
        """The speculative updates of `units` are forgotten (a redo or a skip follows): their
        queued writes are dropped, their slots go back to the committed generation, their step
        counts to `steps[name]`. Their gradients stay held."""
        self.finish()
        self.drop_uncommitted_writes()
        for u in units:
            u.forget_update(steps[u.name])
            u.phase = UnitPhase.GRADS_READY

    def release_grads(self) -> None:
        """The step is over: the gradients kept for a redo are let go (autograd's, on the thread
        that frees gradients)."""
        for u in self.order:
            if u.speculated:
                u.grads.release(Hold.OPTIM)
            if u.held_grads is not None:
                self._drops.append(self._freer.submit(u.held_grads.clear))
                u.held_grads = None

    def close(self) -> None:
        try:
            errors = self.finish_all()
            self.flush_writes()
            if errors:
                raise errors[0]
        finally:
            self._worker.shutdown(wait=True)
            self._freer.shutdown(wait=True)
