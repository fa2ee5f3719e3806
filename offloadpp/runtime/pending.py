"""Deferred updates applied at the unit's next visit (a mixin of runtime/optimizer.py's pipeline).

Note: why. With clipping (or the fp16 overflow check) a step's updates wait for the global norm,
so they used to run as a pass of their own after backward: every unit's master, moments and
gradients read, Adam, master and moments written, and then the next forward read the weights
again. Here step() only decides the update (the clip coefficient, the loss scale, each unit's
segments, step counts and hyper-parameters as they are at step(), as torch.optim.step() fixes
them) and leaves it pending on the unit; the next visit of the unit (the next forward's, or an
eval forward's) reads master, moments and gradients once, runs the same fused Adam call the
update pass ran (bit for bit: the same inputs, the same kernel, the same coefficient), and
computes with the weights it just produced. On the CPU device with fp32 compute the weights are
the master: one read serves the update and the forward, and the Adam pass runs beside the
forward instead of after backward.

Note: what needs the step's result first. Anything that reads the state between steps completes
every pending update first (complete_pending): a checkpoint, an export, state_dict, a load, a
backward (its first micro-batch overwrites the gradient buffers), a step that opens a
transaction (a speculating one: its writes go to a new generation, and the pending updates
belong to the completed step, not to it), an aborted step's rollback and close(). The pending
updates write the committed generation, as the update pass did (the step is complete when step()
returns; only where its result lives differs), so a checkpoint taken after step() holds it and a
kill -9 before the next forward resumes from that checkpoint bit for bit.

Note: where it applies. One rank, steps that deferred (not speculated): a speculating step's
validation and redo stay as they were. Over several ranks the weights are gathered from every
rank's shard: they keep the update pass (OptimizerPipeline.lazy is False). On CUDA (the copy
path) the forward's weights are a device copy of the compute copy the update writes: the copy
is made only once the update is done (Slot.updating, set at step() and cleared as the update
completes; device.CopyWeights.pump waits for it), and a resident device copy is refreshed then.

Note: memory. The state is read in a window of q+1 units over the units in forward order, as the
update pass reads it in its own order, and the gradients kept in host memory across the step are
the window's first q+1 units' (the forward's first), so the host buffers held are the update
pass's. A master the weights alias is read only when the forward fetches that unit: it is the
forward's own buffer. Where that is so, the weights backward releases of the units the schedule
keeps across the step (Schedule.next_keep, which its walk counts as held from their backward
visit on) stay for the next forward: its pending update finds its master in memory, as the
update pass found the masters it kept (then the step reads each master once, in backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.autograd.profiler import record_function

from .jobs import _Job
from .slots import Hold
from .unit import Unit


@dataclass
class PendingUpdate:
    """One unit's update, decided at step() and applied at the unit's next visit."""

    segments: list  # Unit.segments() at step(): [(start, end, step, update, group)]
    hypers: tuple  # each param group's AdamHyper at step()
    clip_coef: float
    grad_scale: float


class PendingUpdates:
    """The pending half of OptimizerPipeline: defer_to_visits, apply_pending, complete_pending."""

    def _init_pending(self, lazy_order) -> None:
        self.lazy_order: list[Unit] = list(lazy_order)  # units in forward order
        self._lazy_cursor = 0  # state of lazy_order[:cursor] was read (or needs none)
        self._lazy_submitted = 0  # pending units handed to the worker
        self._lazy_inflight: set[str] = set()

    @property
    def pending(self) -> bool:
        return any(u.pending is not None for u in self.lazy_order)

    def defer_to_visits(self, *, clip_coef: float, grad_scale: float) -> None:
        """At step(), instead of run_deferred: every unit's update is decided and left pending.
        The step counts move on now (the update is the step's), so a window that starts before the
        update is applied begins from them."""
        self._lazy_cursor = self._lazy_submitted = 0
        for u in self.lazy_order:
            segs = u.segments()
            if not any(upd for _, _, _, upd, _ in segs):
                u.grads.release(Hold.OPTIM)  # no parameter of the unit got a gradient: nothing to do
                continue
            u.pending = PendingUpdate(segs, self.hypers, clip_coef, grad_scale)
            u.compute.updating = True  # no device copy of the weights until the update made them
            for a, b, step, upd, _ in segs:
                if upd:
                    for k, (_, s) in enumerate(u.params):
                        if a <= s.offset < b:
                            u.steps[k] = step + 1

    def _lazy_read(self, upto: int) -> None:
        """Reads the state (and the gradients not kept in memory) of the pending units up to
        `upto` in lazy_order; a master the weights alias waits for the forward's fetch."""
        while self._lazy_cursor < min(upto, len(self.lazy_order)):
            u = self.lazy_order[self._lazy_cursor]
            if u.pending is not None:
                with record_function("offloadpp::read_state"):
                    u.exp_avg.acquire(Hold.OPTIM)
                    u.exp_avg_sq.acquire(Hold.OPTIM)
                    u.grads.acquire(Hold.OPTIM)
                    if u.master is not u.compute:
                        u.master.acquire(Hold.OPTIM)
            self._lazy_cursor += 1

    def apply_pending(self, names) -> None:
        """A visit is about to fetch the weights of `names`: the pending updates of those units
        (and of any unit before them in forward order) are handed to the worker, the next q+1
        units' state is read ahead."""
        want = {n for n in names}
        last = max((i for i, u in enumerate(self.lazy_order) if u.name in want and u.pending), default=-1)
        while self._lazy_submitted <= last:
            u = self.lazy_order[self._lazy_submitted]
            self._lazy_submitted += 1
            if u.pending is not None:
                self._submit_pending(u)
        if last >= 0 or self._lazy_submitted:
            self._lazy_read(self._lazy_submitted + self.optim_prefetch_depth + 1)

    def _submit_pending(self, u: Unit) -> None:
        self._lazy_read(self._lazy_submitted)  # (its own state, if the window had not reached it)
        p, u.pending = u.pending, None
        u.master.acquire(Hold.OPTIM)  # where it is the weights: the forward's fetch, read once
        phase = u.phase
        job = _Job(u, before=[], threads=self.threads)
        job.gbuf = u.grads.buffer
        job.lazy = True
        self._fill_update(job, u, clip_coef=p.clip_coef, grad_scale=p.grad_scale, segments=p.segments)
        job.hypers = p.hypers
        u.phase = phase  # the unit's phase is its visit's: the update belongs to the step before
        self._lazy_inflight.add(u.name)
        self._submit(job)

    def wait_pending(self, u: Unit) -> None:
        """Before the unit's weights are bound: its pending update is done."""
        if u.pending is not None:
            self.apply_pending((u.name,))
        while u.name in self._lazy_inflight:
            self._reap_pending()

    def complete_pending(self) -> None:
        """Every pending update applied and done (see the module Note for who calls it)."""
        if self.pending:
            self.apply_pending([u.name for u in self.lazy_order])
        while self._lazy_inflight:
            self._reap_pending()

    def _reap_pending(self) -> None:
        """One in-flight job completed. A pending update counted in flight with no job left to
        wait for was interrupted between the two (a KeyboardInterrupt): waiting would spin
        forever (close() at exit did), so it is said instead; the state on SSD is still the
        last committed step's (the updates write the committed generation only when done)."""
        if not self.reap_one():
            lost, self._lazy_inflight = sorted(self._lazy_inflight), set()
            raise RuntimeError(
                f"offloadpp: the pending updates of {', '.join(lost)} were interrupted before they "
                "reached the optimizer's worker: those units miss the last step's update (resume from a checkpoint)"
            )
