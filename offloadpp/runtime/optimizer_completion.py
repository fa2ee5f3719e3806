"""The completion half of OptimizerPipeline (runtime/optimizer.py): finished jobs reaped on
the main thread (their writes recorded on the slots, their holds dropped so buffers go back to
the pool once the copies and writes that read them are done), and the step's last writes started
late (flush_writes). The main thread's only: the worker never touches a slot's holds.
"""

from __future__ import annotations

from torch.autograd.profiler import record_function

from offloadpp.planner.schedule import flush_rank

from .jobs import _Done, _Job, _late, put
from .slots import Hold
from .unit import UnitPhase


class JobCompletion:
    """reap, finish, _complete, flush_writes, drop_uncommitted_writes of OptimizerPipeline (its
    state: _jobs, _drops, _freer, _queued_writes, host_pool, device, the keeps, adam_s, absorb_s)."""

    def reap(self, block: bool = False) -> None:
        while self._jobs and (block or self._jobs[0][1].done()):
            job, fut = self._jobs.popleft()
            done = fut.result()
            self._complete(job, done)

    def reap_one(self) -> bool:
        """Completes the oldest job, waiting for it (a pool short of room: its state is given
        back). False when no job is in flight."""
        if not self._jobs:
            return False
        job, fut = self._jobs.popleft()
        self._complete(job, fut.result())
        return True

    def finish(self) -> None:
        self.reap(block=True)

    def finish_all(self) -> list[BaseException]:
        """Waits for every job, even past a failed one (an aborted step, close()); returns the
        errors, in order. A failed job leaves its unit's holds to the caller's rollback."""
        errors = []
        while self._jobs:
            try:
                self.reap(block=True)
            except BaseException as e:  # noqa: BLE001 - collected for the caller
                errors.append(e)
        return errors

    def wait_absorbed(self) -> None:
        """Waits for every submitted job (deferred mode: the norms are then known)."""
        self.finish()

    def _complete(self, job: _Job, done: _Done) -> None:
        u = job.unit
        # Note: who frees the gradients. Dropping a large tensor unmaps its pages (milliseconds
        # for an embedding gradient, docs/runtime.md); on the main thread that would sit on the
        # critical path (after backward, before step() returns), and on the worker it would
        # delay the deferred updates queued behind it. A thread of its own drops them, beside
        # the updates.
        grads = [g for _, _, g in job.grads or ()] + [
            g for _, _, _, g, _ in job.direct or () if g is not None
        ]
        job.grads = job.direct = None
        if grads:
            self._drops.append(self._freer.submit(grads.clear))
            while self._drops and self._drops[0].done():
                self._drops.popleft()
        self.adam_s += done.adam_s
        self.absorb_s += done.absorb_s
        for slot, fut, g in done.writes:
            slot.wrote(fut, g)
        for slot, buf, g in job.writes:
            if job.defer_writes or _late(job, slot):  # left to flush_writes
                slot.acquire(Hold.WRITE)
                slot.will_write(g)
                self._queued_writes.append((slot, buf, g, done.seals.get(id(slot))))
        if job.staging is not None:
            self.host_pool.put(job.staging)
        if done.sq_norm is not None:
            u.sq_norm = done.sq_norm
        after = ()
        if (job.lazy or job.update) and self.device.copies and u.weights.resident:
            u.weights.refresh()  # the device's copy takes the new weights
            after = (u.weights.last_copy,)
        # The compute copy goes first, with the refresh's copy still reading it: with fp32 it is
        # the master, whose release without it (it came first) gave the buffer back to the pool
        # with the copy queued, and the device took whatever was read into it next.
        if job.lazy:
            self._lazy_inflight.discard(u.name)
            u.compute.updating = False  # (its device copy may be made now: CopyWeights.pump)
            u.compute.release(Hold.OPTIM, after=after)
            for s in (u.master, u.exp_avg, u.exp_avg_sq, u.grads):
                if s is not u.compute:
                    s.release(Hold.OPTIM)
        elif job.update:
            for a, b, step, upd, _ in job.segments:
                if upd:
                    for k, (_, s) in enumerate(u.params):
                        if a <= s.offset < b:
                            u.steps[k] = step + 1
            if u.name in (self.spec_next_keep if job.speculative else self.next_keep):
                u.compute.acquire(Hold.NEXT)
            u.compute.release(Hold.OPTIM, after=after)
            for s in (u.master, u.exp_avg, u.exp_avg_sq) + (() if job.keep_grads else (u.grads,)):
                if s is not u.compute:
                    s.release(Hold.OPTIM)
            u.phase = UnitPhase.UPDATED
        elif not job.keep_grads:
            u.grads.release(Hold.OPTIM)

    def flush_writes(self) -> None:
        """Starts the writes the step's last update left queued.

        Note: why they wait. The last unit updated (the embeddings, for a language model) is the
        one whose gradients complete last; its master and moments are written as step() returns.
        The disk serves requests roughly in order, so the next forward's first reads would queue
        behind those writes and stall the device. The runtime therefore starts them only once
        the next forward has issued its first fetches (or anything else needs the store: a
        backward, an export, close). The buffers stay held (Hold.WRITE) until then.
        """
        queued, self._queued_writes = self._queued_writes, []
        queued.sort(key=lambda w: flush_rank(w[0].name))  # weights first (schedule.flush_rank)
        with record_function("offloadpp::write_state"):
            for slot, buf, g, crc in queued:
                slot.wrote(put(slot, g, buf, crc), g)  # sealed with the Adam pass's CRC (jobs.py)
                slot.release(Hold.WRITE)

    def drop_uncommitted_writes(self) -> None:
        """An aborted step: queued writes of what it computed are dropped (their slots roll
        back); those of the last completed step are started."""
        keep = [w for w in self._queued_writes if w[2] == w[0]._committed]
        self._queued_writes = keep
        self.flush_writes()
