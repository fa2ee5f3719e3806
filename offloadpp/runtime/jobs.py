"""The optimizer's jobs: what the single worker thread does for one unit (runtime/optimizer.py
submits them and records what they did).

A job waits for the reads and writes its buffers depend on, adds the unit's gradients into its
fp32 gradient buffer, takes their squared norm where a global quantity needs it, runs the fused
Adam, and starts writing the new state back. It only computes and starts writes; everything
that changes runtime state happens on the main thread when the job is reaped.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.autograd.profiler import record_function

from offloadpp.optim import AdamStep, adam_step_flat, adam_step_pieces, convert_, squared_norm
from offloadpp.optim.kernels import StateCrcs

from .accel import SitedWait
from .slots import Slot
from .unit import Unit


@dataclass
class _Job:
    unit: Unit
    before: list  # reads and writes to wait for before touching the buffers
    grads: Optional[list] = None  # [(index, ParamSlot, tensor)] to add into gbuf
    grads_event: Optional[SitedWait] = None
    staging: Optional[torch.Tensor] = None  # copies: pinned buffer the grads arrived in
    first_micro: bool = True
    # The tensors whose squared norm the job takes (clipping, fp16): one per parameter that has a
    # gradient, in order (views of gbuf, or the gradients themselves), so that the norm is the
    # same whichever way the unit is updated (see Unit.norm_pieces).
    norm: Optional[list] = None
    # (pieces [(start, end, grad)], step, group): one fused Adam call over the pieces that takes
    # their squared norm in the same pass (the pieces' grads are `norm`), instead of a pass of its own.
    fused: Optional[tuple] = None
    gbuf: Optional[torch.Tensor] = None
    update: bool = False
    segments: list = field(default_factory=list)  # [(start, end, step, update, group)] over gbuf
    direct: Optional[list] = None  # [(start, end, step, grad or None, group)]: grads used where they are
    hypers: tuple = ()  # each param group's AdamHyper, as they were when the update was submitted
    step_args: dict = field(default_factory=dict)
    master: Optional[torch.Tensor] = None
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    half: Optional[torch.Tensor] = None
    writes: list = field(default_factory=list)  # [(Slot, buffer, generation)] to put after the job's work
    defer_writes: bool = False  # leave the puts to the main thread's flush_writes()
    defer_moments: bool = False  # only the moments' puts (see run_deferred)
    keep_grads: bool = False  # keep the gradient buffer held after absorbing (update soon)
    speculative: bool = False  # an update during backward, to be validated (speculation.py)
    lazy: bool = False  # a deferred update applied at the unit's next visit (pending.py)
    # CRC-32C in the Adam pass (the Note below): the moments' reads left to it [(stream, check)],
    # and whether the master's and moments' writes are sealed with the CRCs it takes.
    checks: list = field(default_factory=list)
    seal: bool = False
    threads: int = 1
    # Data parallel (runtime/dp/sharded_optimizer.py): run on the worker after the absorb, before
    # Adam (the gradients reduced over the ranks; returns this rank's squared norm or None), and
    # after Adam, before the writes (a resident unit's weights gathered again).
    prepare: Optional[Callable[[_Job], Optional[float]]] = None
    after_update: Optional[Callable[[_Job], None]] = None


# Note: the optimizer's priority on the CPU-as-device. There torch's threads fill every core, and
# an Adam thread at the same priority takes a core from one of them mid-GEMM; the others then wait
# at the parallel region's barrier, so a millisecond of Adam costs more than a millisecond of
# step. At nice 10 the worker (and the kernel's pool helpers, which take their caller's nice
# value) mostly runs where compute leaves the cores idle, and at the end of backward, when the
# main thread waits for it. On CUDA the cores are otherwise idle and the worker keeps its priority.
ADAM_NICE = 10


def _yield_to_compute() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ADAM_NICE)
    except (OSError, AttributeError):
        pass  # not permitted, or not Linux: run at normal priority


def _late(job: _Job, slot: Slot) -> bool:
    return job.defer_moments and (slot is job.unit.exp_avg or slot is job.unit.exp_avg_sq)


# Note: CRC-32C in the Adam pass. The moments are read only for the update, so their reads
# leave the payload CRC to it (TensorStore.get(defer_check=True)): the job claims each read's
# check, the fused kernel takes the CRC of the moments as it loads them and of the master and
# moments as it stores them, and the job settles the checks before anything else: on a mismatch
# it raises there, before any write is started and before the main thread, which waits for the
# job before the unit's weights are used (reap; a pending update: wait_pending), sees the
# result, so nothing computed from bad bytes is written or used; the step fails with the
# store's error (SwapIOError, EBADMSG, naming the key and file). The writes of the master and
# moments are then sealed with the CRCs of the bytes as written (put(crc=)), with no pass of
# the store's. Weights the forward fetches keep the store's own check (the verifier thread).
_SEALS = (("master", "master_out"), ("exp_avg", "exp_avg_out"), ("exp_avg_sq", "exp_avg_sq_out"))


def _state_crcs(job: _Job) -> Optional[StateCrcs]:
    """Claims the job's checks; the CRCs its Adam pass is to take (None: none)."""
    streams = [name for name, check in job.checks if check.claim()]
    job.checks = [(n, c) for n, c in job.checks if n in streams]
    if job.seal and job.after_update is None:  # (data parallel re-gathers after Adam: not sealed)
        streams += [out for _, out in _SEALS]
    if not streams:
        return None
    return StateCrcs(job.master, job.exp_avg, job.exp_avg_sq, streams)


def _seal_of(job: _Job, crcs: Optional[StateCrcs], slot: Slot) -> Optional[int]:
    if crcs is None or not job.seal or job.after_update is not None:
        return None
    u = job.unit
    for name, out in _SEALS:
        if slot is getattr(u, name):
            return crcs.whole(out)
    return None


def put(slot: Slot, generation: int, buf: torch.Tensor, crc: Optional[int]):
    """The write of a slot's buffer (its kind tag: slots.tagged), sealed with `crc` if given
    (None: the store checksums it itself)."""
    return slot.store.put(slot.key_of(generation), buf, crc=crc)


@dataclass
class _Done:
    writes: list  # [(Slot, future, generation)]
    sq_norm: Optional[float]
    adam_s: float
    absorb_s: float
    seals: dict = field(default_factory=dict)  # id(Slot) -> CRC for the writes left to flush_writes


def _work(job: _Job, store) -> _Done:
    for w in job.before:
        w.wait()
    crcs = _state_crcs(job) if job.update else None
    try:
        return _update(job, crcs)
    except BaseException as e:
        for _, check in job.checks if crcs is not None else ():
            check.fail(e)  # claimed and not settled: the bytes are not known to be good
        raise


def _update(job: _Job, crcs: Optional[StateCrcs]) -> _Done:
    sq = None
    t0 = time.perf_counter()
    if job.grads is not None:
        with record_function("offloadpp::grads_to_host"):
            if job.grads_event is not None:
                job.grads_event.wait()
            gb = job.gbuf
            for _, s, g in job.grads:
                dst = gb[s.offset : s.offset + s.numel]
                src = g.reshape(-1)
                if job.first_micro:
                    dst.copy_(src)
                else:
                    dst.add_(src)
            if job.first_micro:
                have = {i for i, _, _ in job.grads}
                for i, (_, s) in enumerate(job.unit.params):
                    if i not in have:
                        gb[s.offset : s.offset + s.numel].zero_()
    if job.norm is not None and job.fused is None:
        sq = squared_norm(job.norm, num_threads=job.threads)
    if job.prepare is not None:
        sq = job.prepare(job)
    t1 = time.perf_counter()
    if job.update and job.fused is not None:
        with record_function("offloadpp::adam"):
            pieces, step, grp = job.fused
            how = AdamStep(step + 1, job.hypers[grp], num_threads=job.threads, **job.step_args)
            sq = adam_step_pieces(
                job.master, job.exp_avg, job.exp_avg_sq, pieces, how, half_out=job.half, crcs=crcs
            )
            for a, b, _, upd, _ in job.segments if job.half is not None else ():
                if not upd:
                    convert_(job.half[a:b], job.master[a:b], num_threads=job.threads)
    elif job.update:
        with record_function("offloadpp::adam"):
            for a, b, step, g, grp in job.direct or ():
                if g is not None:
                    adam_step_flat(
                        job.master[a:b],
                        g.reshape(-1),
                        job.exp_avg[a:b],
                        job.exp_avg_sq[a:b],
                        AdamStep(step + 1, job.hypers[grp], num_threads=job.threads, **job.step_args),
                        half_out=job.half[a:b] if job.half is not None else None,
                        crcs=crcs,
                    )
                elif job.half is not None:
                    convert_(job.half[a:b], job.master[a:b], num_threads=job.threads)
            for a, b, step, upd, grp in job.segments if job.direct is None else ():
                half = job.half[a:b] if job.half is not None else None
                if upd:
                    adam_step_flat(
                        job.master[a:b],
                        job.gbuf[a:b],
                        job.exp_avg[a:b],
                        job.exp_avg_sq[a:b],
                        AdamStep(step + 1, job.hypers[grp], num_threads=job.threads, **job.step_args),
                        half_out=half,
                        crcs=crcs,
                    )
                elif half is not None:
                    convert_(half, job.master[a:b], num_threads=job.threads)
    for name, check in job.checks if crcs is not None else ():
        check.settle(crcs.whole(name))  # raises on a mismatch: before any write (the Note)
    if job.update and job.after_update is not None:
        job.after_update(job)
    t2 = time.perf_counter()
    futs = []
    seals = {id(slot): _seal_of(job, crcs, slot) for slot, _, _ in job.writes}
    if not job.defer_writes:
        with record_function("offloadpp::write_state"):
            futs = [
                (slot, put(slot, g, buf, seals[id(slot)]), g)
                for slot, buf, g in job.writes
                if not _late(job, slot)
            ]
    return _Done(futs, sq, t2 - t1, t1 - t0, seals)
