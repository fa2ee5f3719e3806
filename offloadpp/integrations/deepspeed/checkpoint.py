"""save_checkpoint / load_checkpoint for OffloadppEngine: DeepSpeed's layout, crash-consistent.

    save_dir/latest          the tag of the newest checkpoint (replaced atomically)
    save_dir/TAG/            the runtime's checkpoint (runtime/checkpoint.py: manifest, state)
        engine.pt            step counters, the LR scheduler, each group's lr
        rng.pt               the random number generators' states (torch, CUDA, random, numpy)
        client_state.pt      the caller's client_state

Over several ranks (runtime/dp/sharded_checkpoint.py) each rank writes its shards and its own
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
from offloadpp.runtime.dp.sharded_checkpoint import agreed

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
    try:
        return _save(engine, save_dir, tag, client_state, save_latest)
    except KeyboardInterrupt:
        try:
            latest = _resolve_tag(save_dir, None) if os.path.isdir(save_dir) else None
        except CheckpointError:  # (an empty `latest`)
            latest = None
        log.warning(
            "offloadpp: interrupted (KeyboardInterrupt) while saving checkpoint %r: %s; the next save removes "
            "what this one left", tag,
            f"`latest` still names {latest!r}, complete" if latest else "no checkpoint was complete yet",
        )  # fmt: skip
        raise


def _save(engine, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> str:
    _check_tag(tag)
    dp = engine.runtime.dp
    lead = dp is None or dp.rank == 0
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}{PARTIAL}")

    def prepare() -> None:
        if lead:
            os.makedirs(save_dir, exist_ok=True)
            recover_aside(final)
            _remove_dead_partials(save_dir)
            os.makedirs(tmp)

    _together(dp, "preparing the checkpoint folder", prepare)  # the folder exists for every rank

    def small_files() -> tuple[str, ...]:
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
        return files + ((RNG_FILE,) if dp is None else ())

    files = _together(dp, "writing the checkpoint's small files", small_files)
    engine.runtime.save_state(tmp, meta={"tag": tag, "saved_at": time.time()}, files=files,
                              rank_files=(RNG_FILE,) if dp is not None else ())  # fmt: skip

    def commit() -> None:  # every rank has verified the folder (runtime/dp/sharded_checkpoint.py)
        if lead:
            swap_into_place(tmp, final)
            if save_latest:
                write_atomic(os.path.join(save_dir, "latest"), tag.encode())

    _together(dp, "putting the checkpoint in place", commit)  # in place, `latest` names it, for every rank
    return final


def _together(dp, what: str, fn):
    """fn() on every rank, then a failure on any rank raised on all (sharded_checkpoint.agreed),
    so that no rank waits in a collective for one that failed; one process: fn()."""
    return fn() if dp is None else agreed(dp, what, fn)


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
    small: dict = {}

    def read_small() -> None:  # after the runtime verified its part, before anything changes
        small["meta"] = _load(path, ENGINE_FILE)
        small["client"] = _load(path, CLIENT_FILE)
        if load_optimizer_states:
            rng = os.path.join(engine.runtime.rank_dir(path), RNG_FILE)
            if not os.path.isfile(rng):  # saved at another world size: no state of this rank's
                rng = os.path.join(path, RNG_FILE)
            small["rng"] = _load(path, os.path.relpath(rng, path)) if os.path.isfile(rng) else None

    engine.runtime.load_state(path, optimizer_states=load_optimizer_states, before_apply=read_small)
    engine._pending = None  # a half-done accumulation window is dropped with the runtime's
    meta = small["meta"]
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
        if small["rng"] is not None:
            set_rng_states(small["rng"])
        else:
            log.warning("offloadpp: checkpoint %s has no random number generator state for this rank", path)
    return path, small["client"]


def _load(path: str, name: str):
    """One of the checkpoint's small files (its CRC already checked by the manifest's reader)."""
    try:
        return torch.load(os.path.join(path, name), weights_only=False)
    except Exception as e:  # torch.load raises pickle's, zipfile's and its own errors
        raise CheckpointError(f"checkpoint file {os.path.join(path, name)!r} cannot be read: {e}") from e
