"""From a DeepSpeed config with an enabled `offloadpp` block to a running OffloadppEngine.

DeepSpeed's own `DeepSpeedConfig` parses what DeepSpeed defines (batch sizes, optimizer,
scheduler, clipping, precision), so those keys keep DeepSpeed's semantics exactly; the `offloadpp`
block (already validated) supplies the rest.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from offloadpp.integrations.deepspeed.config import OffloadppBlock, OffloadppConfigError, parse_bytes
from offloadpp.optim import AdamHyper

logger = logging.getLogger("offloadpp")

_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
# Keys of DeepSpeed's Adam block that select an implementation, not a hyper-parameter.
_IMPL_KEYS = ("torch_adam", "fp32_optimizer_states", "adam_w_mode")


def adam_hyper_from_ds(name: Optional[str], params: Optional[dict]) -> AdamHyper:
    """DeepSpeed's optimizer block -> AdamHyper, with DeepSpeed's semantics: type "Adam" is AdamW
    unless `adam_w_mode` is false; "AdamW" is always AdamW."""
    if name is None:
        raise OffloadppConfigError(
            "optimizer: offloadpp needs an 'optimizer' block of type Adam or AdamW in the DeepSpeed config"
        )
    lowered = name.lower()
    if lowered not in ("adam", "adamw"):
        raise OffloadppConfigError(f"optimizer.type: offloadpp supports Adam and AdamW, got {name!r}")
    params = dict(params or {})
    adam_w_mode = bool(params.get("adam_w_mode", True))
    if params.get("amsgrad"):
        raise OffloadppConfigError("optimizer.params.amsgrad: not supported (as in DeepSpeedCPUAdam)")
    for key in _IMPL_KEYS + ("amsgrad",):
        params.pop(key, None)
    betas = params.pop("betas", (0.9, 0.999))
    known = {"lr", "eps", "weight_decay", "bias_correction"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise OffloadppConfigError(f"optimizer.params: unsupported key(s) {unknown} for offloadpp's Adam")
    try:
        return AdamHyper(
            lr=params.get("lr", 1e-3),
            beta1=betas[0],
            beta2=betas[1],
            eps=params.get("eps", 1e-8),
            weight_decay=params.get("weight_decay", 0.0),
            bias_correction=params.get("bias_correction", True),
            adamw_mode=lowered == "adamw" or adam_w_mode,
        )
    except ValueError as e:
        raise OffloadppConfigError(f"optimizer.params: {e}") from None


def _streaming_budgets(
    model, device: str, compute: str, gas: int, deferred: bool, prefetch_depth, available: int
) -> tuple[int, int, int]:
    """(device, host) bytes the runtime needs to stream every array from SSD, and the optimizer
    read-ahead q they are sized for.

    Note: deferred updates (clipping, fp16) run after backward; the state of the first q+1 of
    them is read during backward. With q covering every unit the updates wait for no read at
    all (measured on GPT-2 45M with clipping: 1.16x plain torch against 1.24x at q=2), so q is
    the largest whose host buffers take at most a quarter of the memory available now."""
    from offloadpp.planner.default import DEFAULT_OPTIM_PREFETCH, min_budgets
    from offloadpp.runtime import find_units, layout_units

    specs = [lay.spec() for lay in layout_units(model, find_units(model))]
    top = max(0, len(specs) - 1)
    qs = (
        range(top, min(DEFAULT_OPTIM_PREFETCH, top) - 1, -1)
        if deferred
        else [min(DEFAULT_OPTIM_PREFETCH, top)]
    )
    for q in qs:
        dev, host = min_budgets(
            specs,
            device="cuda" if device.startswith("cuda") else "cpu",
            compute_dtype=compute,
            prefetch_depth=2 if prefetch_depth is None else prefetch_depth,
            optim_prefetch_depth=q,
            accumulate_grads=gas > 1,
            deferred_update=deferred,
        )
        if host <= available // 4:
            break
    return dev, host, q


def _budgets(
    block: OffloadppBlock, ds_config, model, device: str, compute: str
) -> tuple[int, int, Optional[int]]:
    """Byte budgets: explicit values as given. "auto" follows the ZeRO-Infinity settings beside the
    block: where they put parameters (offload_param) or optimizer state (offload_optimizer) on
    NVMe, the matching budget is what streaming that state from SSD needs, so the state lives on
    SSD as the user asked; elsewhere it is a share of what the machine has free now."""
    import psutil

    zero = ds_config.zero_config
    param_nvme = zero.offload_param is not None and zero.offload_param.device == "nvme"
    optim_nvme = zero.offload_optimizer is not None and zero.offload_optimizer.device == "nvme"
    streaming = None
    available = psutil.virtual_memory().available
    if (block.device_budget == "auto" and param_nvme) or (block.host_budget == "auto" and optim_nvme):
        deferred = bool(ds_config.gradient_clipping) or compute == "fp16"
        streaming = _streaming_budgets(
            model, device, compute, ds_config.gradient_accumulation_steps, deferred, block.prefetch_depth,
            available,
        )  # fmt: skip
    if block.host_budget != "auto":
        host = parse_bytes(block.host_budget)
    elif optim_nvme:
        host = streaming[1]
    else:
        host = available // 2  # the rest for activations, the model's own code and the OS
    if block.device_budget != "auto":
        dev = parse_bytes(block.device_budget)
    elif param_nvme:
        dev = streaming[0]
    elif device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        dev = int(free * 0.8)  # the rest for activations and the allocator's slack
    else:
        dev = available // 4
    return dev, host, streaming[2] if streaming is not None else None


def _scheduler(ds_config, optimizer, lr_scheduler):
    if lr_scheduler is not None:
        return (
            lr_scheduler(optimizer)
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step")
            else lr_scheduler
        )
    name = ds_config.scheduler_name
    if name is None:
        return None
    if name not in _SCHEDULERS:
        raise OffloadppConfigError(
            f"scheduler.type: unknown scheduler {name!r}; DeepSpeed's are {list(_SCHEDULERS)}"
        )
    from deepspeed.runtime import lr_schedules

    return getattr(lr_schedules, name)(optimizer, **(ds_config.scheduler_params or {}))


def _dataloader(ds_config, training_data, collate_fn):
    if training_data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    # The sampler DeepSpeed uses for one data-parallel rank (shuffled, seed 0), so the order matches.
    sampler = DistributedSampler(training_data, num_replicas=1, rank=0)
    return DataLoader(
        training_data,
        batch_size=ds_config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=ds_config.dataloader_drop_last,
    )


SWAP_SUBDIR = "offloadpp"


def swap_dirs(nvme_paths) -> tuple[str, ...]:
    """Our swap files go in an `offloadpp` folder under each nvme path, created as ZeRO-Infinity
    creates its own, so nothing else in those directories is touched."""
    out = []
    for path in nvme_paths:
        d = os.path.join(os.fspath(path), SWAP_SUBDIR)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise OffloadppConfigError(f"offloadpp.nvme_paths: cannot create {d!r}: {e.strerror}") from None
        out.append(d)
    return tuple(out)


def runtime_config_from(ds_config, block: OffloadppBlock, device: str, model):
    """RuntimeConfig for this DeepSpeed config and offloadpp block."""
    from offloadpp.io import IOConfig
    from offloadpp.runtime import RuntimeConfig

    fp16, bf16 = ds_config.float16_config, ds_config.bfloat16_config
    if fp16.enabled and bf16.enabled:
        raise OffloadppConfigError("fp16 and bf16 are both enabled; choose one")
    compute = "fp16" if fp16.enabled else ("bf16" if bf16.enabled else "fp32")
    dev_budget, host_budget, optim_prefetch = _budgets(block, ds_config, model, device, compute)
    extra: dict[str, Any] = {}
    if compute == "fp16":
        extra = dict(
            loss_scale=float(fp16.loss_scale),
            initial_scale_power=int(fp16.initial_scale_power),
            loss_scale_window=int(fp16.loss_scale_window),
            hysteresis=int(fp16.hysteresis),
            min_loss_scale=float(fp16.min_loss_scale),
        )
    return RuntimeConfig(
        nvme_paths=swap_dirs(block.nvme_paths),
        device_budget_bytes=dev_budget,
        host_budget_bytes=host_budget,
        prefetch_depth=block.prefetch_depth,
        optim_prefetch_depth=optim_prefetch,
        gradient_accumulation_steps=ds_config.gradient_accumulation_steps,
        gradient_clipping=float(ds_config.gradient_clipping or 0.0),
        compute_dtype=compute,
        device=device,
        io=IOConfig(
            backend=block.io.backend,
            block_size_bytes=block.io.block_size_bytes,
            queue_depth=block.io.queue_depth,
            num_threads=block.io.num_threads,
            checksum=block.io.checksum,
        ),
        log_every=ds_config.steps_per_print,
        plan=block.plan,
        hardware_profile=block.hardware_profile,
        model_profile=block.model_profile,
        plan_micro_batch=ds_config.train_micro_batch_size_per_gpu,
        plan_seq_len=block.seq_len,
        **extra,
    )


def build_engine(ds_dict: dict, block: OffloadppBlock, *, model, model_parameters, training_data,
                 lr_scheduler, collate_fn):  # fmt: skip
    from deepspeed.runtime.config import DeepSpeedConfig

    from offloadpp.integrations.deepspeed.engine import OffloadppEngine
    from offloadpp.integrations.deepspeed.optimizer import OffloadppOptimizer
    from offloadpp.runtime import OffloadEngine

    ds_config = DeepSpeedConfig(ds_dict)
    if ds_config.world_size != 1:
        raise OffloadppConfigError(
            f"offloadpp trains on one device; the launcher started {ds_config.world_size}"
        )
    hyper = adam_hyper_from_ds(ds_config.optimizer_name, ds_config.optimizer_params)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rcfg = runtime_config_from(ds_config, block, device, model)
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    optimizer = OffloadppOptimizer(params, hyper)
    runtime = OffloadEngine(model, rcfg, hyper=hyper, plan=None)
    scheduler = _scheduler(ds_config, optimizer, lr_scheduler)
    loader = _dataloader(ds_config, training_data, collate_fn)
    engine = OffloadppEngine(runtime, ds_config, optimizer, scheduler, loader)
    logger.info("offloadpp: engine ready\n%s", runtime.plan.describe() if hasattr(runtime, "plan") else "")
    return engine, optimizer, loader, scheduler
