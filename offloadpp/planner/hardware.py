"""HardwareProfile: what the machine measured it can do, as the cost model reads it.

Pure (no torch). `offloadpp profile` (offloadpp/profiling/hardware.py) measures these numbers and
writes them as JSON; the planner and the cost model only ever read them from here, so every
constant the planner uses comes from a measurement (DESIGN.md, convention 7).

Note: what each number means, as the cost model uses it.
  ssd_read_gbps / ssd_write_gbps   all directories at once, through the TensorStore striping
                                   each tensor over them by their own rates, on tensors the size
                                   of a unit's state, overwritten in place (the runtime's steady
                                   state), several requests in flight. With several SSDs this is
                                   the aggregate ceiling (PCIe root, CPU, memory): measured, never
                                   the sum of the drives.
  ssds                             each directory alone (and the free space on it): the rates set
                                   each drive's share of a striped tensor (Plan.ssd_stripe), and
                                   their sum bounds what all can do at once.
  ssd_latency_s                    the round trip of a small put or get alone (the store's header
                                   and payload stages); the cost model charges it to a request
                                   that finds the SSD idle.
  ssd_mixed_gbps                   reads and writes in flight together (half the bytes each), the
                                   runtime's steady state; ssd_mixed_busy_gbps the same while
                                   the CPU computes and runs Adam beside it (CPU device: the I/O
                                   thread shares the cores with both). 0: not measured. The cost
                                   model scales the read and write rates so that a half-and-half
                                   mix runs at this rate.
  io_grid                          the same at other (block size, queue depth) settings: the
                                   planner picks the best.
  h2d_gbps / d2h_gbps              pinned host <-> device copies (CUDA); on the CPU acting as the
                                   device, plain memory copy GB/s (no copy is made there, but
                                   gradient absorbs and activation copies are memcpys).
  memcpy_gbps                      host memory copy.
  device_flops_per_s               GEMM FLOP/s on the model's shapes, per compute dtype.
  adam_params_per_s                the fused CPU Adam (adam_step_flat, fp32 state), per thread count.
  runtime_*_visit_s                seconds the runtime's own work adds to each unit visit (hooks,
                                   binding, handing gradients over), measured with a small model.
  compute_slowdown_under_adam      on the CPU as the device, compute and Adam share the cores:
  adam_slowdown_under_compute      how much longer each takes while the other runs (>= 1; on a
                                   GPU both are 1 for compute). Measured with the two running
                                   together.
  compute_slowdown_under_io        on the CPU as the device, how much longer compute takes while
                                   the SSD streams reads and writes (the I/O thread and the
                                   kernel's block layer run on the same cores; 1 on a GPU).
  collective_gbps                  the bus bandwidth of all-gathers among the node's devices
                                   (`offloadpp bench dp` measures it), for plans over several
                                   data-parallel ranks (planner/ranks.py); 0: not known.
  network_gbps                     each node's network bandwidth, for ranks on several nodes; 0:
                                   not known.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Mapping, Optional

PROFILE_VERSION = 1


def default_profile_path() -> str:
    """Where `offloadpp profile` caches the hardware profile and the planner looks for it:
    $OFFLOADPP_CACHE_DIR/hardware.json, else ~/.cache/offloadpp/hardware.json."""
    root = os.environ.get("OFFLOADPP_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "offloadpp"
    )
    return os.path.join(root, "hardware.json")


class ProfileError(ValueError):
    """A profile JSON that cannot be used; the message names the field and the value."""


def _positive(owner: str, name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ProfileError(f"{owner}.{name} must be a finite number {need}, got {value!r}")


@dataclass(frozen=True)
class SsdProfile:
    path: str
    read_gbps: float
    write_gbps: float
    free_bytes: int = 0  # free space on its filesystem when measured (0: not known)

    def __post_init__(self) -> None:
        _positive("SsdProfile", "read_gbps", self.read_gbps)
        _positive("SsdProfile", "write_gbps", self.write_gbps)
        if isinstance(self.free_bytes, bool) or not isinstance(self.free_bytes, int) or self.free_bytes < 0:
            raise ProfileError(f"SsdProfile.free_bytes must be an int >= 0, got {self.free_bytes!r}")

    @property
    def mix_gbps(self) -> float:
        """GB/s of a half-read, half-write mix (the runtime's)."""
        return 1.0 / (0.5 / self.read_gbps + 0.5 / self.write_gbps)


@dataclass(frozen=True)
class IOPoint:
    """SSD GB/s at one (block size, queue depth) setting of the I/O engine."""

    block_size_bytes: int
    queue_depth: int
    read_gbps: float
    write_gbps: float

    def __post_init__(self) -> None:
        if self.block_size_bytes <= 0 or self.block_size_bytes % 4096:
            raise ProfileError(
                f"IOPoint.block_size_bytes must be a positive multiple of 4096, got {self.block_size_bytes!r}"
            )
        if self.queue_depth < 1:
            raise ProfileError(f"IOPoint.queue_depth must be >= 1, got {self.queue_depth!r}")
        _positive("IOPoint", "read_gbps", self.read_gbps)
        _positive("IOPoint", "write_gbps", self.write_gbps)

    def seconds_per_byte(self, read_share: float = 0.5) -> float:
        """Time per byte of a mix with `read_share` of the bytes read (the runtime's mix is ~half)."""
        return read_share / (self.read_gbps * 1e9) + (1 - read_share) / (self.write_gbps * 1e9)


@dataclass(frozen=True)
class HardwareProfile:
    device: str  # "cpu" | "cuda"
    device_name: str
    cpu_cores: int
    ssd_read_gbps: float
    ssd_write_gbps: float
    h2d_gbps: float
    d2h_gbps: float
    memcpy_gbps: float
    device_flops_per_s: Mapping[str, float]  # compute dtype -> FLOP/s
    adam_params_per_s: Mapping[int, float]  # threads -> parameters per second
    host_memory_bytes: int  # available when measured
    device_memory_bytes: int  # free device memory (CUDA); on the CPU, same as host
    ssds: tuple[SsdProfile, ...] = ()
    io_grid: tuple[IOPoint, ...] = ()
    ssd_mixed_gbps: float = 0.0
    ssd_mixed_busy_gbps: float = 0.0
    ssd_latency_s: float = 0.0  # round trip of a small request alone (put and get, averaged)
    io_issue_s: float = 0.0  # CPU time of the thread that issues one request (store get/put)
    io_block_size_bytes: int = 1 << 20  # the setting ssd_*_gbps were measured at
    io_queue_depth: int = 8
    runtime_forward_visit_s: float = 0.0
    runtime_backward_visit_s: float = 0.0
    compute_slowdown_under_adam: float = 1.0
    adam_slowdown_under_compute: float = 1.0
    compute_slowdown_under_io: float = 1.0
    collective_gbps: float = 0.0
    network_gbps: float = 0.0
    torch_threads: int = 1  # intra-op threads compute was measured with
    measured_at: str = ""
    measure_s: float = 0.0
    version: int = PROFILE_VERSION
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ProfileError(
                f"HardwareProfile.version must be {PROFILE_VERSION}, got {self.version!r}: re-run `offloadpp profile`"
            )
        if self.device not in ("cpu", "cuda"):
            raise ProfileError(f"HardwareProfile.device must be 'cpu' or 'cuda', got {self.device!r}")
        if not isinstance(self.cpu_cores, int) or self.cpu_cores < 1:
            raise ProfileError(f"HardwareProfile.cpu_cores must be an int >= 1, got {self.cpu_cores!r}")
        for name in ("ssd_read_gbps", "ssd_write_gbps", "h2d_gbps", "d2h_gbps", "memcpy_gbps"):
            _positive("HardwareProfile", name, getattr(self, name))
        for name in (
            "ssd_mixed_gbps",
            "ssd_mixed_busy_gbps",
            "runtime_forward_visit_s",
            "runtime_backward_visit_s",
            "io_issue_s",
            "collective_gbps",
            "network_gbps",
        ):
            _positive("HardwareProfile", name, getattr(self, name), allow_zero=True)
        for name in ("host_memory_bytes", "device_memory_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ProfileError(f"HardwareProfile.{name} must be an int >= 0, got {v!r}")
        if not self.device_flops_per_s:
            raise ProfileError("HardwareProfile.device_flops_per_s must name at least one dtype, got {}")
        for k, v in self.device_flops_per_s.items():
            _positive("HardwareProfile", f"device_flops_per_s[{k!r}]", v)
        if not self.adam_params_per_s:
            raise ProfileError(
                "HardwareProfile.adam_params_per_s must list at least one thread count, got {}"
            )
        for k, v in self.adam_params_per_s.items():
            if not isinstance(k, int) or k < 1:
                raise ProfileError(
                    f"HardwareProfile.adam_params_per_s has thread count {k!r}; expected an int >= 1"
                )
            _positive("HardwareProfile", f"adam_params_per_s[{k}]", v)
        for name in (
            "compute_slowdown_under_adam",
            "adam_slowdown_under_compute",
            "compute_slowdown_under_io",
        ):
            v = getattr(self, name)
            _positive("HardwareProfile", name, v)
            if v < 1.0:
                raise ProfileError(f"HardwareProfile.{name} must be >= 1 (a slowdown factor), got {v!r}")

    # ---- lookups -------------------------------------------------------------------------
    def flops_per_s(self, compute_dtype: str) -> float:
        if compute_dtype in self.device_flops_per_s:
            return float(self.device_flops_per_s[compute_dtype])
        if "fp32" in self.device_flops_per_s:
            return float(self.device_flops_per_s["fp32"])
        return float(next(iter(self.device_flops_per_s.values())))

    def adam_rate(self, threads: int) -> float:
        """Parameters per second of the fused Adam at `threads` (nearest measured count at or below,
        scaled linearly from the nearest one when none is)."""
        known = sorted(self.adam_params_per_s)
        below = [t for t in known if t <= threads]
        if below:
            return float(self.adam_params_per_s[below[-1]])
        t0 = known[0]
        return float(self.adam_params_per_s[t0]) * threads / t0

    def stripe_weights(self) -> tuple[tuple[str, float], ...]:
        """Each directory's share of a striped tensor: its measured rate (of a half-read,
        half-write mix), so that all finish their parts together. () with one directory."""
        if len(self.ssds) < 2:
            return ()
        total = sum(d.mix_gbps for d in self.ssds)
        return tuple((d.path, d.mix_gbps / total) for d in self.ssds)

    def striped_gbps(self) -> tuple[float, float]:
        """(read, write) GB/s the directories could give all at once if nothing but the drives
        limited them, striped by their rates: the sum of each one's rate (inf with fewer than two
        directories profiled). A bound on the aggregate, never a stand-in for it."""
        if len(self.ssds) < 2:
            return math.inf, math.inf
        return sum(d.read_gbps for d in self.ssds), sum(d.write_gbps for d in self.ssds)

    def ssd_rates(self) -> tuple[float, float]:
        """(read, write) GB/s as the cost model charges them in a training step: the rates of all
        directories at once (at most what the drives give striped), scaled so that a half-read,
        half-write mix takes what the mixed measurement took (the busy one where measured)."""
        sr, sw = self.striped_gbps()
        r, w = min(self.ssd_read_gbps, sr), min(self.ssd_write_gbps, sw)
        mixed = self.ssd_mixed_busy_gbps or self.ssd_mixed_gbps
        if not mixed:
            return r, w
        scale = mixed * (0.5 / r + 0.5 / w)  # measured mix rate / the mix rate r and w imply
        return min(r * scale, sr), min(w * scale, sw)

    def best_io(self) -> IOPoint:
        """The measured (block size, queue depth) with the least time per byte of a half-read,
        half-write mix; the default point when no grid was measured."""
        points = list(self.io_grid) or [
            IOPoint(self.io_block_size_bytes, self.io_queue_depth, self.ssd_read_gbps, self.ssd_write_gbps)
        ]
        return min(points, key=lambda p: p.seconds_per_byte())

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["adam_params_per_s"] = {str(k): v for k, v in self.adam_params_per_s.items()}
        d["device_flops_per_s"] = dict(self.device_flops_per_s)
        d["ssds"] = [asdict(s) for s in self.ssds]
        d["io_grid"] = [asdict(p) for p in self.io_grid]
        d["notes"] = list(self.notes)
        return d

    def to_json(self, path: Optional[str] = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareProfile:
        if not isinstance(d, Mapping):
            raise ProfileError(f"a hardware profile must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ProfileError(f"hardware profile has unknown field(s) {unknown}")
        missing = sorted(
            f.name
            for f in fields(cls)
            if f.name not in d and f.default is MISSING and f.default_factory is MISSING
        )
        if missing:
            raise ProfileError(f"hardware profile lacks field(s) {missing}")
        kw = dict(d)
        try:
            kw["adam_params_per_s"] = {int(k): float(v) for k, v in d["adam_params_per_s"].items()}
        except (AttributeError, ValueError, TypeError):
            raise ProfileError(
                f"HardwareProfile.adam_params_per_s must map thread counts to numbers, got {d['adam_params_per_s']!r}"
            ) from None
        kw["device_flops_per_s"] = dict(d["device_flops_per_s"])
        kw["ssds"] = tuple(SsdProfile(**s) for s in d.get("ssds", ()))
        kw["io_grid"] = tuple(IOPoint(**p) for p in d.get("io_grid", ()))
        kw["notes"] = tuple(d.get("notes", ()))
        return cls(**kw)

    @classmethod
    def from_json(cls, path_or_text: str) -> HardwareProfile:
        """From a JSON file path, or from the JSON text itself."""
        text = path_or_text
        if not path_or_text.lstrip().startswith("{"):
            if not os.path.isfile(path_or_text):
                raise ProfileError(
                    f"hardware profile {path_or_text!r} does not exist: run `offloadpp profile --dir DIR --json {path_or_text}`"
                )
            with open(path_or_text) as f:
                text = f.read()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"hardware profile is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def describe(self) -> str:
        flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in self.device_flops_per_s.items())
        adam = ", ".join(f"{k} thr {v / 1e9:.2f} Gparam/s" for k, v in sorted(self.adam_params_per_s.items()))
        lines = [
            f"hardware: {self.device} ({self.device_name}), {self.cpu_cores} cores, measured {self.measured_at or '?'}",
            f"  SSD read {self.ssd_read_gbps:.2f} GB/s, write {self.ssd_write_gbps:.2f} GB/s "
            f"(block {self.io_block_size_bytes >> 10} KiB, qd {self.io_queue_depth})"
            + (f"; mixed {self.ssd_mixed_gbps:.2f}" if self.ssd_mixed_gbps else "")
            + (f", mixed while computing {self.ssd_mixed_busy_gbps:.2f}" if self.ssd_mixed_busy_gbps else "")
            + (f"; latency {self.ssd_latency_s * 1e3:.2f} ms" if self.ssd_latency_s else ""),
        ]
        for s in self.ssds:
            lines.append(f"    {s.path}: read {s.read_gbps:.2f}, write {s.write_gbps:.2f} GB/s alone")
        if len(self.ssds) > 1:
            sr, sw = self.striped_gbps()
            lines.append(
                f"    all {len(self.ssds)} at once: read {self.ssd_read_gbps / sr:.0%}, write "
                f"{self.ssd_write_gbps / sw:.0%} of the drives' sum ({sr:.1f} / {sw:.1f} GB/s)"
            )
        if self.io_grid:
            b = self.best_io()
            lines.append(
                f"  best I/O setting: block {b.block_size_bytes >> 10} KiB, qd {b.queue_depth} "
                f"(read {b.read_gbps:.2f}, write {b.write_gbps:.2f} GB/s)"
            )
        lines += [
            f"  host->device {self.h2d_gbps:.1f} GB/s, device->host {self.d2h_gbps:.1f} GB/s, memcpy {self.memcpy_gbps:.1f} GB/s",
            f"  device compute: {flops} ({self.torch_threads} thread(s))",
            f"  CPU Adam: {adam}",
            f"  runtime per unit visit: forward {self.runtime_forward_visit_s * 1e3:.2f} ms, "
            f"backward {self.runtime_backward_visit_s * 1e3:.2f} ms",
            f"  contention: compute x{self.compute_slowdown_under_adam:.2f} under Adam, "
            f"Adam x{self.adam_slowdown_under_compute:.2f} under compute, "
            f"compute x{self.compute_slowdown_under_io:.2f} under SSD I/O",
            f"  memory: host {self.host_memory_bytes / 2**30:.1f} GiB available, device {self.device_memory_bytes / 2**30:.1f} GiB",
        ]
        return "\n".join(lines)
