"""RuntimeConfig (what the engine is asked to do) and StepReport (what one step did).

RuntimeConfig is the only place the runtime's defaults live (DESIGN.md, convention 6): frozen,
extra keys refused, validated once at the boundary; errors name the field and the value.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from offloadpp.io import IOConfig
from offloadpp.planner import fmt_bytes

ActivationPolicyName = Literal["keep", "host", "ssd", "recompute", "auto"]


class RuntimeConfig(BaseModel):
    """How the OffloadEngine trains a model.

    nvme_paths: directories for the swap files (one per SSD); created if missing, must be writable.
    device_budget_bytes: bytes of runtime buffers on the device (weights, one unit's gradients);
        activations are not counted. On the CPU acting as the device, a budget enforced by the plan.
    host_budget_bytes: bytes of host memory for optimizer state, gradients and staging buffers.
    prefetch_depth: weights of the unit k visits ahead are fetched while one computes (None: the
        plan picks 2, 1 or 0 to fit the device budget).
    optim_prefetch_depth: optimizer state is read for this many units ahead of the one updating
        (None: the plan picks, up to 2).
    gradient_accumulation_steps: micro-batches per optimizer step; backward() scales the loss by
        1/gradient_accumulation_steps, as DeepSpeed does.
    gradient_clipping: clip gradients to this global L2 norm before the update (0: off). Exact, as
        torch.nn.utils.clip_grad_norm_; the updates then wait for the end of backward.
    compute_dtype: "fp32", or "bf16"/"fp16" with fp32 master weights (16-bit needs CUDA for speed;
        it runs on the CPU too, slowly, for tests).
    device: "cuda", "cuda:N" or "cpu"; None picks cuda when available, else the CPU as the device.
    adam_threads: threads of the fused CPU Adam, which runs while backward computes; default
        every core this process may run on. Note: on the CPU-as-device, where torch's threads
        fill every core, one Adam thread stalls one torch thread and with it every parallel
        region (the others wait at its barrier); Adam spread over all cores delays each of them
        by the same share instead (measured: offloadpp bench step, 1.10x vs 1.15x plain torch).
    loss_scale: fp16 only; 0 means dynamic loss scaling (initial 2**initial_scale_power, halved on
        overflow after `hysteresis` overflows in a row, doubled after loss_scale_window clean steps,
        never below min_loss_scale), otherwise a static scale. Overflowing steps are skipped.
    units: explicit unit split, each a list of module qualified names (in forward order); None
        finds the blocks of Hugging Face GPT-2/Llama/Qwen2/OPT/GPT-NeoX and of any model with an
        nn.ModuleList of blocks.
    ssd_read_gbps / ssd_write_gbps: SSD bandwidth for the step floor; None measures it once with a
        short write and read through the store when the engine starts.
    log_every: log a step report every this many optimizer steps (0: never).
    plan: None: the default placement policy; "auto": the cost-model planner (docs/planner.md)
        with the hardware profile `offloadpp profile` cached (or hardware_profile) and a model
        profile (model_profile, else analytic from the Hugging Face config at plan_micro_batch x
        plan_seq_len); otherwise the path of a plan JSON (`offloadpp plan --json`). An explicit
        plan passed to the engine wins over this.
    activations: what happens to the tensors autograd saves in each unit's forward (docs/activations.md):
        "keep" on the device, "host" (pinned host memory), "ssd", "recompute" in backward, or "auto"
        (keep what fits activation_budget_bytes, then host). A plan that names policies wins.
    activation_overrides: per-unit policies by unit name, overriding `activations`.
    activation_budget_bytes: device bytes for saved activations (None: no budget); forward waits
        for swap-outs and backward prefetches only within it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    nvme_paths: tuple[str, ...]
    device_budget_bytes: int = Field(gt=0)
    host_budget_bytes: int = Field(gt=0)
    prefetch_depth: Optional[int] = Field(None, ge=0)
    optim_prefetch_depth: Optional[int] = Field(None, ge=0)
    gradient_accumulation_steps: int = Field(1, ge=1)
    gradient_clipping: float = Field(0.0, ge=0.0)
    compute_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    device: Optional[str] = None
    adam_threads: int = Field(default_factory=lambda: len(os.sched_getaffinity(0)), ge=1)
    loss_scale: float = Field(0.0, ge=0.0)
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    min_loss_scale: float = Field(1.0, gt=0.0)
    io: IOConfig = IOConfig()
    units: Optional[tuple[tuple[str, ...], ...]] = None
    ssd_read_gbps: Optional[float] = Field(None, gt=0.0)
    ssd_write_gbps: Optional[float] = Field(None, gt=0.0)
    log_every: int = Field(1, ge=0)
    plan: Optional[str] = None
    hardware_profile: Optional[str] = None
    model_profile: Optional[str] = None
    plan_micro_batch: Optional[int] = Field(None, ge=1)
    plan_seq_len: Optional[int] = Field(None, ge=1)
    activations: ActivationPolicyName = "keep"
    activation_overrides: Optional[dict[str, ActivationPolicyName]] = None
    activation_budget_bytes: Optional[int] = Field(None, gt=0)

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
        if v is not None and not (v == "cpu" or v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @field_validator("units")
    @classmethod
    def _units(cls, v):
        if v is not None and (not v or any(not u for u in v)):
            raise ValueError("units must be a non-empty list of non-empty lists of module names")
        return v

    @property
    def deferred_update(self) -> bool:
        """Updates need a global quantity first (clip norm, fp16 overflow) and wait for backward."""
        return self.gradient_clipping > 0 or self.compute_dtype == "fp16"


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
    the engine started. floor_s = max(compute_s, ssd_s, adam_s): what the step cannot beat.
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
    activation_peak_bytes: int = 0  # accounted saved activations on the device (docs/activations.md)
    recompute_s: float = 0.0  # of backward_s, re-running the forward of recompute units

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        extra = ""
        if self.predicted_s is not None and self.step_s > 0:
            extra += (
                f" predicted {self.predicted_s:.3f}s ({(self.predicted_s - self.step_s) / self.step_s:+.0%})"
            )
        if self.activation_peak_bytes:
            extra += f" act-peak {fmt_bytes(self.activation_peak_bytes)}"
        if self.recompute_s:
            extra += f" recompute {self.recompute_s:.3f}s"
        if self.grad_norm is not None:
            extra += f" grad_norm={self.grad_norm:.4g}"
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
