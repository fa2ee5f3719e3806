"""Every setting of a training run and its default, defined once (DESIGN.md, "one spine").

    Settings            what the user asks for: budgets ("auto" = None), precision, prefetch
                        depths, activation policies, how the plan is made.
    Budgets             the byte budgets a run holds to, after the resolve stage (resolve.py)
                        turned the requests into numbers; part of every Plan.

Pure: pydantic and the standard library only, so the planner, the CLI and the DeepSpeed block can
all read it. Components compose these models instead of copying their fields: the runtime's
RuntimeConfig holds a Settings; the DeepSpeed `"offloadpp"` block is Settings with `"auto"`
allowed for every key (integrations/deepspeed/config.py derives it from this file, so a field added
here is reachable from the JSON without further work). Frozen, extra keys refused, validated once;
errors name the field and the bad value (convention 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

ComputeDtype = Literal["fp32", "bf16", "fp16"]
ActivationPolicyName = Literal[
    "keep", "host", "ssd", "recompute", "recompute_host", "recompute_ssd", "partial", "partial_host", "partial_ssd",
    "recompute_nested", "recompute_nested_host", "recompute_nested_ssd", "grad_in_forward", "partial_host_tail",
    "recompute_pieces", "recompute_pieces_host", "recompute_pieces_ssd", "partial_last", "partial_last_host",
    "partial_last_ssd", "partial_refetch_host", "partial_refetch_ssd", "recompute_pieces_refetch_host",
    "recompute_pieces_refetch_ssd", "partial_last_refetch_host", "partial_last_refetch_ssd", "auto",
]  # fmt: skip
# Bytes per element of the dtypes the runtime uses, by the names the settings use.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
COMPUTE_DTYPES = tuple(DTYPE_BYTES)
ACTIVATION_POLICIES: tuple[str, ...] = get_args(ActivationPolicyName)  # (one list: the Literal's)
# the fused head's own policy (runtime/activations/head.py, Note on gradients in forward): a
# per-unit override of the head's unit, never the policy of every unit
HEAD_ONLY_POLICIES = ("grad_in_forward",)
PLAN_DEFAULT = "default"
PLAN_AUTO = "auto"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LossScaling(_Frozen):
    """fp16 loss scaling, with DeepSpeed's meaning of each key (its `fp16` block fills them).

    loss_scale: 0 means dynamic: start at 2**initial_scale_power, halve after `hysteresis`
        overflows (never below min_loss_scale), double after loss_scale_window clean steps;
        otherwise a static scale. Overflowing steps are skipped.
    consecutive_hysteresis: a clean step restores the full hysteresis, so only overflows in a
        row count against it (otherwise only a growth of the scale restores it).
    """

    loss_scale: float = Field(0.0, ge=0.0)
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    min_loss_scale: float = Field(1.0, gt=0.0)
    consecutive_hysteresis: bool = False


class ActivationSettings(_Frozen):
    """What happens to the tensors autograd saves in each unit's forward (docs/activations.md).

    policy: of every unit not named in `overrides`: "keep" on the device, "host" (pinned host
        memory), "ssd", "recompute" in backward (its inputs, the activation checkpoint, kept on the
        device), "recompute_host" / "recompute_ssd" (recompute, the checkpoint swapped to host
        memory / on to SSD and fetched back ahead of the recompute), "partial" / "partial_host" /
        "partial_ssd" (selective recomputation: the outputs of matmuls, attention and dropout kept,
        or swapped with the checkpoint; only the cheap operators run again), "recompute_nested" /
        "recompute_nested_host" / "recompute_nested_ssd" (recompute from the one checkpoint kept or
        swapped as recompute*'s, holding the block's pieces' boundaries, then each piece again
        when backward reaches it: one piece's saved tensors at a time), "recompute_pieces" /
        "recompute_pieces_host" / "recompute_pieces_ssd" (each piece, a block's norms, attention,
        MLP, recomputed once from its own checkpoint kept or swapped: the compute of a whole
        recompute at one piece's peak, two checkpoints a block), "partial_last" /
        "partial_last_host" / "partial_last_ssd" (recompute_pieces*, the last piece, a block's MLP,
        partial*'s: its matmuls' outputs kept or swapped with the checkpoints), "partial_refetch_*" /
        "recompute_pieces_refetch_*" / "partial_last_refetch_*" (host or ssd: those swapped, a
        norm's checkpoint sent back once the next piece's argument is made from it and fetched
        again for the norm: one checkpoint less at a piece's recompute, one more copy up), "partial_host_tail"
        (partial_host, the records of the unit's last two pieces kept on the device: a block's
        second norm and MLP, which backward needs first), or "auto": the planner chooses per unit (plan
        "auto": by the cost model, within the room the placement leaves; otherwise keep what fits
        the budget, the fewest FLOPs per byte first, then host, then SSD; with no budget, keep).
    overrides: per-unit policies by unit name (unknown names are refused when the units are known).
        The fused head's unit (a causal LM's output embedding, fused_loss) may also take
        "grad_in_forward": its loss's forward makes the gradients of h, W and b chunk by chunk and
        holds them (grad_h in the compute dtype, grad_W in fp32) in place of the logits; backward
        scales them by the incoming gradient (runtime/activations/head.py, Note on gradients in
        forward). Refused as `policy` and on any other unit.
    budget_bytes: device bytes the saved activations may take, a part of the device budget (None:
        what the device budget leaves once the runtime's buffers are counted, when a model profile
        says how large the activations are; else no limit). Forward waits for swap-outs when it
        would pass it; backward prefetches only within it.
    host_budget_bytes: host bytes swapped activations may take before "auto" sends them to SSD
        (None: no limit, so "auto" never picks SSD).
    prefetch_units: backward fetches the activations of this many units ahead of the one it runs.
    min_swap_bytes: saved storages smaller than this are kept (an I/O costs more than it saves).
    fused_loss: a Hugging Face causal LM's head matmul and loss run fused, chunk by chunk
        (runtime/activations/head.py): in training with labels the whole logits are never made,
        nor their gradient; the head keeps its logits for backward or, where its policy
        recomputes, computes them again chunk by chunk. `outputs.logits` is then a placeholder
        that refuses to be read; false: the model's own head and loss, logits returned.
    """

    policy: ActivationPolicyName = "auto"
    overrides: Mapping[str, ActivationPolicyName] = {}
    budget_bytes: Optional[int] = Field(None, gt=0)
    host_budget_bytes: Optional[int] = Field(None, gt=0)
    prefetch_units: int = Field(2, ge=0)
    min_swap_bytes: int = Field(64 << 10, ge=0)
    fused_loss: bool = True

    @field_validator("policy")
    @classmethod
    def _not_head_only(cls, v: str) -> str:
        if v in HEAD_ONLY_POLICIES:
            raise ValueError(
                f"activations.policy {v!r} applies to the fused head's unit only: name that unit in "
                f'activations.overrides (e.g. {{"head": "{v}"}}) instead'
            )
        return v


class Settings(_Frozen):
    """What a run asks for. None means "decided by the resolve stage" (the JSON's "auto").

    offload_params / offload_optimizer: the weights / the fp32 master weights and Adam moments
        live on SSD (ZeRO-Infinity's `offload_param` / `offload_optimizer` with device "nvme").
        Then an "auto" device / host budget is what streaming that state from SSD needs and no
        more; otherwise it is a share of the memory free when the run starts (resolve.py).
    device_budget_bytes: bytes of the runtime's buffers on the device (weights, a unit's
        gradients); on the CPU acting as the device, a budget the runtime accounts and keeps.
    host_budget_bytes: bytes of host memory for optimizer state, gradients and staging buffers.
    compute_dtype: "fp32", or "bf16"/"fp16" with fp32 master weights (16-bit needs CUDA for
        speed; it runs on the CPU too, slowly, for tests).
    loss_scaling: fp16 only.
    gradient_accumulation_steps: micro-batches per optimizer step; backward() scales the loss by
        1/gradient_accumulation_steps, as DeepSpeed does.
    accumulation: how a window of gradient_accumulation_steps micro-batches driven whole (DeepSpeed's
        `train_batch`, the Trainer's window under `offloadpp run`) runs: "vertical" visits each unit
        once per window, forward over all its micro-batches while the unit's weights are resident
        and backward likewise, its gradient summed on the device and handed to the optimizer once
        (the activations of every micro-batch held between forward and backward); "horizontal"
        runs the micro-batches one after another, each reading every unit's weights and moving
        its gradients through their home; "auto": the faster by the cost model (the plan's
        `vertical`, planner/decide.py accumulation). A per-micro-batch loop (forward, backward,
        step) always runs horizontally. With gradient_accumulation_steps 1 there is no window.
    gradient_clipping: clip gradients to this global L2 norm before the update (0: off); exact, as
        torch.nn.utils.clip_grad_norm_.
    speculate: with clipping or fp16, whose updates need the global norm or the overflow check
        first: "on" updates each unit during backward with its raw gradients and, at the end of
        backward, commits if the clip coefficient is exactly 1 and nothing overflowed, else
        restores the state and redoes the updates with the clipped gradients (or skips the step
        on overflow), exactly; "off" defers every update to the end of backward; "auto"
        speculates while recent steps validated (with clipping: from the third step in a row
        within the limit) and defers while clipping keeps triggering (docs/runtime.md). Speculation keeps a second generation of the optimizer state on SSD;
        "auto" defers where the SSDs lack the room, "on" is then an error. "auto" also defers
        where overlapping the updates with backward cannot buy what the cost model can tell
        (planner/decide.py overlap_pays: a LoRA run's trainable state is about 1% of a step's
        bytes), clipping or not: the optimizer state then has one generation on SSD.
    defer_updates: run every update after backward (at each unit's next visit on the CPU
        device), even without clipping or fp16: one generation of the optimizer state on SSD
        instead of two, no overlap of Adam with backward. The resolve stage sets it where
        speculate "auto" finds the overlap not worth it (decide.overlap_pays).
    prefetch_depth: weights of the unit k visits ahead are fetched while one computes (None: the
        plan picks the deepest that fits, up to 2 for the default plan).
    optim_prefetch_depth: optimizer state is read this many units ahead of the one updating (None:
        the plan picks).
    fill_gaps: keep a unit's weights between two uses in a step where no peak grows; False drops
        them after every use (strict streaming, for benchmarks).
    adam_threads: threads of the fused CPU Adam (None: every core this process may run on).
        Note: on the CPU acting as the device torch's threads fill every core, and one Adam
        thread stalls one torch thread and with it every parallel region (the others wait at
        its barrier); Adam spread over all cores delays each by the same share instead
        (docs/runtime.md has the measurement).
    activations: the activation policies and budget.
    units: an explicit split of the model into units, each a list of module qualified names in
        forward order (None: the runtime finds the blocks of the model).
    plan: "default" (the rule-based placement of planner/default.py), "auto" (the cost-model
        planner, docs/planner.md; needs a hardware profile from `offloadpp profile`), or the
        path of a plan JSON written by `offloadpp plan --json`.
    hardware_profile: the hardware profile JSON for plan "auto" (None: the cache `offloadpp
        profile` writes, see planner.hardware.default_profile_path).
    model_profile: a measured model profile JSON for plan "auto" (None: analytic from the
        model's Hugging Face config).
    micro_batch / seq_len: the shape of one micro-batch, for the analytic model profile (None:
        the DeepSpeed config's micro-batch, else 1; the model's context length).
    collective_gbps: over several data-parallel ranks, the bus bandwidth of their collectives
        (GB/s, an all-gather's (N-1)/N of the bytes over its time) for the estimate (None: measured
        over the ranks when the run starts, else the hardware profile's).
    network_gbps: between nodes, each node's network bandwidth for the estimate of a plan for
        ranks on several nodes (None: the hardware profile's).
    """

    offload_params: bool = True
    offload_optimizer: bool = True
    device_budget_bytes: Optional[int] = Field(None, gt=0)
    host_budget_bytes: Optional[int] = Field(None, gt=0)
    compute_dtype: ComputeDtype = "fp32"
    loss_scaling: LossScaling = LossScaling()
    gradient_accumulation_steps: int = Field(1, ge=1)
    accumulation: Literal["auto", "vertical", "horizontal"] = "auto"
    gradient_clipping: float = Field(0.0, ge=0.0)
    speculate: Literal["auto", "on", "off"] = "auto"
    defer_updates: bool = False
    prefetch_depth: Optional[int] = Field(None, ge=0)
    optim_prefetch_depth: Optional[int] = Field(None, ge=0)
    fill_gaps: bool = True
    adam_threads: Optional[int] = Field(None, ge=1)
    activations: ActivationSettings = ActivationSettings()
    units: Optional[tuple[tuple[str, ...], ...]] = None
    plan: str = PLAN_DEFAULT
    hardware_profile: Optional[str] = None
    model_profile: Optional[str] = None
    micro_batch: Optional[int] = Field(None, ge=1)
    seq_len: Optional[int] = Field(None, ge=1)
    collective_gbps: Optional[float] = Field(None, gt=0.0)
    network_gbps: Optional[float] = Field(None, gt=0.0)

    @field_validator("units")
    @classmethod
    def _units(cls, v):
        if v is not None and (not v or any(not u for u in v)):
            raise ValueError("units must be a non-empty list of non-empty lists of module names")
        return v

    @field_validator("plan")
    @classmethod
    def _plan(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError("plan must be 'default', 'auto' or the path of a plan JSON")
        return v

    @property
    def deferred_update(self) -> bool:
        """Updates need a global quantity first (clip norm, fp16 overflow), or are asked to
        (defer_updates), and wait for backward."""
        return self.gradient_clipping > 0 or self.compute_dtype == "fp16" or self.defer_updates

    @property
    def accumulate_grads(self) -> bool:
        return self.gradient_accumulation_steps > 1

    @property
    def plan_path(self) -> Optional[str]:
        """The plan file to run, when `plan` names one."""
        return None if self.plan in (PLAN_DEFAULT, PLAN_AUTO) else self.plan


@dataclass(frozen=True)
class Budgets:
    """The byte budgets a run holds to (the resolve stage's answer to Settings' requests).

    device_bytes: everything the run holds on the device: the runtime's buffers (weights, a
        unit's gradients) and, when activation_bytes is set, the saved activations.
    host_bytes: the runtime's host buffers (optimizer state, gradients, staging). Its pools
        account every buffer against these and wait or raise rather than pass them.
    activation_bytes: the part of device_bytes the saved activations may take; the buffers get
        the rest (`buffer_bytes`). None: the activations are neither limited nor counted (no
        model profile said how large they are).
    (Free SSD space is not a budget but a fact of the machine: planner.resolve.Machine.)
    """

    device_bytes: int
    host_bytes: int
    activation_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Budgets.{name} must be an int > 0, got {v!r}")
        v = self.activation_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"Budgets.activation_bytes must be an int >= 0 or None, got {v!r}")
        if v is not None and v >= self.device_bytes:
            raise ValueError(
                f"Budgets.activation_bytes ({v}) must be less than device_bytes ({self.device_bytes}): "
                "the activations are a part of the device budget, the runtime's buffers need the rest"
            )

    @property
    def buffer_bytes(self) -> int:
        """Device bytes for the runtime's buffers: the device budget less the activations'."""
        return self.device_bytes - (self.activation_bytes or 0)


__all__ = [
    "ACTIVATION_POLICIES",
    "HEAD_ONLY_POLICIES",
    "COMPUTE_DTYPES",
    "DTYPE_BYTES",
    "ActivationSettings",
    "Budgets",
    "LossScaling",
    "Settings",
]
