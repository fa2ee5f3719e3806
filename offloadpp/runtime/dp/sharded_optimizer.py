"""The optimizer pipeline over data-parallel ranks: each rank updates its shard of every unit.

Note: the flow of one unit (OptimizerPipeline's, with the ranks in it). Its gradients complete
in backward as on one rank; the main thread hands them to the worker, which adds them into the
unit's whole fp32 gradient buffer (`accum`: kept between micro-batches with accumulation, so
the ranks reduce only at the boundary). On the boundary micro-batch the same job then, on the
worker's own process group (distributed.py, "channels"): agrees with the other ranks on which
parameters got a gradient (any rank's counts, as torch.optim updates a parameter whose grad
exists), reduce-scatters the buffer into this rank's shard (the mean over the ranks), takes the
shard's squared norm where a global quantity is needed, and runs Adam over the shard's master
and moments, read ahead as on one rank; a unit whose weights are resident on the device is then
gathered again from every rank's new shard. All of it overlaps the backward of the units before.

Note: clipping and fp16 overflow. The global norm is the norm of the reduced gradients: each
rank sums its shards' squared norms, and one all-reduce at step() sums the ranks' (inf and nan
carry through a sum, so the overflow flag comes with it); then every rank runs the same
deferred updates on its shards, exactly as one process would on the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from offloadpp.optim import squared_norm

from ..accel import Event
from ..jobs import _Job
from ..optimizer import OptimizerPipeline
from ..slots import Hold
from ..unit import UnitPhase
from .distributed import DataParallel
from .sharded import ShardedUnit, place_and_gather


@dataclass
class _ShardJob(_Job):
    shard: Optional[torch.Tensor] = None  # this rank's reduced gradients (the boundary's job)
    got: Optional[list] = None  # which parameters got a gradient: this rank's, then every rank's
    shard_norm: bool = False
    compute_done: Optional[Event] = None  # copies: backward's reads of resident weights


class ShardedOptimizerPipeline(OptimizerPipeline):
    def __init__(self, *args, dp: DataParallel, **kwargs):
        super().__init__(*args, **kwargs)
        self.dp = dp

    def _advance_absorb(self, upto: int) -> None:
        while self._absorb_cursor < min(upto, len(self.order)):
            u = self.order[self._absorb_cursor]
            if u.accum_persist:
                u.accum.acquire(Hold.OPTIM, overwrite=self.first_micro)
            self._absorb_cursor += 1

    def begin_micro(
        self, *, first: bool, boundary: bool, speculate: bool = False, grad_scale: float = 1.0
    ) -> None:
        # (several ranks never speculate: planner/resolve.py turns it off)
        super().begin_micro(first=first, boundary=boundary, speculate=False, grad_scale=grad_scale)
        self._ready: set[str] = set()
        self._next = 0

    def on_grads(self, u: ShardedUnit) -> None:
        """A unit's gradients for this micro-batch are complete (main/autograd thread).

        Note: in order. The worker's collectives must pair the same unit on every rank, so
        units are handed over in `order` (backward's), whatever order their gradients complete
        in: one that completes early (a parameter unused in this micro-batch on this rank
        only) waits for those before it; backward's end completes the rest in order."""
        self._ready.add(u.name)
        while self._next < len(self.order) and self.order[self._next].name in self._ready:
            self._hand_over(self.order[self._next])
            self._next += 1

    def _hand_over(self, u: ShardedUnit) -> None:
        idx = self.order.index(u)
        self._advance_absorb(idx + 1)
        grads = u.take_grads()
        last = idx == len(self.order) - 1
        job = _ShardJob(u, before=[], first_micro=self.first_micro,
                        threads=self.tail_threads if last else self.threads)  # fmt: skip
        job.defer_writes = last
        u.phase = UnitPhase.GRADS_READY
        acc = u.accum
        acc.acquire(Hold.OPTIM, overwrite=self.first_micro or not u.accum_persist)
        if self.device.copies and grads:
            job.staging, job.grads_event, grads = self._grads_to_host(grads)
        job.grads, job.gbuf = grads, acc.buffer
        self._add_before(job, acc)
        if self.boundary:
            job.prepare = self._reduce
            job.got = list(u.got_grad)
            job.shard_norm = self.deferred
            u.grads.acquire(Hold.OPTIM, overwrite=True)
            self._add_before(job, u.grads)
            job.shard = u.grads.buffer
            if not self.deferred:
                self._advance_update(idx + 1)
                self._fill_update(job, u, clip_coef=1.0, grad_scale=1.0)
                self._submitted += 1
                self._advance_update(self._submitted + self.optim_prefetch_depth + 1)
            elif any(u is w for w in self.update_order[: self._update_cursor]):
                job.keep_grads = True  # its update is among the first after backward
            elif u.grads.stored:
                job.writes.append((u.grads, u.grads.buffer, u.grads.write_generation()))
        elif u.accum_persist and acc.stored:
            job.writes.append((acc, acc.buffer, acc.write_generation()))
        self._submit(job)
        self._absorbed += 1
        self._advance_absorb(self._absorbed + self.optim_prefetch_depth + 1)

    def _fill_update(self, job: _Job, u: ShardedUnit, *, clip_coef: float, grad_scale: float,
                     direct: Optional[list] = None, norm: bool = False) -> None:  # fmt: skip
        job.update = True
        u.phase = UnitPhase.UPDATING
        job.hypers = self.hypers
        job.step_args = dict(clip_coef=clip_coef, grad_scale=grad_scale)
        if job.prepare is None:  # a deferred update: the ranks agreed in backward (_complete)
            job.segments = u.shard_segments(u.got_grad)
            job.gbuf = u.grads.buffer
            self._add_before(job, u.grads)
        else:
            job.segments = None  # the worker cuts them once the ranks agree (_reduce)
        job.master = u.master.buffer
        job.exp_avg, job.exp_avg_sq = u.exp_avg.buffer, u.exp_avg_sq.buffer
        self._add_before(job, u.master, u.exp_avg, u.exp_avg_sq)
        if self.separate:
            u.compute.acquire(Hold.OPTIM, overwrite=True)
            self._add_before(job, u.compute)
            job.half = u.compute.buffer
        # (written even where this shard got no gradient: another rank's may have, and the
        # write is what the step commits)
        for s in (u.master, u.exp_avg, u.exp_avg_sq) + ((u.compute,) if self.separate else ()):
            if s.stored:
                job.writes.append((s, s.buffer, s.write_generation()))
        if u.weights.resident:
            job.after_update = self._regather
            if self.device.copies:
                job.compute_done = self.device.accel.record(self.device.compute_stream())

    # ---- on the worker --------------------------------------------------------------------
    def _reduce(self, job: _ShardJob) -> Optional[float]:
        """The boundary's gradients of the unit, summed over the ranks into this rank's shard."""
        u = job.unit
        full = job.gbuf
        full[u.numel :].zero_()  # padding: never absorbed into
        job.got = self.dp.agree_flags(self.order.index(u), job.got)
        self.dp.reduce_scatter(job.shard, full)
        job.gbuf = job.shard
        if job.update:
            job.segments = u.shard_segments(job.got)
        if job.shard_norm:
            return squared_norm(job.shard[: u.valid], num_threads=job.threads)
        return None

    def _regather(self, job: _ShardJob) -> None:
        """A unit resident on the device: every rank's new shard into its whole weights."""
        u = job.unit
        src = job.half if job.half is not None else job.master
        if not self.device.copies:
            place_and_gather(u, src, u.weights.tensor, self.dp, self.device, worker=True)
            return
        accel = self.device.accel
        accel.thread_init()  # (the worker's thread)
        accel.wait_event(self.device.h2d, job.compute_done, site="dp.regather_after_compute")
        u.weights.regathered(place_and_gather(u, src, u.weights.tensor, self.dp, self.device, worker=True))

    # ---- completion (main thread) -----------------------------------------------------------
    def _complete(self, job: _Job, done) -> None:
        u = job.unit
        if getattr(job, "prepare", None) is not None and job.got is not None:
            u.got_grad = list(job.got)  # what every rank agreed on
        if job.update:
            job.segments = u.segments()  # the whole unit's runs: the base counts each parameter's step
        super()._complete(job, done)
        u.accum.release(Hold.OPTIM)


__all__ = ["ShardedOptimizerPipeline"]
