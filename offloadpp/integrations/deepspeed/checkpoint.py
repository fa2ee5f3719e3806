"""save_checkpoint / load_checkpoint for OffloadppEngine: DeepSpeed's layout, crash-consistent.

    save_dir/latest          the tag of the newest checkpoint (replaced atomically)
    save_dir/TAG/            the runtime's checkpoint (runtime/checkpoint.py: manifest, state)
        engine.pt            step counters, the LR scheduler, each group's lr
        rng.pt               the random number generators' states (torch, CUDA, random, numpy)
        client_state.pt      the caller's client_state

Over several ranks (runtime/sharded_checkpoint.py) each rank writes its shards and its own
rng.pt into TAG/rankNNNNN/; engine.pt, client_state.pt and the global manifest are rank 0's, and
rank 0 alone renames the folder and writes `latest`, after every rank's part is durable.

Note: what a crash leaves. A checkpoint is written under `.TAG.partial`, every file fdatasync'ed,
the folder fsync'ed, the manifest last; only then does it take the name TAG (replacing an older
TAG atomically: the old one stays valid until the new one is in place), and only then does
`latest` name it. So at any instant `latest` names a complete, verified checkpoint, whatever
moment a kill -9 or power cut lands on (tests/test_crash.py). Folders of saves that died half
way are removed by the next save. Resuming restores everything the next step depends on, so a
resumed run continues bit for bit as one that never stopped (given the same batches).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from typing import Any, Optional

import torch

from offloadpp.io.durable import recover_aside, swap_into_place, write_atomic
from offloadpp.runtime.checkpoint import CheckpointError

log = logging.getLogger("offloadpp")

ENGINE_FILE = "engine.pt"
RNG_FILE = "rng.pt"
CLIENT_FILE = "client_state.pt"
PARTIAL = ".partial"


def _check_tag(tag: str) -> None:
    if os.sep in tag or tag in ("", ".", "..") or tag.startswith(".") or tag == "latest":
        raise CheckpointError(
            f"checkpoint tag {tag!r} must be a plain folder name (not hidden, not 'latest')"
        )


def rng_states() -> dict:
    import numpy as np

    out = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict) -> None:
    import numpy as np

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _remove_dead_partials(save_dir: str) -> None:
    for name in os.listdir(save_dir):
        if name.startswith(".") and name.endswith(PARTIAL):
            path = os.path.join(save_dir, name)
            log.warning("offloadpp: removing %s, left by a save that did not finish", path)
            shutil.rmtree(path, ignore_errors=True)


# What a scheduler may change in a param group (OneCycle cycles betas), restored on load.
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def save_engine_checkpoint(engine, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> str:
    _check_tag(tag)
    dp = engine.runtime.dp
    lead = dp is None or dp.rank == 0
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}{PARTIAL}")
    if lead:
        os.makedirs(save_dir, exist_ok=True)
        recover_aside(final)
        _remove_dead_partials(save_dir)
        os.makedirs(tmp)
    if dp is not None:
        dp.barrier()  # the folder exists for every rank
    files: tuple[str, ...] = ()
    if lead:
        sched = engine.lr_scheduler
        torch.save(
            {
                "global_steps": engine.global_steps,
                "micro_steps": engine.micro_steps,
                "global_samples": engine.global_samples,
                "lr_scheduler": sched.state_dict() if sched is not None else None,
                "param_groups_lr": [g["lr"] for g in engine.optimizer.param_groups],
                "param_groups_hyper": [
                    {k: g[k] for k in _GROUP_KEYS if k in g} for g in engine.optimizer.param_groups
                ],
            },
            os.path.join(tmp, ENGINE_FILE),
        )
        torch.save(client_state, os.path.join(tmp, CLIENT_FILE))
        files = (ENGINE_FILE, CLIENT_FILE)
    own = engine.runtime.rank_dir(tmp)  # (tmp itself for one process)
    os.makedirs(own, exist_ok=True)
    torch.save(rng_states(), os.path.join(own, RNG_FILE))
    if dp is None:
        files += (RNG_FILE,)
    engine.runtime.save_state(tmp, meta={"tag": tag, "saved_at": time.time()}, files=files,
                              rank_files=(RNG_FILE,) if dp is not None else ())  # fmt: skip
    if lead:
        swap_into_place(tmp, final)
        if save_latest:
            write_atomic(os.path.join(save_dir, "latest"), tag.encode())
    if dp is not None:
        dp.barrier()  # in place, and `latest` names it, for every rank
    return final


def _resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        tag = f.read().strip()
    if not tag:  # else the load dir itself would be read as the checkpoint ("manifest.json is missing")
        raise CheckpointError(
            f"{latest!r} is empty: it names no checkpoint tag (a save interrupted outside offloadpp, or a file "
            "written by hand); pass tag=... to load_checkpoint, or write the tag into it"
        )
    return tag


def load_engine_checkpoint(engine, load_dir: str, tag: Optional[str], *, load_optimizer_states: bool,
                           load_lr_scheduler_states: bool) -> tuple[Optional[str], Any]:  # fmt: skip
    """Returns (path, client_state), or (None, None) when there is no checkpoint, as DeepSpeed."""
    tag = _resolve_tag(load_dir, tag)
    if tag is None:
        return None, None
    path = os.path.join(load_dir, tag)
    dp = engine.runtime.dp
    if dp is None or dp.rank == 0:
        recover_aside(path)
    if dp is not None:
        dp.barrier()
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    engine.runtime.load_state(path, optimizer_states=load_optimizer_states)
    engine._pending = None  # a half-done accumulation window is dropped with the runtime's
    meta = torch.load(os.path.join(path, ENGINE_FILE), weights_only=False)
    engine.global_steps = meta["global_steps"]
    engine.micro_steps = meta["micro_steps"]
    engine.global_samples = meta["global_samples"]
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    for g, lr in zip(engine.optimizer.param_groups, meta["param_groups_lr"]):
        g["lr"] = lr
    for g, hyper in zip(engine.optimizer.param_groups, meta.get("param_groups_hyper", ())):
        g.update(hyper)
    engine._push_lr()
    if load_optimizer_states:
        rng = os.path.join(engine.runtime.rank_dir(path), RNG_FILE)
        if not os.path.isfile(rng):  # saved at another world size: no state of this rank's
            rng = os.path.join(path, RNG_FILE)
        if os.path.isfile(rng):
            set_rng_states(torch.load(rng, weights_only=False))
        else:
            log.warning("offloadpp: checkpoint %s has no random number generator state for this rank", path)
    client_state = torch.load(os.path.join(path, CLIENT_FILE), weights_only=False)
    return path, client_state
