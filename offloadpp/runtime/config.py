"""RuntimeConfig (what the engine is asked to do) and StepReport (what one step did).

RuntimeConfig composes the run's Settings (planner/spec.py, where every setting's default lives)
with what only the runtime needs: where the swap files go, the I/O engine's settings, the device.
Frozen, extra keys refused, validated once at the boundary; errors name the field and the value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from offloadpp.io import IOConfig
from offloadpp.planner import Settings, fmt_bytes
from offloadpp.planner.io_settings import io_set_of
from offloadpp.planner.traffic import ByKind

from .accel.select import check_spec


class RuntimeConfig(BaseModel):
    """How the OffloadEngine trains a model.

    nvme_paths: directories for the swap files (one per SSD); they must exist and be writable.
    settings: budgets, precision, prefetch depths, activations, how the plan is made.
    io: the I/O engine (backend, block size, queue depth, threads, checksums).
    device: "cuda", "cuda:N", "cpu" or "standin" (the CPU with a GPU's asynchrony, for tests:
        runtime/accel/standin.py); None picks cuda when available, else the CPU as the device.
        OFFLOADPP_DEVICE names it where this is None, and "standin" there also replaces "cpu"
        (runtime/accel/select.py, said on stderr).
    ssd_read_gbps / ssd_write_gbps: SSD bandwidth for the step floor in the StepReport; None
        measures it once with a short write and read through the store when the engine starts.
    log_every: log a step report every this many optimizer steps (0: never).
    keep_swap: leave the run's swap files on disk at close() (to look at them); by default they
        are removed then: they are the run's working state, never a checkpoint (a later run
        removes them at its start anyway), and would only hold the disk.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    nvme_paths: tuple[str, ...]
    settings: Settings = Settings()
    io: IOConfig = IOConfig()
    device: Optional[str] = None
    ssd_read_gbps: Optional[float] = Field(None, gt=0.0)
    ssd_write_gbps: Optional[float] = Field(None, gt=0.0)
    log_every: int = Field(1, ge=0)
    keep_swap: bool = False

    def io_set(self) -> dict[str, int]:
        """The I/O settings this config fixes itself (set on its IOConfig, not left to their
        defaults), for the resolve stage, which lets them win over the hardware profile's."""
        return io_set_of(self.io)

    @field_validator("nvme_paths")
    @classmethod
    def _paths(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("nvme_paths must name at least one directory")
        if len(set(v)) != len(v):
            raise ValueError(f"nvme_paths lists a directory twice: {list(v)}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: Optional[str]) -> Optional[str]:
        return v if v is None else check_spec(v)


@dataclass(frozen=True)
class BudgetUse:
    """One budget and how much of it a step used, by the engine's own accounting.

    name: "device" and "host" (the runtime's buffer pools), "activations" (saved activations on
        the device), "activation staging" (host buffers of swapped activations).
    budget_bytes: the budget (None: not limited, reported only).
    peak_bytes: the most held at once during the step; run_peak_bytes: since the engine started.
    longest_wait_s: the longest one request waited for room in the step (a buffer pool's: none is
        reported for the activations or the device copies, which do not wait on a pool).
    """

    name: str
    budget_bytes: Optional[int]
    peak_bytes: int
    run_peak_bytes: int
    longest_wait_s: float = 0.0

    @property
    def within(self) -> bool:
        return self.budget_bytes is None or self.run_peak_bytes <= self.budget_bytes

    def summary(self) -> str:
        cap = fmt_bytes(self.budget_bytes) if self.budget_bytes is not None else "-"
        return f"{self.name} {fmt_bytes(self.peak_bytes)}/{cap}"


@dataclass(frozen=True)
class StepReport:
    """What one optimizer step did. Times in seconds, sizes in bytes.

    forward_s / backward_s: wall time of the forward and backward calls of the step (all
    micro-batches); optimizer_wait_s: time step() waited for the optimizer after backward.
    fetch_wait_s: of forward and backward, the time the schedule's hooks took (issuing fetches,
    waiting for weights to arrive, buffers to free up), i.e. time the device did not compute.
    compute_s: forward_s + backward_s - fetch_wait_s, the device's share.
    adam_s: time the CPU Adam kernel ran (on its worker, mostly overlapped with backward).
    ssd_s: ssd_read_bytes / read bandwidth + ssd_write_bytes / write bandwidth, as measured when
    the engine started. floor_s = max(compute_s, ssd_s, adam_s, comm_floor_s): what the step
    cannot beat.
    Over several data-parallel ranks: comm_bytes through this rank's link for the step's
    gathers and reductions, comm_s the time they took (on their own threads, overlapped with the
    rest), comm_floor_s = comm_bytes / the link's bandwidth as measured when the engine started.
    """

    step: int
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_wait_s: float
    fetch_wait_s: float
    compute_s: float
    adam_s: float
    ssd_s: float
    floor_s: float
    ssd_read_bytes: int
    ssd_write_bytes: int
    host_to_device_bytes: int
    device_to_host_bytes: int
    fetch_misses: int
    grad_norm: Optional[float] = None  # before clipping, when clipping (or fp16) needs it
    skipped: bool = False  # fp16 overflow: no update happened
    loss_scale: Optional[float] = None
    predicted_s: Optional[float] = None  # the planner's estimate of step_s, when it made the plan
    budgets: tuple[BudgetUse, ...] = ()  # each budget's peak in this step (budgets are promises)
    recompute_s: float = 0.0  # of backward_s, re-running the forward of recompute units
    ranks: int = 1
    comm_bytes: int = 0
    comm_s: float = 0.0
    comm_floor_s: float = 0.0
    # How the updates ran (runtime/speculation.py): "in-backward" (nothing global needed),
    # "speculative" (during backward, then validated) or "deferred" (after backward).
    updates: str = "in-backward"
    speculated_units: int = 0  # units updated during backward with the raw gradients
    committed_units: int = 0  # of them, validated and kept
    redone_units: int = 0  # of them, forgotten and updated again with the clipped gradients
    optimizer_exposed_s: float = 0.0  # the optimizer's time after the step's last backward
    mode_switches: int = 0  # switches between speculative and deferred updates so far
    # ssd_read_bytes / ssd_write_bytes by kind, (kind, read, written) per kind in
    # planner.traffic.KINDS' order, counted at the I/O calls by their kind tag; and the cost
    # model's figure for the same plan (its estimate's; () without one)
    ssd_by_kind: ByKind = ()
    predicted_ssd_by_kind: ByKind = ()

    def budget(self, name: str) -> BudgetUse:
        for b in self.budgets:
            if b.name == name:
                return b
        raise KeyError(f"no budget named {name!r}; the report has {[b.name for b in self.budgets]}")

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        extra = ""
        if self.predicted_s is not None and self.step_s > 0:
            extra += (
                f" predicted {self.predicted_s:.3f}s ({(self.predicted_s - self.step_s) / self.step_s:+.0%})"
            )
        if self.budgets:
            extra += " mem " + ", ".join(b.summary() for b in self.budgets)
        if self.recompute_s:
            extra += f" recompute {self.recompute_s:.3f}s"
        if self.ranks > 1:
            extra += f" ranks {self.ranks}: comm {fmt_bytes(self.comm_bytes)} in {self.comm_s:.3f}s (floor {self.comm_floor_s:.3f}s)"
        if self.grad_norm is not None:
            extra += f" grad_norm={self.grad_norm:.4g}"
        if self.updates != "in-backward":
            extra += f" updates {self.updates}"
            if self.speculated_units:
                extra += f" (speculated {self.speculated_units}, committed {self.committed_units}, redone {self.redone_units})"
            extra += f" opt-exposed {self.optimizer_exposed_s:.3f}s switches {self.mode_switches}"
        if self.loss_scale is not None:
            extra += f" loss_scale={self.loss_scale:g}{' SKIPPED' if self.skipped else ''}"
        return (
            f"step {self.step}: {self.step_s:.3f}s (fwd {self.forward_s:.3f} bwd {self.backward_s:.3f} "
            f"opt-wait {self.optimizer_wait_s:.3f} fetch-wait {self.fetch_wait_s:.3f}) floor {self.floor_s:.3f}s "
            f"[compute {self.compute_s:.3f} ssd {self.ssd_s:.3f} adam {self.adam_s:.3f}] "
            f"ssd r {fmt_bytes(self.ssd_read_bytes)} w {fmt_bytes(self.ssd_write_bytes)} "
            f"h2d {fmt_bytes(self.host_to_device_bytes)} d2h {fmt_bytes(self.device_to_host_bytes)} "
            f"misses {self.fetch_misses}{extra}"
        )
