"""The Plan: where each unit's training state lives, and how far ahead the runtime fetches.

Pure data (no torch). The runtime executes a frozen Plan and never re-decides placement; a later
planner fills the same types from a cost model (DESIGN.md, convention 7).

A *unit* is the granularity of I/O and of the optimizer: a transformer block, the embeddings, the
head. Each unit owns a flat run of parameters (`numel` elements); a unit whose modules also read
another unit's parameters (tied embeddings/lm_head) names it in `borrows`.

Note: the four arrays of a unit and where they can live.
  weights  the compute-precision copy the device computes with. DEVICE: resident for the whole
           run; HOST: a resident copy in host memory, copied to the device for each use; SSD: read
           for each use. With fp32 compute the weights *are* the fp32 master (no second copy is
           kept anywhere), so a non-DEVICE weights tier must equal the master tier.
  master   fp32 master weights, read and written by the CPU optimizer: HOST or SSD.
  moments  Adam's exp_avg and exp_avg_sq (fp32): HOST or SSD.
  grads    fp32 gradients kept between micro-batches, or until a deferred update (clipping, fp16
           overflow check) can run: HOST or SSD. Without accumulation or deferral they are
           transient (one unit in flight at a time) and this tier is not used.
On the CPU acting as the device, DEVICE and HOST are the same memory; the device buffer of a
unit is then the host buffer itself (no copy), and DEVICE fp32 weights mean the master stays in
memory too, so they require master HOST.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Iterator, Optional, Sequence

from .spec import ACTIVATION_POLICIES, COMPUTE_DTYPES, DTYPE_BYTES, Budgets
from .spec import fmt_bytes as fmt_bytes  # (the planner's modules import it from here)

DEVICES = ("cpu", "cuda")

# Direct I/O moves whole 4096-byte blocks: every flat buffer is padded to a multiple of this many
# elements (4096 bytes at 2 bytes/element, 8192 at 4), so one layout serves every dtype.
ALIGN_NUMEL = 2048


class PlanError(ValueError):
    """A plan that cannot run: budgets too small, inconsistent tiers. The message names the unit,
    the budget and the bytes needed."""


class InfeasibleError(PlanError):
    """Nothing fits the budgets: the message names what each budget lacks and the largest unit.

    largest_micro_batch: where the saved activations are what does not fit, the largest
    micro-batch whose activations would (0: none; None: the batch is not the problem).
    device_bytes_needed: the device budget the smallest working set needs at this batch."""

    def __init__(self, msg: str, *, largest_micro_batch: Optional[int] = None,
                 device_bytes_needed: Optional[int] = None):  # fmt: skip
        super().__init__(msg)
        self.largest_micro_batch = largest_micro_batch
        self.device_bytes_needed = device_bytes_needed


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    SSD = "ssd"


def flat_numel(numel: int) -> int:
    """Elements of a unit's flat buffer: its parameters back to back, padded to ALIGN_NUMEL."""
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


def shard_numel(numel: int, shards: int) -> int:
    """Elements of one rank's shard of a unit's flat buffer over `shards` data-parallel ranks:
    an equal part, padded to ALIGN_NUMEL so every shard starts on a direct-I/O block (one rank:
    the flat buffer)."""
    return flat_numel(-(-numel // shards))


@dataclass(frozen=True)
class UnitSpec:
    """What the planner needs to know about a unit (the runtime discovers these from the model)."""

    name: str
    numel: int  # parameters owned, unpadded
    borrows: tuple[str, ...] = ()  # units whose weights this unit's modules also read
    # False for units whose backward reads none of their weights (embedding lookups): their
    # weights are then not fetched for backward.
    backward_needs_weights: bool = True
    # Data-parallel ranks the unit's state is partitioned over (ZeRO-style, see the Note on
    # shards below); the sizes are one rank's.
    shards: int = 1
    # Frozen parameters (requires_grad False) kept apart from `numel`: stored once in the compute
    # dtype, read for forward and backward, never written; no master, moments, gradients or Adam
    # work (see the Note on frozen parameters below). `numel` counts the trainable ones only.
    frozen_numel: int = 0
    # The dtype the model gives its frozen parameters where it is 16-bit ("bf16", "fp16"; None:
    # fp32 or mixed): under fp32 compute the frozen segment stays in it (frozen_dtype_under) and
    # is upcast at each fetch, exactly; under 16-bit compute it is stored in the compute dtype.
    frozen_dtype: Optional[str] = None

    # Note: shards. With N data-parallel ranks each rank owns one N-th of the unit's flat buffer
    # (`shard_numel` elements): its fp32 master, its Adam moments and, at home, its part of the
    # compute weights. The device computes with the whole unit, gathered from every rank's
    # shard (`padded_numel` = N * shard_numel elements); gradients are complete flat buffers
    # (reduced over the ranks into each rank's shard at the accumulation boundary). One rank:
    # every size is the unit's.

    # Note: frozen parameters (docs/frozen.md). A unit's frozen segment is its own flat buffer of
    # `frozen_numel` elements in the compute dtype, not sharded and never written after the first
    # weights: its home is the store ("frozen" in Plan.homes), or the device for a unit whose
    # weights are resident on the CPU device. The device holds it with the unit's weights while
    # the unit computes (weights_bytes counts both); its reads are weights traffic, and it has no
    # other array.

    def __post_init__(self) -> None:
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise PlanError(f"unit {self.name!r}: shards must be an int >= 1, got {self.shards!r}")
        if (
            isinstance(self.frozen_numel, bool)
            or not isinstance(self.frozen_numel, int)
            or self.frozen_numel < 0
        ):
            raise PlanError(
                f"unit {self.name!r}: frozen_numel must be an int >= 0, got {self.frozen_numel!r}"
            )
        if self.frozen_dtype is not None and self.frozen_dtype not in ("bf16", "fp16"):
            raise PlanError(
                f"unit {self.name!r}: frozen_dtype must be 'bf16', 'fp16' or None, got {self.frozen_dtype!r}"
            )
        if self.frozen_numel and self.shards > 1:
            raise PlanError(
                f"unit {self.name!r}: a frozen segment over {self.shards} ranks; over several ranks frozen "
                "parameters stay in the unit's flat buffer (docs/frozen.md)"
            )

    @cached_property  # (the planner asks millions of times; the dataclass is frozen)
    def shard_numel(self) -> int:
        return shard_numel(self.numel, self.shards)

    @cached_property
    def padded_numel(self) -> int:
        """Elements of the whole unit's flat buffer (the gathered weights, the gradients)."""
        return self.shard_numel * self.shards

    def weights_bytes(self, compute_dtype: str) -> int:
        """The whole unit's compute weights on the device: the trainable ones and the frozen
        segment, which the device holds together while the unit computes (a segment stored in
        a narrower dtype as it is read and as its upcast copy: frozen_dtype_under)."""
        frozen = self.frozen_bytes(compute_dtype)
        if self.frozen_dtype_under(compute_dtype) != compute_dtype:
            frozen += flat_numel(self.frozen_numel) * DTYPE_BYTES[compute_dtype]
        return self.padded_numel * DTYPE_BYTES[compute_dtype] + frozen

    def frozen_dtype_under(self, compute_dtype: str) -> str:
        """The dtype the frozen segment is stored in: the model's 16-bit dtype under fp32
        compute (a 16-bit base stays 16-bit, upcast at each fetch), else the compute dtype."""
        return self.frozen_dtype if (self.frozen_dtype and compute_dtype == "fp32") else compute_dtype

    def frozen_bytes(self, compute_dtype: str) -> int:
        """The frozen segment as stored (see the Note), padded as every flat buffer is."""
        return flat_numel(self.frozen_numel) * DTYPE_BYTES[self.frozen_dtype_under(compute_dtype)]

    def weights_home_bytes(self, compute_dtype: str) -> int:
        """This rank's part of the compute weights at their home (HOST or SSD)."""
        return self.shard_numel * DTYPE_BYTES[compute_dtype]

    @property
    def master_bytes(self) -> int:
        return self.shard_numel * 4

    @property
    def moments_bytes(self) -> int:
        return self.shard_numel * 8

    @property
    def grad_bytes(self) -> int:
        """The whole unit's fp32 gradients (accumulated over micro-batches)."""
        return self.padded_numel * 4

    @property
    def shard_grad_bytes(self) -> int:
        """This rank's shard of the gradients, summed over the ranks."""
        return self.shard_numel * 4


@dataclass(frozen=True)
class Placement:
    unit: str
    weights: Tier
    master: Tier
    moments: Tier
    grads: Tier = Tier.HOST


@dataclass(frozen=True)
class Plan:
    """A frozen placement of every unit plus the prefetch depths; validated on construction."""

    units: tuple[UnitSpec, ...]  # in forward order
    placements: tuple[Placement, ...]  # same order
    device: str  # "cpu" | "cuda"
    compute_dtype: str  # "fp32" | "bf16" | "fp16"
    prefetch_depth: int  # weights of visit i+k are fetched while visit i computes
    optim_prefetch_depth: int  # optimizer state is read this many visits before its grads exist
    accumulate_grads: bool = False  # gradient accumulation over micro-batches
    deferred_update: bool = False  # updates wait for a global quantity (clip norm, overflow)
    # Deferred updates may run during backward speculatively, validated at its end (the
    # runtime's speculation, docs/runtime.md): the state keeps a second generation on SSD.
    speculative: bool = False
    # Gradient clipping: a speculative step that clips is redone, so it keeps its gradients until
    # validated (without clipping, fp16's overflow skips the step: nothing to redo).
    clipping: bool = False
    # Keep a unit's weights between two uses in a step where that raises neither peak
    # (schedule.py, _fill_gaps); False: drop after every use and read again (strict streaming).
    fill_gaps: bool = True
    # The budgets the plan was made for and the runtime holds to (None: a plan made without
    # budgets, for tests of the schedule; the runtime refuses it).
    budgets: Optional[Budgets] = None
    notes: tuple[str, ...] = field(default=(), compare=False)
    # The I/O engine's block size, queue depth and threads per directory, decided by the resolve
    # stage (planner/io_settings.py: the run's own offloadpp.io, else the hardware profile's;
    # None: IOConfig's default). The runtime opens its store with them.
    io_block_size_bytes: Optional[int] = None
    io_queue_depth: Optional[int] = None
    io_num_threads: Optional[int] = None
    # Each profiled swap directory's share of a striped tensor, by its measured rate (the
    # hardware profile's stripe_weights); () stripes evenly. The runtime matches its directories.
    ssd_stripe: tuple[tuple[str, float], ...] = ()
    # What happens to each unit's saved activations (runtime/activations/), one of
    # ACTIVATION_POLICIES per unit in forward order; () keeps them all on the device. "auto" (a
    # plan without a model profile) is decided from the first step's measure (decide.py).
    activations: tuple[str, ...] = ()
    # Per unit in forward order, (bytes its forward saves, bytes of its activation checkpoint:
    # its inputs) from the model profile the plan was made with; () when none. Only for the
    # printout's per-unit split (kept, host, ssd, recomputed): the runtime measures its own.
    activation_sizes: tuple[tuple[int, int, int, int, int], ...] = field(default=(), compare=False)
    # Vertical accumulation (Settings.accumulation, decided by decide.accumulation): a window of
    # `micro_batches` micro-batches driven whole (train_batch, the Trainer's window) visits each
    # unit once in forward over every micro-batch and once in backward, the unit's gradient summed
    # over them on the device and handed to the optimizer once. A per-micro-batch loop (forward,
    # backward, step) runs horizontally whatever this says. False where micro_batches is 1.
    vertical: bool = False
    micro_batches: int = 1  # gradient_accumulation_steps: the window a vertical run holds at once
    # A vertical window's activation policies, one per unit in forward order: each applied to
    # every micro-batch of the window, whose saved bytes are all held between the unit's forward
    # and its backward (the activation budget counts micro_batches of them). () when not vertical;
    # `activations` are the per-micro-batch loop's (one micro-batch held at a time).
    vertical_activations: tuple[str, ...] = ()
    # The estimate of one window (micro_batches micro-batches and the optimizer step) run each
    # way, seconds: (("horizontal", s), ("vertical", s)); () where not estimated. For the
    # printout and the engine's log ("train_batch would run vertically: ...").
    window_s: tuple[tuple[str, float], ...] = field(default=(), compare=False)
    # Threads of the fused CPU Adam (decide.adam_threads, filled by the resolve stage; None: a plan
    # made without it, for which the engine asks decide.adam_threads with the settings it runs).
    adam_threads: Optional[int] = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise PlanError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise PlanError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.prefetch_depth < 0 or self.optim_prefetch_depth < 0:
            raise PlanError(
                f"prefetch depths must be >= 0, got prefetch_depth={self.prefetch_depth}, "
                f"optim_prefetch_depth={self.optim_prefetch_depth}"
            )
        self._check_activations()
        self._check_window()
        if self.speculative and not self.deferred_update:
            raise PlanError(
                "speculative updates are deferred updates run during backward: speculative needs deferred_update"
            )
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise PlanError(f"unit names must be unique, got {names}")
        if [p.unit for p in self.placements] != names:
            raise PlanError("placements must list the units in the same order as units")
        if len({u.shards for u in self.units}) > 1:
            raise PlanError(
                f"every unit must have the same shards, got {sorted({u.shards for u in self.units})}"
            )
        known = set(names)
        for u in self.units:
            for b in u.borrows:
                if b not in known or b == u.name:
                    raise PlanError(f"unit {u.name!r} borrows unknown unit {b!r}")
        for p in self.placements:
            self._check_placement(p)

    def _check_activations(self) -> None:
        object.__setattr__(self, "activations", tuple(self.activations))  # a plan file gives a list
        # (saved, checkpoint, kept by partial, of it not saved, a partial_host_tail's kept tail, its
        # pieces' checkpoints) per unit (activations.sized_split); fewer from an older plan file:
        # no partial, no tail, no pieces
        sizes = tuple(tuple(int(x) for x in (tuple(sz) + (0, 0, 0, 0))[:6]) for sz in self.activation_sizes)
        if sizes and len(sizes) != len(self.units):
            raise PlanError(
                f"activation_sizes must give one entry per unit ({len(self.units)}), got {len(sizes)}"
            )
        object.__setattr__(self, "activation_sizes", sizes)
        stripe = tuple((str(d), float(w)) for d, w in self.ssd_stripe)
        if any(w <= 0 for _, w in stripe):
            raise PlanError(f"ssd_stripe weights must be > 0, got {list(stripe)}")
        object.__setattr__(self, "ssd_stripe", stripe)
        self._check_policies("activations", "activation policy", self.activations)

    def _check_window(self) -> None:
        object.__setattr__(self, "vertical_activations", tuple(self.vertical_activations))
        object.__setattr__(self, "window_s", tuple((str(k), float(v)) for k, v in self.window_s))
        if (
            isinstance(self.micro_batches, bool)
            or not isinstance(self.micro_batches, int)
            or self.micro_batches < 1
        ):
            raise PlanError(f"micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if self.vertical and self.micro_batches == 1:
            raise PlanError("vertical accumulation needs a window of micro_batches > 1, got 1")
        if self.vertical and not self.accumulate_grads:
            raise PlanError(
                "vertical accumulation is accumulation over a window: vertical needs accumulate_grads"
            )
        self._check_policies("vertical_activations", "vertical activation policy", self.vertical_activations)

    def _check_policies(self, field: str, what: str, policies: tuple) -> None:
        """`field` (empty, or one activation policy per unit) names only known policies."""
        if policies and len(policies) != len(self.units):
            raise PlanError(
                f"{field} must name one policy per unit ({len(self.units)}), got {len(policies)}: {list(policies)}"
            )
        for u, a in zip(self.units, policies):
            if a not in ACTIVATION_POLICIES:
                raise PlanError(f"unit {u.name!r}: {what} must be one of {ACTIVATION_POLICIES}, got {a!r}")

    def _check_placement(self, p: Placement) -> None:
        for what in ("master", "moments", "grads"):
            if getattr(p, what) is Tier.DEVICE:
                raise PlanError(
                    f"unit {p.unit!r}: {what} cannot live on the device (the optimizer runs on the CPU)"
                )
        if self.compute_dtype == "fp32":
            if p.weights is not Tier.DEVICE and p.weights is not p.master:
                raise PlanError(
                    f"unit {p.unit!r}: with fp32 compute the weights are the master copy, so the weights "
                    f"tier ({p.weights.value}) must be 'device' or equal the master tier ({p.master.value})"
                )
            if self.device == "cpu" and p.weights is Tier.DEVICE and p.master is not Tier.HOST:
                raise PlanError(
                    f"unit {p.unit!r}: on the CPU device, fp32 weights resident on the device are the "
                    "master itself, so master must be 'host'"
                )

    def with_placements(self, placements: tuple[Placement, ...]) -> Plan:
        """This plan with other placements of its units, made without checking the plan again:
        for the search's fills (planner/keep.py), which make thousands of plans from one, each
        placement checked on its own when it was made (keep.upgraded: `_check_placement`). The
        placements must name the units in order; everything else was checked when this plan was
        made, and __post_init__ reads nothing else of them."""
        new = object.__new__(Plan)
        new.__dict__.update(self.__dict__)
        new.__dict__["placements"] = placements
        return new

    # ---- lookups -------------------------------------------------------------------------
    def unit(self, name: str) -> UnitSpec:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit named {name!r} in the plan")

    def placement(self, name: str) -> Placement:
        for p in self.placements:
            if p.unit == name:
                return p
        raise KeyError(f"no unit named {name!r} in the plan")

    def __iter__(self) -> Iterator[tuple[UnitSpec, Placement]]:
        return iter(zip(self.units, self.placements))

    @property
    def separate_weights(self) -> bool:
        """True when the compute copy is not the master itself (16-bit compute)."""
        return self.compute_dtype != "fp32"

    @property
    def compute_copy_on_device(self) -> bool:
        """The separate compute copy (16-bit weights) is a device buffer: on the CPU acting as the
        device, one rank (runtime/unit.py draws it from the device pool, and an update that writes
        a new copy takes it there, holds.holds). On CUDA it is a host buffer copied up, and over
        several ranks a host shard gathered into the device's buffer."""
        return self.separate_weights and self.device == "cpu" and self.ranks == 1

    @property
    def persistent_grads(self) -> bool:
        """Gradients outlive one unit's backward: kept across micro-batches or for a deferred update."""
        return self.accumulate_grads or self.deferred_update

    @property
    def grad_dtype(self) -> str:
        """The dtype of the gradients kept between a unit's backward and its update (their home
        and the optimizer's buffer): the compute dtype where it is 16-bit, else fp32.

        Note: why 16-bit. With bf16/fp16 compute autograd's gradients are 16-bit; the fused Adam
        takes them as they are and upcasts each element to fp32 as it reads it (exact: every
        16-bit value is an fp32 value), so an fp32 copy holds nothing more and costs twice the
        bytes through host memory and the SSD. Exceptions, kept fp32: accumulation over
        micro-batches in the home (a sum of 16-bit gradients rounded to 16 bits at every
        micro-batch is not the fp32 sum torch's mixed-precision recipe keeps in `param.grad` of
        an fp32 master) and several ranks (the gradients are reduced over the ranks into fp32
        shards). ZeRO-Infinity upcasts to fp32 before NVMe (docs/runtime.md). A vertical
        window's gradients are summed in fp32 on the device and rounded once to this dtype as
        they are handed to their home: `window_grad_dtype`."""
        return "fp32" if self.accumulate_grads else self.window_grad_dtype

    @property
    def window_grad_dtype(self) -> str:
        """The dtype a vertical window's gradients are kept in after their sum over its
        micro-batches (planner/vertical.py window_plan's grad_dtype; the runtime's grads slots
        take it for a window run whole: runtime/optimizer.py).

        Note: what the one rounding changes. The window's sum is made in fp32 on the device from
        each micro-batch's 16-bit gradients (runtime/window_grads.py) and rounded once to the
        compute dtype: the gradient a micro-batch of all the window's sequences gets in one
        backward (its weight gradients are fp32-accumulated GEMMs over its tokens rounded once
        to 16 bits), which the horizontal path keeps in 16 bits for a deferred step too. Against
        the horizontal window's fp32 sum in the home it differs by that rounding (half a unit in
        the last place of the sum) and, in fp16, overflows where the sum exceeds the fp16 range
        though no micro-batch's gradient does (the step is skipped and the loss scale halved, as
        for that one large micro-batch). ZeRO-Infinity sums a window's gradients in the model's
        dtype at every micro-batch (DeepSpeed's grad_accum_dtype defaults to it) before it
        upcasts them for NVMe: rounded G times, this once. Kept so, a window's gradients move
        half the bytes through host memory, the link and the SSD. fp32 where the compute is
        fp32 or several ranks reduce the gradients into fp32 shards."""
        if self.compute_dtype == "fp32" or self.ranks > 1:
            return "fp32"
        return self.compute_dtype

    def grad_bytes(self, u: UnitSpec) -> int:
        """The whole unit's gradients in grad_dtype (UnitSpec.grad_bytes is their fp32 size)."""
        return u.padded_numel * DTYPE_BYTES[self.grad_dtype]

    @property
    def ranks(self) -> int:
        """Data-parallel ranks the optimizer state is partitioned over (UnitSpec.shards)."""
        return self.units[0].shards if self.units else 1

    # ---- homes and byte totals ----------------------------------------------------------
    def homes(self, u: UnitSpec, p: Placement) -> dict[str, Optional[Tier]]:
        """Where each array of unit `u` lives between uses, the one accounting the plan, the
        cost model's replay and the runtime share: "master", "exp_avg", "exp_avg_sq", "grads"
        and, with 16-bit compute, "weights" (with fp32 the weights are the master). DEVICE or
        HOST: resident; SSD: a key in the store, read and written; None: no home, a buffer
        filled and used within a step (transient gradients; on CUDA the host copy of 16-bit
        weights resident on the device, which only carries each update's new copy up).

        Over several ranks (`ranks`) every array but the gradients is this rank's shard;
        "grads" is then the whole unit's gradients accumulated over micro-batches (a home only
        with accumulation: they are reduced over the ranks at the boundary), and "grad_shard"
        this rank's reduced shard, kept until a deferred update (a home only then)."""
        h: dict[str, Optional[Tier]] = {"master": p.master, "exp_avg": p.moments, "exp_avg_sq": p.moments}
        if self.separate_weights:
            h["weights"] = None if (p.weights is Tier.DEVICE and self.device == "cuda") else p.weights
        if self.ranks > 1:
            h["grads"] = p.grads if self.accumulate_grads else None
            h["grad_shard"] = p.grads if self.deferred_update else None
        else:
            h["grads"] = p.grads if self.persistent_grads else None
        if u.frozen_numel:
            h["frozen"] = self.frozen_home(p)
        return h

    def frozen_home(self, p: Placement) -> Tier:
        """Where a unit's frozen segment lives (UnitSpec's Note on frozen parameters): with the
        weights where they are resident on the CPU device (memory the device budget counts),
        else on SSD, read at each fetch of the unit's weights (on CUDA too: a device-resident
        frozen copy is not built yet)."""
        return Tier.DEVICE if (p.weights is Tier.DEVICE and self.device == "cpu") else Tier.SSD

    def array_bytes(self, u: UnitSpec, array: str) -> int:
        if array == "frozen":
            return u.frozen_bytes(self.compute_dtype)
        if array == "weights":
            return u.weights_home_bytes(self.compute_dtype)
        if array in ("exp_avg", "exp_avg_sq"):
            return u.moments_bytes // 2
        if array == "grad_shard":
            return u.shard_grad_bytes
        return u.master_bytes if array == "master" else self.grad_bytes(u)

    def ssd_bytes(self) -> int:
        """Bytes the store holds at most: every array whose home is SSD (`homes`)."""
        return sum(
            self.array_bytes(u, a) for u, p in self for a, t in self.homes(u, p).items() if t is Tier.SSD
        )

    def ssd_footprint_bytes(self) -> int:
        """Bytes the run keeps on SSD: the plan's arrays and, where updates may run during
        backward (not deferred, or speculative), a second generation of every transactional one
        (master, moments, compute copy: runtime/slots.py), which a step writes before it commits."""
        total = self.ssd_bytes()
        if not self.deferred_update or self.speculative:
            grads = sum(self.grad_bytes(u) for u, p in self if self.persistent_grads and p.grads is Tier.SSD)
            total = 2 * total - grads - self.frozen_ssd_bytes()  # (one generation of what is never written)
        return total

    def frozen_ssd_bytes(self) -> int:
        """The frozen segments on SSD: written once, read-only after."""
        return sum(
            u.frozen_bytes(self.compute_dtype)
            for u, p in self
            if u.frozen_numel and self.frozen_home(p) is Tier.SSD
        )

    def resident_device_bytes(self) -> int:
        return sum(u.weights_bytes(self.compute_dtype) for u, p in self if p.weights is Tier.DEVICE)

    def resident_host_bytes(self) -> int:
        """Host memory of the arrays whose home is HOST (`homes`), less the masters counted with
        the device (device_is_master)."""
        return sum(self.unit_resident_host_bytes(u, p) for u, p in self)

    def unit_resident_host_bytes(self, u: UnitSpec, p: Placement) -> int:
        """resident_host_bytes' share of one unit."""
        total = 0
        for array, tier in self.homes(u, p).items():
            if tier is not Tier.HOST:
                continue
            if array == "master" and self.device_is_master(p):
                continue
            total += self.array_bytes(u, array)
        return total

    def device_is_master(self, p: Placement) -> bool:
        """The master of a unit whose weights are resident on the CPU device is counted with the
        device (one rank; over several, the device holds the gathered weights, the host the shard)."""
        return self.device == "cpu" and self.ranks == 1 and p.weights is Tier.DEVICE

    def describe_budgets(self) -> str:
        from .describe import describe_budgets  # (it imports this module)

        return describe_budgets(self)

    def describe(self) -> str:
        """A table for humans: one line per unit (planner/describe.py)."""
        from .describe import describe

        return describe(self)


def shard_units(units: Sequence[UnitSpec], ranks: int) -> tuple[UnitSpec, ...]:
    """The units as one of `ranks` data-parallel ranks holds them (UnitSpec.shards)."""
    return tuple(replace(u, shards=ranks) for u in units)


def all_on_ssd(units: Sequence[UnitSpec]) -> tuple[Placement, ...]:
    """Every array of every unit on SSD."""
    return tuple(Placement(u.name, Tier.SSD, Tier.SSD, Tier.SSD, Tier.SSD) for u in units)
