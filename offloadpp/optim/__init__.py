"""Optimizers: CPUAdam (drop-in for DeepSpeedCPUAdam) and the fused flat-buffer kernel entry
points the out-of-core optimizer streams state shards through."""

from offloadpp.optim.cpu_adam import AMSGradNotSupportedError, CPUAdam
from offloadpp.optim.hyper import AdamHyper
from offloadpp.optim.kernels import (
    AdamStep,
    adam_step_flat,
    adam_step_pieces,
    all_finite,
    bandwidth_floor,
    convert_,
    default_num_threads,
    kernel_isa,
    simd_levels,
    squared_norm,
    sum_parts_,
)

__all__ = [
    "CPUAdam",
    "AMSGradNotSupportedError",
    "AdamHyper",
    "AdamStep",
    "adam_step_flat",
    "adam_step_pieces",
    "squared_norm",
    "all_finite",
    "convert_",
    "sum_parts_",
    "bandwidth_floor",
    "default_num_threads",
    "kernel_isa",
    "simd_levels",
]
