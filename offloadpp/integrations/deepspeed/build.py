"""From a DeepSpeed config with an enabled `offloadpp` block to a running OffloadppEngine.

DeepSpeed's own `DeepSpeedConfig` parses what DeepSpeed defines (batch sizes, optimizer,
scheduler, clipping, precision), so those keys keep DeepSpeed's semantics exactly; the `offloadpp`
block (already validated) supplies the rest. Budgets and the plan come from the one resolve
stage (offloadpp/assemble.py -> planner/resolve.py), as for `offloadpp plan`.

Under a launcher (`deepspeed`, torchrun) the ranks start torch.distributed through DeepSpeed's
own init_distributed (so DeepSpeed's config sees the world size), NCCL on CUDA and gloo on the
CPU, each on the device LOCAL_RANK names, and train data-parallel (runtime/dp/distributed.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from pydantic import ValidationError

from offloadpp.integrations.deepspeed.config import (
    OffloadppBlock,
    OffloadppConfigError,
    aio_not_applied,
    check_aio,
    validate_settings,
    validation_error,
)
from offloadpp.integrations.deepspeed.keys import check_keys
from offloadpp.integrations.deepspeed.monitor import monitor_master
from offloadpp.integrations.deepspeed.optimizer import (
    OffloadppOptimizer,
    OptimizerError,
    adam_hyper_from_ds,
    client_adamw_mode,
    hyper_from,
)
from offloadpp.planner import Settings
from offloadpp.runtime import RuntimeConfig
from offloadpp.runtime.state import remap_param_groups

logger = logging.getLogger("offloadpp")

_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


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

    params = ds_config.scheduler_params or {}
    if not isinstance(params, dict):
        raise OffloadppConfigError(f"scheduler.params: expected an object, got {params!r}")
    try:
        return getattr(lr_schedules, name)(optimizer, **params)
    except (TypeError, ValueError, AssertionError) as e:
        raise OffloadppConfigError(f"scheduler.params: DeepSpeed's {name} refuses them: {e}") from None


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
            consecutive_hysteresis=bool(fp16.consecutive_hysteresis),
        )
    return validate_settings({**ds, **block.settings})


def runtime_config_from(ds_config, block: OffloadppBlock, device: Optional[str]) -> RuntimeConfig:
    """RuntimeConfig for this DeepSpeed config (a DeepSpeedConfig) and offloadpp block."""
    spp = ds_config.steps_per_print
    extra: dict[str, Any] = {}
    if spp is not None:  # None: our default. Trainer sets inf to silence DeepSpeed: never log
        extra["log_every"] = int(spp) if math.isfinite(spp) and spp > 0 else 0
    for k in ("ssd_read_gbps", "ssd_write_gbps"):
        if getattr(block, k) is not None:
            extra[k] = getattr(block, k)
    if block.keep_swap:
        extra["keep_swap"] = True
    settings = settings_from(ds_config, block)
    try:
        return RuntimeConfig(nvme_paths=swap_dirs(block.nvme_paths), settings=settings, io=block.io, device=device,
                             **extra)  # fmt: skip
    except ValidationError as e:
        raise validation_error("offloadpp.", e) from None


def _positive_int(ds: dict, key: str) -> None:
    v = ds.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise OffloadppConfigError(f"{key}: expected a whole number >= 1, got {v!r}")


def parse_ds_config(ds_dict: dict):
    """DeepSpeed's own DeepSpeedConfig of a config with the block enabled, after the key table
    (keys.py) refused what offloadpp cannot run and dropped what it ignores. DeepSpeed's own
    errors (its assertions included) come back as OffloadppConfigError."""
    from deepspeed.runtime.config import DeepSpeedConfig

    checked = check_keys(ds_dict, OffloadppConfigError)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        _positive_int(checked, key)
    for key in ("gradient_clipping", "steps_per_print"):  # DeepSpeed compares them with numbers
        v = checked.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise OffloadppConfigError(f"{key}: expected a number >= 0, got {v!r}")
    for key in ("optimizer", "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization", "aio"):
        if key in checked and not isinstance(checked[key], dict):
            raise OffloadppConfigError(f"{key}: expected an object of keys, got {checked[key]!r}")
    check_aio(ds_dict.get("aio"))  # (its keys are not applied, so the table dropped them from `checked`)
    sched = checked.get("scheduler")
    if isinstance(sched, dict) and sched.get("type") is None:
        # DeepSpeed reads a scheduler block without a type as no scheduler, its params unused
        raise OffloadppConfigError(
            f"scheduler.type: the scheduler block names no type, so no scheduler would run; set one of "
            f"{list(_SCHEDULERS)} (or remove the block)"
        )
    if not any(k in checked for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        raise OffloadppConfigError(
            "train_micro_batch_size_per_gpu: the config sets no batch size; set it (or train_batch_size)"
        )
    try:
        return DeepSpeedConfig(checked)
    except Exception as e:  # DeepSpeed raises AssertionError, ValueError, TypeError, its own errors
        raise OffloadppConfigError(f"DeepSpeed's config check: {type(e).__name__}: {e}") from None


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORT_TRIES = 5


def ensure_process_group(dist_init_required: Optional[bool], distributed_port: Optional[int]) -> int:
    """What DeepSpeedEngine does at start: a torch.distributed process group through
    deepspeed.init_distributed (Trainer and Accelerate gather through it). Under a launcher
    (torchrun, deepspeed) its environment says where; started with plain python, this process is
    rank 0 of 1 on a free local port (DeepSpeed would ask for MPI or those variables). Returns
    the world size."""
    import torch.distributed as tdist

    if dist_init_required is not False and not tdist.is_initialized():
        own_port = False
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            single = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            own_port = distributed_port is None and "MASTER_PORT" not in os.environ
            single["MASTER_PORT"] = str(distributed_port or _free_port())
            for k, v in single.items():
                os.environ.setdefault(k, v)
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        from offloadpp.runtime.dp.distributed import (
            agent_attempt,
            backend_for,
            launch_env,
            start_process_group,
        )

        backend = backend_for(
            "cuda" if get_accelerator().device_name() == "cuda" else "cpu"
        )  # NCCL, else gloo
        env = launch_env()
        if env is not None and agent_attempt() is not None:
            # under torchrun's agent: the group starts on a store of its attempt's own, as it restarts
            # (runtime/dp/distributed.py, elastic_store), and DeepSpeed adopts the started group
            from deepspeed.constants import default_pg_timeout

            start_process_group(backend, env, default_pg_timeout)
        for attempt in range(_PORT_TRIES):
            try:
                with _without_shm_comm():
                    deepspeed.init_distributed(
                        dist_backend=backend, dist_init_required=dist_init_required, verbose=False
                    )
                break
            except tdist.DistNetworkError as e:
                # A port this process chose for itself was free when probed and taken before the
                # store bound it (a busy machine): another free port, never one a launcher gave.
                if not own_port or "EADDRINUSE" not in str(e) or attempt == _PORT_TRIES - 1:
                    raise
                os.environ["MASTER_PORT"] = str(_free_port())
    elif tdist.is_initialized():
        import deepspeed
        import deepspeed.comm

        # The script made the process group itself (torch.distributed.init_process_group):
        # DeepSpeed's comm layer, which its config reads the world size from (1 until it is
        # started), wraps that group, as DeepSpeedEngine's own init_distributed call does.
        if not deepspeed.comm.is_initialized():
            with _without_shm_comm():
                deepspeed.init_distributed(dist_backend=tdist.get_backend(), verbose=False)
    return tdist.get_world_size() if tdist.is_initialized() else 1


@contextlib.contextmanager
def _without_shm_comm():
    """DeepSpeed's torch backend on the CPU accelerator JIT-builds its shared-memory all-reduce
    op (minutes on first use, and a wait on its build lock) and maps two 66 MB
    /dev/shm/deepspeed_allreduce_buffer_* files it never removes. offloadpp's collectives go
    through torch.distributed itself (runtime/dp/distributed.py), so on our path the backend is
    made without that op: DeepSpeed's comm falls back to torch.distributed where it is None."""
    import importlib

    try:  # (`from deepspeed.comm import torch` is the torch package: deepspeed.comm imports it)
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # another DeepSpeed layout: nothing to hold back
        yield
        return
    build = getattr(ds_torch_comm, "build_shm_op", None)
    if build is None:
        yield
        return
    ds_torch_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch_comm.build_shm_op = build


def device_for_rank() -> str:
    """The device of this process, as DeepSpeed picks it: its accelerator (CUDA, or the CPU
    acting as the device) and the launcher's LOCAL_RANK."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    name = acc.device_name()
    if name == "cpu":
        return "cpu"
    if name != "cuda":
        raise OffloadppConfigError(
            f"DeepSpeed's accelerator is {name!r}; offloadpp's runtime runs on CUDA or on the CPU as the device"
        )
    acc.set_device(local_rank)
    return f"cuda:{local_rank}"


def _check_model(model) -> None:
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise OffloadppConfigError(
            "model: a PipelineModule (pipeline parallelism) is not supported by offloadpp"
        )


def _optimizer_for(ds_config, model, optimizer, model_parameters) -> tuple[OffloadppOptimizer, Any]:
    """The engine's optimizer object: around the optimizer passed to initialize (DeepSpeed uses
    it over the config's block), else from the config's block over model_parameters."""
    try:
        if optimizer is not None:
            client = optimizer
            if not isinstance(client, torch.optim.Optimizer) and callable(client):
                params = model_parameters if model_parameters is not None else model.parameters()
                client = client(params)  # DeepSpeed's callable optimizer: built over the parameters
            if not isinstance(client, torch.optim.Optimizer):
                raise OptimizerError(
                    f"optimizer=: expected a torch.optim.Optimizer or a callable, got {client!r}"
                )
            adamw = client_adamw_mode(client)
            g0 = client.param_groups[0] if client.param_groups else {}
            defaults = hyper_from(dict(g0, params=None), adamw=adamw, where="optimizer param group 0: ")
            return OffloadppOptimizer(None, defaults, client=client), client
        hyper = adam_hyper_from_ds(ds_config.optimizer_name, ds_config.optimizer_params)
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        return OffloadppOptimizer(params, hyper), None
    except OptimizerError as e:
        raise OffloadppConfigError(str(e)) from None


@dataclass(eq=False, frozen=True)
class Given:
    """What the caller of initialize gave besides the config (deepspeed.initialize's arguments)."""

    model: torch.nn.Module
    optimizer: Any = None
    model_parameters: Any = None
    training_data: Any = None
    lr_scheduler: Any = None
    collate_fn: Any = None


def build_engine(ds_dict: dict, block: OffloadppBlock, given: Given, *, dist_init_required=None,
                 distributed_port=None):  # fmt: skip
    model, optimizer, model_parameters = given.model, given.optimizer, given.model_parameters
    training_data, lr_scheduler, collate_fn = given.training_data, given.lr_scheduler, given.collate_fn
    from offloadpp.assemble import assemble_engine
    from offloadpp.integrations.deepspeed.engine import OffloadppEngine

    world = ensure_process_group(dist_init_required, distributed_port)
    rank = torch.distributed.get_rank() if world > 1 else 0
    ds_config = parse_ds_config(ds_dict)
    if ds_config.world_size != world:
        raise OffloadppConfigError(
            f"the config's data-parallel world size is {ds_config.world_size} but the launcher started {world} "
            "ranks (sequence or model parallel sizes): offloadpp trains data-parallel over every rank only"
        )
    _check_model(model)
    monitor = monitor_master(ds_config, rank)  # a monitor's missing package fails here, before the build
    opt, _ = _optimizer_for(ds_config, model, optimizer, model_parameters)  # (opt.client: the caller's own)
    groups = opt.groups_by_name(model)
    for name, p in model.named_parameters():
        if p.requires_grad and name not in groups:
            raise OffloadppConfigError(
                f"model_parameters: parameter {name!r} requires grad but is not among the optimizer's parameters; "
                "offloadpp updates every trainable parameter: set requires_grad=False on the ones to freeze"
            )
    hypers = opt.hypers()
    rcfg = runtime_config_from(ds_config, block, device=device_for_rank())
    runtime = assemble_engine(model, rcfg, hyper=hypers[0])
    remap_param_groups(opt, runtime.replaced_params)  # a model built under offloadpp.Init
    try:
        scheduler = _scheduler(ds_config, opt, lr_scheduler)
        loader = _dataloader(ds_config, training_data, collate_fn, rank=rank, world=world)
        engine = OffloadppEngine(runtime, ds_dict, ds_config, opt, groups=groups, lr_scheduler=scheduler,
                                 training_dataloader=loader, collate_fn=collate_fn)  # fmt: skip
        engine.attach_monitor(monitor)
    except BaseException:
        runtime.close()
        raise
    not_applied = aio_not_applied(ds_dict, runtime.store.config)
    if not_applied is not None:  # (a WARNING: settings the user wrote are not used)
        logger.warning("offloadpp: %s", not_applied)
    logger.info("offloadpp: engine ready on %s\n%s", engine.device, runtime.plan.describe())
    return engine, opt, loader, scheduler
