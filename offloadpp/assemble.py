"""From a model and a RuntimeConfig to a planned OffloadEngine: gathers what the resolve stage
needs (the model's units, what the machine has free, the profiles) and calls it.

    resolved = resolve_for_model(model, settings)      # budgets and the Plan, nothing built
    engine = assemble_engine(model, config, hyper=AdamHyper(lr=1e-4))

`offloadpp.initialize`, `offloadpp plan` and the benchmarks all come through here, and the
resolve stage itself is pure (planner/resolve.py), so the plan `offloadpp plan` prints is the
plan `offloadpp.initialize` runs on the same machine. The runtime is handed the finished plan.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Optional, Sequence

from torch import nn

from offloadpp.optim import AdamHyper, default_num_threads
from offloadpp.planner import PLAN_AUTO, Machine, Resolved, Settings, resolve
from offloadpp.planner.resolve import load_hardware, load_saved_plan, model_profile_for
from offloadpp.runtime import OffloadEngine, RuntimeConfig, unit_specs
from offloadpp.runtime.device import device_kind


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


def probe_machine(device: Optional[str], nvme_paths: Sequence[str] = ()) -> Machine:
    """What the machine has free now, for the resolve stage."""
    import psutil
    import torch

    kind = device_kind(device)
    dev_free = None
    if kind == "cuda":
        dev_free, _total = torch.cuda.mem_get_info(torch.device(device or "cuda"))
    return Machine(
        device=kind,
        host_available_bytes=int(psutil.virtual_memory().available),
        device_free_bytes=dev_free,
        ssd_free_bytes=free_ssd_bytes(nvme_paths),
        cores=default_num_threads(),
    )


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
) -> Resolved:
    """The budgets and the plan for `model` under `settings` on this machine (or `machine`):
    the model's units, what is free on `device` and the `nvme_paths`, the profiles the settings
    name, through planner.resolve. The model may live on the meta device (nothing is read)."""
    s = settings
    units = unit_specs(model, s.units)
    machine = machine or probe_machine(device, nvme_paths)
    hardware = profile = None
    if s.plan == PLAN_AUTO or s.hardware_profile:
        hardware = load_hardware(s.hardware_profile)
        cfg = _hf_config(model)
        name = str((cfg or {}).get("_name_or_path") or (cfg or {}).get("model_type") or type(model).__name__)
        profile = model_profile_for(cfg, units, s, name=name)
    return resolve(s, units, machine, hardware=hardware, model=profile, saved=load_saved_plan(s))


def assemble_engine(
    model: nn.Module,
    config: RuntimeConfig,
    *,
    hyper: Optional[AdamHyper] = None,
    init_fn: Optional[Callable[[nn.Module], None]] = None,
    progress: bool = False,
    machine: Optional[Machine] = None,
) -> OffloadEngine:
    """resolve_for_model, then an OffloadEngine running that plan."""
    r = resolve_for_model(
        model, config.settings, device=config.device, nvme_paths=config.nvme_paths, machine=machine
    )
    config = config.model_copy(update={"settings": r.settings})
    return OffloadEngine(
        model, config, r.plan, hyper=hyper, init_fn=init_fn, progress=progress, predicted=r.estimate
    )


__all__ = ["assemble_engine", "free_ssd_bytes", "probe_machine", "resolve_for_model"]
