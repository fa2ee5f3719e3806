"""Unit: the runtime state of one unit, owned in one object (DESIGN.md, convention 8).

A unit holds its parameters (the model's own nn.Parameter objects and where each sits in the
flat buffers), a Slot per array (master, moments, gradients, compute copy), its device weights,
Adam's per-parameter step counts, and its phase in the current step.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
from torch import nn

from offloadpp.planner import Placement, Plan, Tier, flat_numel

from .device import CopyWeights, CpuWeights, Device, PairWeights, UpcastWeights, Weights
from .memory import BufferPool
from .partition import ParamSlot, UnitLayout
from .slots import Hold, Slot, Txn, tagged
from .window_grads import sum_window

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UnitPhase(enum.Enum):
    IDLE = "idle"  # between steps
    FORWARD = "forward"  # its forward visit started
    BACKWARD = "backward"  # its backward visit started, gradients not all there
    GRADS_READY = "grads_ready"  # this micro-batch's gradients were handed to the optimizer side
    UPDATING = "updating"  # its update was submitted
    UPDATED = "updated"  # its update is done: the weights are the new ones


class UnitStateError(RuntimeError):
    pass


class Unit:
    def __init__(
        self,
        layout: UnitLayout,
        plan: Plan,
        device: Device,
        store,
        *,
        device_pool: BufferPool,
        host_pool: BufferPool,
        txn: Optional[Txn] = None,
    ):
        """The unit `layout` lays out, placed where the plan says."""
        placement = self._init_common(layout, plan, device)
        self.padded_numel = flat_numel(self.numel)
        cpu = not device.copies
        alias = not plan.separate_weights
        n = self.padded_numel

        homes = plan.homes(layout.spec(), placement)  # the accounting the plan and the replay share

        def slot(array: str, dtype: torch.dtype, pool: BufferPool, transactional: bool = True) -> Slot:
            home = homes[array]
            # (a unit with no trainable parameter: empty arrays, kept in memory, never read or written)
            resident = home is Tier.HOST or home is Tier.DEVICE or n == 0
            t = txn if transactional else None  # gradients: a new window overwrites them anyway
            return Slot(
                f"{self.name}.{array}",
                n,
                dtype,
                pool,
                tagged(store, array, plan),
                resident=resident,
                stored=home is Tier.SSD,
                txn=t,
            )

        # On the CPU device the compute copy is device memory; with fp32 it is the master itself,
        # drawn from the device pool where the plan counts it there: a master on SSD (fetched as
        # the weights) or one of weights resident on the device (Plan.device_is_master). A master
        # kept in host memory under weights that are not on the device is the plan's host bytes.
        on_device = placement.master is not Tier.HOST or plan.device_is_master(placement)
        master_pool = device_pool if (cpu and alias and on_device) else host_pool
        self.master = slot("master", torch.float32, master_pool)
        if alias:
            self.compute = self.master
        else:
            # The 16-bit compute copy on the CPU device is device memory, but where the plan keeps
            # it in host memory (home HOST: planner/keep.py's "weights@host") it is the plan's host
            # bytes (Plan.resident_host_bytes) and drawn from the host pool: drawn from the device
            # pool, the kept copies filled the device budget and the next streamed unit waited
            # for room that never came (GPT-2 1.31B, bf16, issue 33's A/B).
            on_device = plan.compute_copy_on_device and homes["weights"] is not Tier.HOST
            self.compute = slot("weights", self.compute_dtype, device_pool if on_device else host_pool)
        self.exp_avg = slot("exp_avg", torch.float32, host_pool)
        self.exp_avg_sq = slot("exp_avg_sq", torch.float32, host_pool)
        # read only for the update: their CRC-32C is taken in the Adam pass (runtime/jobs.py)
        self.exp_avg.check_in_adam = self.exp_avg_sq.check_in_adam = True
        self.grads = slot("grads", TORCH_DTYPES[plan.grad_dtype], host_pool, transactional=False)
        self.grads_persist = plan.persistent_grads
        self.weights: Weights
        if device.copies:
            self.weights = CopyWeights(self.compute, device, resident=placement.weights is Tier.DEVICE)
        else:
            self.weights = CpuWeights(self.compute, device)
        if layout.frozen:  # the frozen segment, fetched with the weights (docs/frozen.md)
            home = homes["frozen"]
            stored = TORCH_DTYPES[plan.unit(self.name).frozen_dtype_under(plan.compute_dtype)]
            self.frozen_slot = Slot(f"{self.name}.frozen", flat_numel(self.frozen_numel), stored,
                                    device_pool if cpu else host_pool, tagged(store, "frozen", plan),
                                    resident=home is Tier.DEVICE, stored=home is Tier.SSD)  # fmt: skip
            frozen = (
                CopyWeights(self.frozen_slot, device, resident=False)
                if device.copies
                else CpuWeights(self.frozen_slot, device)
            )
            if stored != self.compute_dtype:  # a 16-bit base under fp32 compute: upcast at each fetch
                frozen = UpcastWeights(frozen, device, device_pool, self.compute_dtype)
            self.weights = PairWeights(self.weights, frozen)
        # Only a unit whose optimizer state all lives on SSD can be updated speculatively: the
        # previous generation there is what a redo starts from (an array resident in memory is
        # updated in place, and so is a compute copy with no home).
        self.can_speculate = all(s.stored for s in self.slots if s.txn is not None)

    def _init_common(self, layout: UnitLayout, plan: Plan, device: Device) -> Placement:
        """What every unit has, however its arrays are laid out (runtime/dp/sharded.py: over ranks).
        Returns the unit's placement in the plan."""
        self.name = layout.unit.name
        self.layout = layout
        self.placement = placement = plan.placement(self.name)
        self.device = device
        self.params: list[tuple[nn.Parameter, ParamSlot]] = layout.params
        self.numel = layout.numel
        # the frozen segment (docs/frozen.md): its parameters, its slot (built with the others in
        # Unit.__init__; over ranks there is none) and the CRC-32C of its contents (set when the
        # first weights are stored: state.close_frozen), the reference checkpoints record
        self.frozen: list[tuple[nn.Parameter, ParamSlot]] = layout.frozen
        self.frozen_numel = layout.frozen_numel
        self.frozen_slot: Optional[Slot] = None
        self.frozen_crc: Optional[int] = None
        self._frozen_flat: Optional[torch.Tensor] = None
        self._exporting_frozen = False
        self.compute_dtype = TORCH_DTYPES[plan.compute_dtype]
        self.phase = UnitPhase.IDLE
        self.steps = [0] * len(self.params)  # Adam step count per parameter (torch.optim semantics)
        self.groups = [0] * len(self.params)  # each parameter's optimizer param group (its hyper-parameters)
        self.got_grad = [False] * len(self.params)  # in the current accumulation window
        self.trainable = sum(1 for p, _ in self.params if p.requires_grad)
        self.grads_pending = 0  # params still to receive a gradient in this backward
        self.sq_norm: Optional[float] = None  # of the accumulated gradients, when needed
        self.speculated = False  # updated during this step's backward before its validation
        self.held_grads: Optional[list] = None  # autograd's gradients, kept for a redo (direct path)
        # a vertical window's kept 16-bit gradients by parameter index, in the order they arrived,
        # until taken and summed (runtime/window_grads.py)
        self.summed: dict[int, list[torch.Tensor]] = {}
        self.pending = None  # a deferred update to apply at the next visit (runtime/pending.py)
        self.bound = False
        self._flat: Optional[torch.Tensor] = None  # device weights the params view, when bound
        return placement

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {self.phase.value}, bound={self.bound})"

    @property
    def slots(self) -> tuple[Slot, ...]:
        uniq = []
        for s in (self.master, self.compute, self.exp_avg, self.exp_avg_sq, self.grads, self.frozen_slot):
            if s is not None and all(s is not u for u in uniq):
                uniq.append(s)
        return tuple(uniq)

    # ---- the whole fp32 master, for exports (runtime/dp/sharded.py gathers it over ranks) ---------
    def export_master(self, with_frozen: bool = True) -> torch.Tensor:
        """The unit's fp32 master weights, held until end_export() (and with_frozen, the frozen
        segment: export_frozen)."""
        self._exporting_frozen = with_frozen and self.frozen_slot is not None
        if self._exporting_frozen:
            self.frozen_slot.acquire(Hold.EXPORT)
        self.master.acquire(Hold.EXPORT)
        return self.master.wait()

    def export_frozen(self) -> torch.Tensor:
        """The frozen segment, between export_master() and end_export()."""
        return self.frozen_slot.wait()

    def exported(self, s: ParamSlot, master: torch.Tensor) -> torch.Tensor:
        """Parameter `s`'s values (a view) between export_master(), which gave `master`, and
        end_export()."""
        flat = self.export_frozen() if s.frozen else master
        return flat[s.offset : s.offset + s.numel].view(s.shape)

    def end_export(self) -> None:
        self.master.release(Hold.EXPORT)
        if self._exporting_frozen:
            self.frozen_slot.release(Hold.EXPORT)
            self._exporting_frozen = False

    # ---- binding parameters to device weights -------------------------------------------------
    def bind(self) -> None:
        """Points every parameter at its view of the device weights (waiting for them)."""
        flat = self.weights.wait()
        if self.bound and flat is self._flat:
            return
        for p, s in self.params:
            p.data = flat[s.offset : s.offset + s.numel].view(s.shape)
        self._flat = flat
        if self.frozen:
            self._frozen_flat = fz = self.weights.frozen_tensor()
            for p, s in self.frozen:
                p.data = fz[s.offset : s.offset + s.numel].view(s.shape)
        self.bound = True

    def unbind(self) -> None:
        if not self.bound:
            return
        for p, s in self.params + self.frozen:
            p.data = self.device.placeholder(s.shape, self.compute_dtype)
        self._flat = self._frozen_flat = None
        self.bound = False

    def flat_ranges(self) -> list[tuple[int, int, bool]]:
        """[start, end) data addresses of the bound device weights, and whether they are the
        frozen segment's (for the saved-tensor hooks)."""
        out = []
        for f, frozen in ((self._flat, False), (self._frozen_flat, True)):
            if f is not None and f.numel():
                start = f.data_ptr()
                out.append((start, start + f.numel() * f.element_size(), frozen))
        return out

    @property
    def flat(self) -> torch.Tensor:
        if self._flat is None:
            raise UnitStateError(f"unit {self.name!r}: weights are not bound")
        return self._flat

    def flat_of(self, frozen: bool) -> torch.Tensor:
        """The bound device weights of the trainable flat buffer or of the frozen segment."""
        if frozen:
            if self._frozen_flat is None:
                raise UnitStateError(f"unit {self.name!r}: weights are not bound")
            return self._frozen_flat
        return self.flat

    def check_usable_in_backward(self) -> None:
        if self.phase in (UnitPhase.UPDATING, UnitPhase.UPDATED):
            raise UnitStateError(
                f"unit {self.name!r} (parameter {self.layout.all_params[0][1].name!r}, ...): its weights were read by "
                "backward after its gradients were complete and its update had started; the runtime "
                "updates a unit as soon as all its parameters have gradients"
            )

    # ---- gradients ------------------------------------------------------------------------
    def start_backward(self) -> None:
        self.grads_pending = self.trainable

    def start_window(self) -> None:
        """A new accumulation window begins (the first micro-batch after a step)."""
        self.got_grad = [False] * len(self.params)
        self.sq_norm = None
        self.speculated = False
        self.held_grads = None

    def forget_update(self, steps: list[int]) -> None:
        """Back to the state of the last completed step: the update this step made (written to the
        new generation of the transactional slots, runtime/slots.py) is forgotten, the Adam step
        counts are `steps` again. The gradients are kept (a redo needs them)."""
        updated = self.phase in (UnitPhase.UPDATING, UnitPhase.UPDATED)
        for s in self.slots:
            if s.txn is not None:
                s.rollback()
        self.steps = list(steps)
        self.speculated = False
        if updated and self.device.copies and self.weights.resident:
            self.refresh_resident()

    def refresh_resident(self) -> None:
        """The device-resident weights took an update that was forgotten: the committed ones back."""
        self.compute.acquire(Hold.EXPORT)
        self.weights.refresh()
        self.compute.release(Hold.EXPORT, after=(self.weights.last_copy,))

    def norm_pieces(self, gbuf: Optional[torch.Tensor] = None, direct: Optional[list] = None) -> list:
        """The gradients whose squared norm is the unit's: one tensor per parameter that got a
        gradient in this window, in order, as views of `gbuf` or from `direct` ([(index, slot,
        grad)] where autograd left them).

        Note: why per parameter. The kernel sums squares per chunk of the tensors laid end to end,
        and a different split gives a different last bit. A unit updated speculatively takes its
        norm from autograd's gradients (its last unit) or in the fused Adam pass; one updated
        after backward takes it from its gradient buffer. With the same pieces both give the same
        norm bit for bit, so a redo clips by exactly the coefficient deferred updates use."""
        if direct is not None:
            return [g.reshape(-1) for _, _, g in direct]
        return [
            gbuf[s.offset : s.offset + s.numel] for i, (_, s) in enumerate(self.params) if self.got_grad[i]
        ]

    def take_grads(self) -> list[tuple[int, ParamSlot, torch.Tensor]]:
        """Removes the gradients autograd left on the parameters, or a vertical window's kept
        micro-batch gradients where it made them, summed in fp32 and rounded once to the dtype
        the window keeps them in (the gradient slot's, Plan.window_grad_dtype), on the device:
        [(index, slot, grad)]."""
        got: list = []
        kept: list = []  # (position in got, the parameter's kept gradients)
        for i, (p, s) in enumerate(self.params):
            g = p.grad
            parts = self.summed.pop(i, None)
            if parts is not None:
                if g is not None:  # (none reaches the parameter where the window sums: added last if one did)
                    parts.append(g)
                    p.grad = None
                kept.append((len(got), parts))
            elif g is None:
                continue
            got.append([i, s, g])
        if kept:
            for (k, _), total in zip(kept, sum_window([parts for _, parts in kept], self.grads.dtype)):
                got[k][2] = total
            del kept
        out = []
        for i, s, g in got:
            if g.shape != s.shape:
                raise UnitStateError(
                    f"parameter {s.name!r}: gradient of shape {tuple(g.shape)}, expected {tuple(s.shape)}"
                )
            self.params[i][0].grad = None
            self.got_grad[i] = True
            out.append((i, s, g))
        return out

    def segments(self) -> list[tuple[int, int, int, bool, int]]:
        """Runs of consecutive parameters as (start, end, step, update, group): parameters of one
        param group that received a gradient in this window with equal step counts form one run
        and are updated together with that group's hyper-parameters; the others are left alone,
        as torch.optim leaves parameters whose grad is None."""
        runs: list[tuple[int, int, int, bool, int]] = []
        for i, (_, s) in enumerate(self.params):
            upd, step, grp = self.got_grad[i], self.steps[i], self.groups[i]
            last = runs[-1] if runs else None
            if (
                last is not None
                and last[1] == s.offset
                and last[3] == upd
                and (not upd or (last[2] == step and last[4] == grp))
            ):
                runs[-1] = (last[0], s.offset + s.numel, step, upd, grp)
            else:
                runs.append((s.offset, s.offset + s.numel, step, upd, grp))
        return runs
