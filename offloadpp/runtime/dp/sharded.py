"""Units over several data-parallel ranks, ZeRO-style: each rank owns one shard of every unit.

Note: what a rank holds (planner/plan.py, "shards"). A unit's flat buffer of F = N * S elements
is cut into N shards of S; rank r owns [r*S, (r+1)*S). Its master weights, Adam moments and, at
home, compute weights are that shard only, in its own swap directories (distributed.rank_dirs),
so the ranks together keep what one process keeps. The device computes with the whole unit:
`GatheredWeights` reads the rank's shard from its home and all-gathers the others' into a full
buffer before the unit's visit. Gradients are whole: each micro-batch's are absorbed into a
full fp32 buffer (`accum`, kept between micro-batches with accumulation), and at the boundary
reduce-scattered into this rank's shard (`grads`), which its Adam update reads
(runtime/dp/sharded_optimizer.py).

Note: parameters cut by a shard. A shard boundary may fall inside a parameter; Adam is
elementwise, so a rank updates its part of each parameter with that parameter's step count,
and every rank keeps every parameter's step count (they move together: a parameter that got a
gradient on any rank is updated on all, as torch.optim updates a parameter whose grad exists).
"""

from __future__ import annotations

from typing import Optional

import torch

from offloadpp.optim import convert_
from offloadpp.planner import Plan, Tier

from ..device import Device
from ..memory import BufferPool
from ..partition import UnitLayout
from ..slots import Hold, Slot, SlotState, Txn, tagged
from ..state import fill_unit
from ..unit import Unit
from .distributed import DataParallel


class GatheredWeights:
    """A unit's whole weights on the device, gathered from every rank's shard of its compute
    copy (`source`, this rank's, read from its home). resident: the full buffer lives for the
    run and the optimizer's worker gathers it again after each update (ShardedOptimizerPipeline).
    A device.Weights; LOADING: the gather is in flight on the fetch channel."""

    def __init__(self, unit: ShardedUnit, source: Slot, device: Device, pool: BufferPool, dp: DataParallel,
                 *, resident: bool):  # fmt: skip
        self.unit = unit
        self.source = source
        self.device = device
        self.pool = pool
        self.dp = dp
        self.resident = resident
        self.tensor: Optional[torch.Tensor] = None
        self.state = SlotState.EMPTY
        self._fut = None
        self._event = None  # copies: recorded after the gather, on the h2d stream

    # ---- the executor's interface (CpuWeights / CopyWeights) -----------------------------------
    def acquire(self) -> None:
        if self.state is not SlotState.EMPTY:
            return
        self.source.acquire(Hold.COMPUTE)
        self.tensor = self._alloc()
        read, shard = (
            self.source.pending_read,
            self.source.buffer,
        )  # (read here: the slot is the main thread's)
        self._fut = self.dp.fetch.submit(self._gather, read, shard, self.tensor)
        self.state = SlotState.LOADING

    def pump(self) -> None:
        pass  # the fetch channel issues each gather as soon as its shard is read

    def wait(self) -> torch.Tensor:
        if self.state is SlotState.EMPTY:
            raise RuntimeError(f"{self.source.key}: gathered weights waited on before being fetched")
        if self.state is SlotState.LOADING:
            self._settle()
        if self.device.copies:
            return self.device.use_on_compute(
                self.tensor, self._event, site="gathered.bind", keep_site="gathered.keep"
            )
        return self.tensor

    def release(self) -> None:
        if self.resident or self.state is SlotState.EMPTY:
            return
        if self.state is SlotState.LOADING:
            self._settle()  # a buffer under a collective in flight is not given back
        self._free()
        self.state = SlotState.EMPTY

    def refresh(self) -> None:
        pass  # the worker gathers a resident unit after its update, in its place in the job order

    def regathered(self, event) -> None:
        """A resident unit gathered again in place (after its update, or a checkpoint's load):
        the next bind's compute, and the host shard's reuse (`last_copy`), wait for `event`
        (place_and_gather's; None without copies)."""
        if not self.resident:
            raise RuntimeError(
                f"{self.source.key}: only resident gathered weights are gathered again in place"
            )
        self._event = event

    @property
    def last_copy(self):
        return self.copy_done(site="gathered.host_reuse")

    def copy_done(self, *, site: str):
        """The pool Waitable of the last gather's copy from the host shard (None: none)."""
        return self.device.after(self._event, site=site)

    # ---- internals ---------------------------------------------------------------------
    def _alloc(self) -> torch.Tensor:
        u = self.unit
        if self.device.copies:  # (for the h2d stream, which copies the shard in and gathers)
            return self.device.alloc(u.padded_numel, u.compute_dtype, self.source.key, stream=self.device.h2d)
        return self.pool.get(u.padded_numel, u.compute_dtype)

    def _free(self) -> None:
        if self.device.copies:
            self.device.dealloc(self.tensor, site="gathered.free")
        else:
            self.pool.put(self.tensor)
        self.tensor = None
        self._event = None

    def _settle(self) -> None:
        self._event = self._fut.result()
        self._fut = None
        self.source.wait()  # (its read is done: this only records it)
        self.source.release(Hold.COMPUTE, after=(self.last_copy,))
        self.state = SlotState.READY

    def _gather(self, read, shard: torch.Tensor, full: torch.Tensor):
        """On the fetch channel's thread: this rank's shard into place, then every other's."""
        if read is not None:
            read.wait()
        return place_and_gather(self.unit, shard, full, self.dp, self.device, worker=False)

    def load_resident(self, full: torch.Tensor) -> None:
        """Setup of a resident unit: its whole compute weights, already complete on every rank."""
        self.tensor = self._alloc()
        self.tensor.copy_(full)
        self.state = SlotState.READY


def place_and_gather(u: ShardedUnit, shard: torch.Tensor, full: torch.Tensor, dp: DataParallel, device: Device,
                     *, worker: bool):  # fmt: skip
    """Copies this rank's shard (host) into its place in `full` (the device's) and all-gathers
    the others'; with copies returns the event after it (on the h2d stream), else None."""
    lo, hi = u.lo, u.hi
    if not device.copies:
        full[lo:hi].copy_(shard)
        dp.gather_in_place(full, lo, hi, worker=worker)
        return None
    accel, stream = device.accel, device.h2d
    accel.copy(full[lo:hi], shard, stream)
    accel.run_on(stream, lambda: dp.gather_in_place(full, lo, hi, worker=worker), out=full)
    ev = accel.record(stream)
    device.h2d_bytes += shard.numel() * shard.element_size()
    return ev


class ShardedUnit(Unit):
    """A Unit whose master, moments and compute copy are this rank's shard (module Note)."""

    def __init__(self, layout: UnitLayout, plan: Plan, device: Device, store, *,
                 device_pool: BufferPool, host_pool: BufferPool, txn: Optional[Txn] = None,
                 dp: DataParallel):  # fmt: skip
        placement = self._init_common(layout, plan, device)
        if plan.ranks != dp.world:
            raise ValueError(f"the plan is for {plan.ranks} ranks, the run has {dp.world}")
        self.dp = dp
        spec = plan.unit(self.name)
        self.shard_numel = S = spec.shard_numel
        self.padded_numel = spec.padded_numel  # the gathered buffer, and the whole gradients
        self.lo, self.hi = dp.rank * S, (dp.rank + 1) * S
        homes = plan.homes(plan.unit(self.name), placement)

        def slot(array: str, numel: int, dtype: torch.dtype, transactional: bool = True) -> Slot:
            home = homes[array]
            resident = home is Tier.HOST or home is Tier.DEVICE
            return Slot(f"{self.name}.{array}", numel, dtype, host_pool, tagged(store, array, plan), resident=resident,
                        stored=home is Tier.SSD, txn=txn if transactional else None)  # fmt: skip

        # Every shard is host memory; the device holds the gathered weights (device_pool on the
        # CPU acting as the device, device memory on CUDA).
        self.master = slot("master", S, torch.float32)
        self.compute = self.master if not plan.separate_weights else slot("weights", S, self.compute_dtype)
        self.exp_avg = slot("exp_avg", S, torch.float32)
        self.exp_avg_sq = slot("exp_avg_sq", S, torch.float32)
        self.accum = slot("grads", self.padded_numel, torch.float32, transactional=False)
        self.grads = slot("grad_shard", S, torch.float32, transactional=False)
        self.accum_persist = plan.accumulate_grads
        self.grads_persist = plan.persistent_grads
        self.weights = GatheredWeights(self, self.compute, device, device_pool, dp,
                                       resident=placement.weights is Tier.DEVICE)  # fmt: skip
        self.can_speculate = False  # several ranks never speculate (planner/resolve.py)

    def __repr__(self) -> str:
        return f"ShardedUnit({self.name!r}, [{self.lo}, {self.hi}), {self.phase.value}, bound={self.bound})"

    @property
    def slots(self) -> tuple[Slot, ...]:
        return super().slots + (self.accum,)

    @property
    def valid(self) -> int:
        """Elements of this rank's shard that hold parameters (the rest is padding)."""
        return max(0, min(self.hi, self.numel) - self.lo)

    def shard_segments(self, got: list[bool]) -> list[tuple[int, int, int, bool, int]]:
        """Unit.segments() cut to this rank's shard, relative to it: (start, end, step, update,
        group), with `got` the parameters that received a gradient on any rank."""
        runs: list[tuple[int, int, int, bool, int]] = []
        for i, (_, s) in enumerate(self.params):
            a, b = max(s.offset, self.lo), min(s.offset + s.numel, self.hi)
            if a >= b:
                continue
            a, b, upd, step, grp = a - self.lo, b - self.lo, got[i], self.steps[i], self.groups[i]
            last = runs[-1] if runs else None
            if (
                last is not None
                and last[1] == a
                and last[3] == upd
                and (not upd or (last[2], last[4]) == (step, grp))
            ):
                runs[-1] = (last[0], b, step, upd, grp)
            else:
                runs.append((a, b, step, upd, grp))
        return runs

    # ---- the whole master, for exports (a collective: every rank calls it, unit by unit) --------
    def export_master(self, with_frozen: bool = True) -> torch.Tensor:  # (no frozen segment over ranks)
        self.master.acquire(Hold.EXPORT)
        shard = self.master.wait()
        full = self.master.pool.get(self.padded_numel, torch.float32)
        full[self.lo : self.hi].copy_(shard)
        self.dp.fetch.run(self.dp.gather_in_place, full, self.lo, self.hi)
        self._exported = full
        return full

    def end_export(self) -> None:
        full = getattr(self, "_exported", None)
        if full is not None:
            self.master.pool.put(full)
            self._exported = None
        self.master.release(Hold.EXPORT)


def initialize_sharded_units(units: list[ShardedUnit], modules: dict, init_fn, meta: bool, source, prefix: str,
                             dp: DataParallel) -> list[str]:  # fmt: skip
    """Each unit's first master shard (and compute copy) at its homes: the whole unit's fp32
    weights made as one process makes them (state.fill_unit), then rank 0's broadcast to every
    rank (DeepSpeed's zero.Init does the same), so a random init agrees. Returns the parameters
    the source lacked."""
    missing: list[str] = []
    for u in units:
        full = u.master.pool.get(u.padded_numel, torch.float32)
        try:
            full[u.numel :].zero_()
            missing += fill_unit(u, full, modules, init_fn, meta, source, prefix)
            dp.broadcast(full, src=0)
            m = u.master
            if m.resident:
                m.make_resident(full[u.lo : u.hi])
            else:
                m.acquire(Hold.EXPORT, overwrite=True)
                m.buffer.copy_(full[u.lo : u.hi])
                g = m.write_generation()
                m.wrote(m.store.put(m.key_of(g), m.buffer), g)
            if u.compute is not m:
                c = u.compute
                if c.resident:
                    c.make_resident()
                else:
                    c.acquire(Hold.EXPORT, overwrite=True)
                convert_(c.buffer, m.buffer)
                if c.stored:
                    g = c.write_generation()
                    c.wrote(c.store.put(c.key_of(g), c.buffer), g)
                c.release(Hold.EXPORT)
            for s in (u.exp_avg, u.exp_avg_sq, u.grads, u.accum):
                if s.resident:
                    s.make_resident()
            if u.weights.resident:
                u.weights.load_resident(
                    full.to(u.compute_dtype) if u.compute_dtype != torch.float32 else full
                )
            m.release(Hold.EXPORT)
        finally:
            u.master.pool.put(full)
    return missing


__all__ = ["GatheredWeights", "ShardedUnit", "initialize_sharded_units", "place_and_gather"]
