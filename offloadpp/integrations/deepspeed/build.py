"""From a DeepSpeed config with an enabled `offloadpp` block to a running OffloadppEngine.

DeepSpeed's own `DeepSpeedConfig` parses what DeepSpeed defines (batch sizes, optimizer,
scheduler, clipping, precision), so those keys keep DeepSpeed's semantics exactly; the `offloadpp`
block (already validated) supplies the rest. Budgets and the plan come from the one resolve
stage (offloadpp/assemble.py -> planner/resolve.py), as for `offloadpp plan`.

Under a launcher (`deepspeed`, torchrun) the ranks start torch.distributed through DeepSpeed's
own init_distributed (so DeepSpeed's config sees the world size), NCCL on CUDA and gloo on the
CPU, each on the device LOCAL_RANK names, and train data-parallel (runtime/distributed.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from offloadpp.integrations.deepspeed.config import (
    OffloadppBlock,
    OffloadppConfigError,
    validate_settings,
)
from offloadpp.optim import AdamHyper
from offloadpp.planner import Settings
from offloadpp.runtime import RuntimeConfig
from offloadpp.runtime.state import remap_param_groups

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


def _dataloader(ds_config, training_data, collate_fn, rank: int = 0, world: int = 1):
    if training_data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    # The sampler DeepSpeed uses for each data-parallel rank (shuffled, seed 0), so the order matches.
    sampler = DistributedSampler(training_data, num_replicas=world, rank=rank)
    return DataLoader(
        training_data,
        batch_size=ds_config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=ds_config.dataloader_drop_last,
    )


SWAP_SUBDIR = "offloadpp"


def swap_dirs(nvme_paths, create: bool = True) -> tuple[str, ...]:
    """Our swap files go in an `offloadpp` folder under each nvme path, so nothing else in those
    directories is touched (create=False: only named, for planning). The nvme path must exist: a typo or an SSD that is not
    mounted must not put the training state on the root disk."""
    out = []
    for path in nvme_paths:
        path = os.fspath(path)
        if not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise OffloadppConfigError(
                f"offloadpp.nvme_paths: {path!r} {what}; create it or mount the SSD there (offloadpp does not "
                "create it, so a typo cannot put the training state on another disk)"
            )
        d = os.path.join(path, SWAP_SUBDIR)
        if not create:
            out.append(d if os.path.isdir(d) else path)
            continue
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise OffloadppConfigError(f"offloadpp.nvme_paths: cannot create {d!r}: {e.strerror}") from None
        out.append(d)
    return tuple(out)


def settings_from(ds_config, block: OffloadppBlock) -> Settings:
    """The run's Settings: what DeepSpeed's own keys say, then what the block sets."""
    fp16, bf16 = ds_config.float16_config, ds_config.bfloat16_config
    if fp16.enabled and bf16.enabled:
        raise OffloadppConfigError("fp16 and bf16 are both enabled; choose one")
    zero = ds_config.zero_config
    ds: dict[str, Any] = dict(
        compute_dtype="fp16" if fp16.enabled else ("bf16" if bf16.enabled else "fp32"),
        gradient_accumulation_steps=int(ds_config.gradient_accumulation_steps or 1),
        gradient_clipping=float(ds_config.gradient_clipping or 0.0),
        micro_batch=int(ds_config.train_micro_batch_size_per_gpu or 1),
        offload_params=zero.offload_param is not None and zero.offload_param.device == "nvme",
        offload_optimizer=zero.offload_optimizer is not None and zero.offload_optimizer.device == "nvme",
    )
    if fp16.enabled:
        ds["loss_scaling"] = dict(
            loss_scale=float(fp16.loss_scale),
            initial_scale_power=int(fp16.initial_scale_power),
            loss_scale_window=int(fp16.loss_scale_window),
            hysteresis=int(fp16.hysteresis),
            min_loss_scale=float(fp16.min_loss_scale),
        )
    return validate_settings({**ds, **block.settings})


def runtime_config_from(ds_config, block: OffloadppBlock, device: Optional[str]) -> RuntimeConfig:
    """RuntimeConfig for this DeepSpeed config (a DeepSpeedConfig) and offloadpp block."""
    spp = ds_config.steps_per_print
    extra: dict[str, Any] = {"log_every": int(spp)} if spp is not None else {}  # None: our default
    for k in ("ssd_read_gbps", "ssd_write_gbps"):
        if getattr(block, k) is not None:
            extra[k] = getattr(block, k)
    return RuntimeConfig(
        nvme_paths=swap_dirs(block.nvme_paths),
        settings=settings_from(ds_config, block),
        io=block.io,
        device=device,
        **extra,
    )


def start_distributed(*, dist_init_required: Optional[bool] = None, distributed_port: Optional[int] = None):
    """torch.distributed through DeepSpeed's init_distributed when the launcher's environment
    says so (or the caller started it); on CUDA the rank's device becomes cuda:LOCAL_RANK.
    Returns (the device spec, the LaunchEnv or None for a single process)."""
    import torch
    import torch.distributed as dist

    from offloadpp.runtime.device import device_kind
    from offloadpp.runtime.distributed import backend_for, device_for, launch_env

    env = launch_env()
    kind = device_kind(None)
    if env is None and not (dist.is_available() and dist.is_initialized()):
        return None, None
    if kind == "cuda" and env is not None:
        torch.cuda.set_device(env.local_rank)
    import deepspeed.comm as ds_comm

    kw = {"distributed_port": distributed_port} if distributed_port is not None else {}
    ds_comm.init_distributed(dist_backend=backend_for(kind), auto_mpi_discovery=False, verbose=False,
                             dist_init_required=dist_init_required, **kw)  # fmt: skip
    return (device_for(kind, env) if kind == "cuda" else None), env


def build_engine(ds_dict: dict, block: OffloadppBlock, *, model, model_parameters, training_data,
                 lr_scheduler, collate_fn, dist_init_required: Optional[bool] = None,
                 distributed_port: Optional[int] = None):  # fmt: skip
    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    from offloadpp.assemble import assemble_engine
    from offloadpp.integrations.deepspeed.engine import OffloadppEngine
    from offloadpp.integrations.deepspeed.optimizer import OffloadppOptimizer

    device, _env = start_distributed(dist_init_required=dist_init_required, distributed_port=distributed_port)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    ds_config = DeepSpeedConfig(ds_dict)
    if ds_config.world_size != world:
        raise OffloadppConfigError(
            f"the config's data-parallel world size is {ds_config.world_size} but the launcher started {world} "
            "ranks (sequence or model parallel sizes): offloadpp trains data-parallel over every rank only"
        )
    hyper = adam_hyper_from_ds(ds_config.optimizer_name, ds_config.optimizer_params)
    rcfg = runtime_config_from(ds_config, block, device=device)
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    optimizer = OffloadppOptimizer(params, hyper)
    runtime = assemble_engine(model, rcfg, hyper=hyper)
    remap_param_groups(optimizer, runtime.replaced_params)  # a model built under offloadpp.Init
    scheduler = _scheduler(ds_config, optimizer, lr_scheduler)
    loader = _dataloader(ds_config, training_data, collate_fn, rank=rank, world=world)
    engine = OffloadppEngine(runtime, ds_config, optimizer, scheduler, loader)
    logger.info("offloadpp: engine ready\n%s", runtime.plan.describe())
    return engine, optimizer, loader, scheduler
