"""From a model and a RuntimeConfig to a planned OffloadEngine: gathers what the resolve stage
needs (the model's units, what the machine has free, the profiles) and calls it.

    resolved = resolve_for_model(model, settings)      # budgets and the Plan, nothing built
    engine = assemble_engine(model, config, hyper=AdamHyper(lr=1e-4))

`offloadpp.initialize`, `offloadpp plan` and the benchmarks all come through here, and the
resolve stage itself is pure (planner/resolve.py), so the plan `offloadpp plan` prints is the
plan `offloadpp.initialize` runs on the same machine. The runtime is handed the finished plan.

Note: many ranks. Under a launcher (torchrun, the deepspeed launcher) torch.distributed is
started from its environment and the engine trains data-parallel (runtime/dp/distributed.py). Every
rank must run the same plan, or their collectives would not pair: the ranks agree on what the
machine has (the least of each, taken by every rank) before the pure resolve stage, and check
that their plans are equal before building anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from typing import Callable, Mapping, Optional, Sequence

from torch import nn

from offloadpp.optim import AdamHyper, default_num_threads
from offloadpp.planner import PLAN_AUTO, Machine, Resolved, Settings, resolve
from offloadpp.planner.planfile import plan_to_dict
from offloadpp.planner.resolve import load_hardware, load_saved_plan, model_profile_for
from offloadpp.runtime import OffloadEngine, RuntimeConfig, unit_specs
from offloadpp.runtime.accel import device_memory, launch_kind, plan_device
from offloadpp.runtime.dp.distributed import DataParallel, init_from_env


def free_ssd_bytes(paths: Sequence[str]) -> Optional[int]:
    """Free bytes on the filesystems of `paths` (each counted once); None if one is missing."""
    free, seen = 0, set()
    for p in paths:
        if not os.path.isdir(p):
            return None
        dev = os.stat(p).st_dev
        if dev not in seen:
            seen.add(dev)
            free += shutil.disk_usage(p).free
    return free if seen else None


def probe_machine(
    device: Optional[str], nvme_paths: Sequence[str] = (), dp: Optional[DataParallel] = None
) -> Machine:
    """What the machine has free now, for the resolve stage (with `dp`: the node's, as every
    rank sees it, and the ranks: Machine.rank_share)."""
    import psutil

    kind = plan_device(device)  # (the stand-in plans as a device with memory of its own)
    dev_free = dev_total = None
    mem = device_memory(device)
    if mem is not None:
        dev_free, dev_total = mem
    vm = psutil.virtual_memory()
    m = Machine(
        device=kind,
        host_available_bytes=int(vm.available),
        device_free_bytes=dev_free,
        host_total_bytes=int(vm.total),
        device_total_bytes=dev_total,
        ssd_free_bytes=free_ssd_bytes(nvme_paths),
        cores=default_num_threads(),
    )
    if dp is None:
        return m
    # Cores: a launcher pins each rank to its share (or not): the node's are what the rank sees
    # times the ranks pinned beside it; unpinned, every rank sees them all.
    cores = m.cores * dp.local_world if m.cores * dp.local_world <= (os.cpu_count() or m.cores) else m.cores
    m = replace(m, cores=cores, ranks=dp.world, local_ranks=dp.local_world, collective_gbps=dp.measure_gbps())
    return agreed_machine(m, dp)


def agreed_machine(m: Machine, dp: DataParallel) -> Machine:
    """The least of each rank's numbers, the same on every rank (see the module Note)."""
    seen = dp.all_gather_object(
        (m.host_available_bytes, m.device_free_bytes, m.ssd_free_bytes, m.cores, m.collective_gbps)
    )

    def least(i):
        vals = [v[i] for v in seen if v[i] is not None]
        return min(vals) if vals else None

    return replace(m, host_available_bytes=least(0), device_free_bytes=least(1), ssd_free_bytes=least(2),
                   cores=least(3), collective_gbps=least(4))  # fmt: skip


def data_parallel(device: Optional[str]) -> Optional[DataParallel]:
    """The data-parallel ranks of this run: torch.distributed started from the launcher's
    environment if it says so (runtime/dp/distributed.py), None when this process is alone."""
    init_from_env(launch_kind(device))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DataParallel()
    return None


def _hf_config(model: nn.Module) -> Optional[dict]:
    cfg = getattr(model, "config", None)
    return cfg.to_dict() if cfg is not None and hasattr(cfg, "to_dict") else None


def resolve_for_model(
    model: nn.Module,
    settings: Settings,
    *,
    device: Optional[str] = None,
    nvme_paths: Sequence[str] = (),
    machine: Optional[Machine] = None,
    dp: Optional[DataParallel] = None,
    io_set: Optional[Mapping[str, int]] = None,
) -> Resolved:
    """The budgets and the plan for `model` under `settings` on this machine (or `machine`):
    the model's units, what is free on `device` and the `nvme_paths`, the profiles the settings
    name, through planner.resolve. The model may live on the meta device (nothing is read).
    io_set: the I/O settings the run fixes itself (RuntimeConfig.io_set)."""
    s = settings
    units = unit_specs(
        model, s.units, split_frozen=dp is None
    )  # frozen segments on one rank (docs/frozen.md)
    machine = machine or probe_machine(device, nvme_paths, dp)
    hardware = profile = None
    if s.plan == PLAN_AUTO or s.hardware_profile:
        hardware = load_hardware(s.hardware_profile)
        cfg = _hf_config(model)
        name = str((cfg or {}).get("_name_or_path") or (cfg or {}).get("model_type") or type(model).__name__)
        profile = model_profile_for(cfg, units, s, name=name)
    return resolve(
        s, units, machine, hardware=hardware, model=profile, saved=load_saved_plan(s), io_set=io_set
    )


def assemble_engine(
    model: nn.Module,
    config: RuntimeConfig,
    *,
    hyper: Optional[AdamHyper] = None,
    init_fn: Optional[Callable[[nn.Module], None]] = None,
    progress: bool = False,
    machine: Optional[Machine] = None,
    dp: Optional[DataParallel] = None,
) -> OffloadEngine:
    """resolve_for_model, then an OffloadEngine running that plan. Under a launcher with several
    ranks, data parallel (dp: the ranks, default data_parallel(config.device))."""
    dp = dp if dp is not None else data_parallel(config.device)
    try:
        if dp is not None and machine is None:
            machine = probe_machine(config.device, config.nvme_paths, dp)
        r = resolve_for_model(
            model,
            config.settings,
            device=config.device,
            nvme_paths=config.nvme_paths,
            machine=machine,
            dp=dp,
            io_set=config.io_set(),
        )
        settings = r.settings
        if dp is not None:
            dp.check_same("the plan", plan_digest(r.plan))
            if settings.collective_gbps is None and machine.collective_gbps:
                # measured over the ranks just now: the engine's floor uses it too
                settings = settings.model_copy(update={"collective_gbps": machine.collective_gbps})
        config = config.model_copy(update={"settings": settings})
        return OffloadEngine(
            model,
            config,
            r.plan,
            hyper=hyper,
            init_fn=init_fn,
            progress=progress,
            predicted=(r.estimate, r.deferred_estimate, r.loop_estimate),
            dp=dp,
        )
    except BaseException:
        if dp is not None:
            dp.close()
        raise


def plan_digest(plan) -> str:
    """A plan's identity across processes (its JSON, hashed)."""
    text = json.dumps(plan_to_dict(plan), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


__all__ = ["assemble_engine", "data_parallel", "free_ssd_bytes", "probe_machine", "resolve_for_model"]
