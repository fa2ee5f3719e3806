"""save_checkpoint / load_checkpoint for OffloadppEngine.

Layout, DeepSpeed's convention of one folder per tag and a `latest` file naming the newest:

    save_dir/latest                      the tag of the newest checkpoint
    save_dir/TAG/offloadpp_state.safetensors  fp32 master weights and Adam moments, by parameter name
    save_dir/TAG/engine.json             step counters, per-parameter Adam steps, LR scheduler,
                                         loss scaler, hyper-parameters
    save_dir/TAG/client_state.pt         the caller's client_state (arbitrary objects)

A checkpoint is written to a temporary folder and renamed into place, so a crash mid-save never
leaves a folder that loads as valid. Resuming restores everything the next step depends on, so a
resumed run continues exactly as one that never stopped (given the same batches).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch

STATE_FILE = "offloadpp_state.safetensors"
ENGINE_FILE = "engine.json"
CLIENT_FILE = "client_state.pt"
SECTIONS = ("params", "exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    pass


# What a scheduler may have changed in a param group (OneCycle cycles betas), restored on load.
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def _names(engine) -> list:
    return [s.name for u in engine.runtime.units for _, s in u.params]


def _frozen(engine) -> set:
    return {s.name for u in engine.runtime.units for _, s in u.params if not s.requires_grad}


def save_engine_checkpoint(engine, save_dir: str, tag: str, client_state: dict, save_latest: bool, *,
                           exclude_frozen_parameters: bool = False) -> str:  # fmt: skip
    from safetensors.torch import save_file

    if os.sep in tag or tag in ("", ".", ".."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain folder name")
    os.makedirs(save_dir, exist_ok=True)
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    sd = engine.runtime.state_dict()
    frozen = _frozen(engine) if exclude_frozen_parameters else set()
    tensors = {
        f"{sec}/{name}": t.contiguous()
        for sec in SECTIONS
        for name, t in sd[sec].items()
        if name not in frozen
    }
    save_file(tensors, os.path.join(tmp, STATE_FILE))
    meta = {
        "format": 1,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "runtime": {k: v for k, v in sd.items() if k not in SECTIONS},
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "param_groups_lr": [g["lr"] for g in engine.optimizer.param_groups],
        "param_groups_hyper": [
            {k: (list(g[k]) if k == "betas" else g[k]) for k in _GROUP_KEYS if k in g}
            for g in engine.optimizer.param_groups
        ],
    }
    with open(os.path.join(tmp, ENGINE_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    torch.save(client_state, os.path.join(tmp, CLIENT_FILE))

    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    if save_latest:
        latest_tmp = os.path.join(save_dir, ".latest.partial")
        with open(latest_tmp, "w") as f:
            f.write(tag)
        os.replace(latest_tmp, os.path.join(save_dir, "latest"))
    return final


def _resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def load_engine_checkpoint(engine, load_dir: str, tag: Optional[str], *, load_optimizer_states: bool,
                           load_lr_scheduler_states: bool, strict: bool = True) -> tuple[Optional[str], Any]:  # fmt: skip
    """Returns (path, client_state), or (None, None) when there is no checkpoint, as DeepSpeed."""
    from safetensors.torch import load_file

    tag = _resolve_tag(load_dir, tag)
    if tag is None:
        return None, None
    path = os.path.join(load_dir, tag)
    for name in (STATE_FILE, ENGINE_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path!r} is incomplete: {name} is missing")
    with open(os.path.join(path, ENGINE_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != 1:
        raise CheckpointError(
            f"checkpoint {path!r} has format {meta.get('format')!r}; this offloadpp reads 1"
        )
    flat = load_file(os.path.join(path, STATE_FILE))
    sd: dict = {sec: {} for sec in SECTIONS}
    for key, t in flat.items():
        sec, name = key.split("/", 1)
        sd[sec][name] = t
    runtime_meta = dict(meta["runtime"])
    # Parameters the checkpoint lacks keep their current state: frozen ones it was saved without
    # (exclude_frozen_parameters), and with strict=False any (DeepSpeed's load_module_strict).
    missing = [n for n in _names(engine) if n not in sd["params"]]
    bad = [n for n in missing if n not in _frozen(engine)] if strict else []
    if bad:
        raise CheckpointError(
            f"checkpoint {path!r} has no state for parameter {bad[0]!r} ({len(bad)} missing); "
            "load_module_strict=False keeps the current values of missing parameters"
        )
    if missing:
        current = engine.runtime.state_dict()
        for sec in SECTIONS:
            for n in missing:
                sd[sec][n] = current[sec][n]
        runtime_meta["param_steps"] = {**current["param_steps"], **runtime_meta["param_steps"]}
    if not load_optimizer_states:
        # Keep this engine's moments and steps; take the weights only.
        current = engine.runtime.state_dict()
        sd["exp_avg"], sd["exp_avg_sq"] = current["exp_avg"], current["exp_avg_sq"]
        runtime_meta["param_steps"] = current["param_steps"]
    sd.update(runtime_meta)
    engine.runtime.load_state_dict(sd)

    engine.global_steps = meta["global_steps"]
    engine.micro_steps = meta["micro_steps"]
    engine.global_samples = meta["global_samples"]
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    for g, lr in zip(engine.optimizer.param_groups, meta["param_groups_lr"]):
        g["lr"] = lr
    for g, hyper in zip(engine.optimizer.param_groups, meta.get("param_groups_hyper", ())):
        g.update({k: (tuple(v) if k == "betas" else v) for k, v in hyper.items()})
    engine._push_lr()
    client_file = os.path.join(path, CLIENT_FILE)
    client_state = torch.load(client_file, weights_only=False) if os.path.isfile(client_file) else {}
    return path, client_state
