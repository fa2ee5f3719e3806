"""DeepSpeed's monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`) on offloadpp's engine.

The writers are DeepSpeed's own: `deepspeed.monitor.monitor.MonitorMaster`, built from the parsed
DeepSpeedConfig's `monitor_config` as DeepSpeedEngine builds it, so the folders, file names and
formats, wandb's project/group and comet's `samples_log_interval` are DeepSpeed's. This module
decides what is written and when.

Note: what DeepSpeedEngine (0.19.8, runtime/engine.py step()) writes, and when. At the end of
each `step()` that ends an accumulation window (not in backward, not per micro-batch), after the
LR scheduler stepped, from rank 0 only, each event at x = `global_samples` after the step counted
its `train_batch_size` samples:
- `Train/Samples/lr`: `get_lr()[0]`, the first param group's lr as the scheduler left it;
- `Train/Samples/loss_scale` under fp16: the loss scale after the step's update (halved after an
  overflow); a step skipped on overflow writes both too;
- with `wall_clock_breakdown`: `Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,
  backward_allreduce,step}`, the window's time in each phase in ms.
DeepSpeedEngine 0.19.8 writes no train loss (its backward did in older releases; PR 3428).
DeepSpeed's PipelineEngine still writes `Train/Samples/train_loss`: the mean of the window's
micro-batch losses, averaged over the data-parallel ranks, at the same x; this module writes it
that way under that name. Then offloadpp's own figures from the step's StepReport (rank 0's),
under `Train/offloadpp/` with their units in the names. docs/deepspeed.md, "Monitors", lists them.
"""

from __future__ import annotations

import contextlib
import io
from typing import Callable, Optional

import torch

from offloadpp.integrations.deepspeed.config import OffloadppConfigError

# block -> (the package DeepSpeed's writer imports, how to install it)
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
    "comet": ("comet_ml", 'pip install "comet_ml>=3.41.0"'),
}
PREFIX = "Train/offloadpp/"

# StepReport fields written as they are, each under PREFIX + its name (units in the names)
_REPORT_FIELDS = (
    "step_s", "forward_s", "backward_s", "optimizer_wait_s", "fetch_wait_s", "compute_s", "adam_s",
    "recompute_s", "ssd_s", "floor_s", "ssd_read_bytes", "ssd_write_bytes", "host_to_device_bytes",
    "device_to_host_bytes", "fetch_misses",
)  # fmt: skip
# BudgetUse names (runtime/config.py) -> the series of their peak in the step
_PEAKS = {
    "device": "peak_device_bytes",
    "host": "peak_host_bytes",
    "activations": "peak_activations_bytes",
    "activation staging": "peak_activation_staging_bytes",
}


def check_packages(monitor_config) -> None:
    """Each enabled block's package importable, else an error naming the block and the package,
    at initialize rather than at the first step (DeepSpeed's own checks, which also hold comet_ml
    to its least version; their hint on stdout is replaced by the error's)."""
    from deepspeed.monitor.utils import (
        check_comet_availability,
        check_tb_availability,
        check_wandb_availability,
    )

    checks = {"tensorboard": check_tb_availability, "wandb": check_wandb_availability,
              "comet": check_comet_availability}  # fmt: skip
    for block, check in checks.items():
        if not getattr(monitor_config, block).enabled:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                check()
        except ImportError as e:
            package, install = PACKAGES[block]
            raise OffloadppConfigError(
                f"{block}.enabled: DeepSpeed's {block} monitor needs the {package!r} package, which cannot be "
                f'imported here ({e}); `{install}`, or set "{block}": {{"enabled": false}}'
            ) from None


def monitor_master(ds_config, rank: int):
    """DeepSpeed's MonitorMaster for this config, as DeepSpeedEngine builds it (every rank has
    one; only rank 0's writes); None where DeepSpeed's comm is not started (initialize with
    dist_init_required=False and no process group), where no monitor can be enabled."""
    import deepspeed.comm as dist
    from deepspeed.monitor.monitor import MonitorMaster

    cfg = ds_config.monitor_config
    if not dist.is_initialized():
        if cfg.enabled:
            raise OffloadppConfigError(
                "tensorboard/wandb/csv_monitor/comet: DeepSpeed's monitors write from rank 0 through deepspeed.comm, "
                "which is not started (initialize was called with dist_init_required=False and no process group); "
                "start one (deepspeed.init_distributed()) or let initialize start it"
            )
        return None
    if cfg.enabled and rank == 0:
        check_packages(cfg)
    return MonitorMaster(cfg)


class StepEvents:
    """The events of each step, into DeepSpeed's MonitorMaster (module docstring, Note).
    `backward` adds a micro-batch's loss; `write` at the end of each step that ends a window.
    `sum_over_ranks` sums a float over the data-parallel ranks (None: one rank)."""

    def __init__(self, master, *, rank: int, world: int, fp16: bool, wall_clock: bool,
                 sum_over_ranks: Optional[Callable[[float], float]] = None):  # fmt: skip
        self.master = master
        self.rank, self.world = rank, world
        self.fp16, self.wall_clock = fp16, wall_clock
        self._sum_over_ranks = sum_over_ranks
        self._loss: Optional[torch.Tensor] = None  # the window's sum of loss / gas, on the device

    @property
    def enabled(self) -> bool:
        return self.master is not None and self.master.enabled

    def backward(self, loss: torch.Tensor, factor: float) -> None:
        """A micro-batch's loss, times the factor its gradient was taken with (1/gas, or 1 where
        the caller scaled it itself): the window's sum is then the step's mean loss either way.
        Kept on the device: no synchronisation until the step ends."""
        if not self.enabled:
            return
        part = loss.detach().float() * factor
        self._loss = part if self._loss is None else self._loss + part

    def discard(self) -> None:
        """Forgets the open window's losses (a window rolled back writes nothing)."""
        self._loss = None

    def write(self, *, samples: int, lr: float, loss_scale: Optional[float], report) -> list:
        """Writes the step's events at x = samples (rank 0; every rank takes part in the loss's
        mean over the ranks); returns them (rank 0's, [] elsewhere)."""
        if not self.enabled:
            return []
        loss = float(self._loss) if self._loss is not None else float("nan")
        self._loss = None
        if self._sum_over_ranks is not None and self.world > 1:
            loss = self._sum_over_ranks(loss) / self.world
        if self.rank != 0:
            return []
        events = [("Train/Samples/lr", lr, samples)]
        if self.fp16 and loss_scale is not None:
            events.append(("Train/Samples/loss_scale", loss_scale, samples))
        self.master.write_events(events)  # DeepSpeed's own first write of the step, as its engine makes it
        more = [("Train/Samples/train_loss", loss, samples)]
        if report is not None:
            if self.wall_clock:
                more += wall_clock_events(report, samples)
            more += report_events(report, samples)
        self.master.write_events(more)
        return events + more


def wall_clock_events(report, samples: int) -> list:
    """DeepSpeed's `wall_clock_breakdown` events from the step report, in ms: forward and backward
    as the report times them (every micro-batch of the window), backward_inner the whole backward
    (offloadpp's reductions run inside it, on their own threads), backward_allreduce 0 (there is no
    reduction phase after backward), step the wait for the optimizer's updates at the step's end."""
    ms = 1000.0
    return [
        ("Train/Samples/elapsed_time_ms_forward", report.forward_s * ms, samples),
        ("Train/Samples/elapsed_time_ms_backward", report.backward_s * ms, samples),
        ("Train/Samples/elapsed_time_ms_backward_inner", report.backward_s * ms, samples),
        ("Train/Samples/elapsed_time_ms_backward_allreduce", 0.0, samples),
        ("Train/Samples/elapsed_time_ms_step", report.optimizer_wait_s * ms, samples),
    ]


def report_events(report, samples: int) -> list:
    """offloadpp's StepReport as events under PREFIX: its times and bytes, each budget's peak in
    the step, the gradient norm (when the step computed it) and, over several ranks, the
    collectives' bytes and time."""
    out = [(PREFIX + name, getattr(report, name), samples) for name in _REPORT_FIELDS]
    out += [(PREFIX + _PEAKS[b.name], b.peak_bytes, samples) for b in report.budgets if b.name in _PEAKS]
    if report.grad_norm is not None:
        out.append((PREFIX + "grad_norm", float(report.grad_norm), samples))
    if report.ranks > 1:
        out += [
            (PREFIX + "comm_bytes", report.comm_bytes, samples),
            (PREFIX + "comm_s", report.comm_s, samples),
        ]
    return out
