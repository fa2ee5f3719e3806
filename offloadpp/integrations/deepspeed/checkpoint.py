"""save_checkpoint / load_checkpoint for OffloadppEngine: DeepSpeed's layout, crash-consistent.

    save_dir/latest          the tag of the newest checkpoint (replaced atomically)
    save_dir/TAG/            the runtime's checkpoint (runtime/checkpoint.py: manifest, state)
        engine.pt            step counters, the LR scheduler, each group's lr
        rng.pt               the random number generators' states (torch, CUDA, random, numpy)
        client_state.pt      the caller's client_state

Over several ranks (runtime/dp/sharded_checkpoint.py) each rank writes its shards and its own
rng.pt into TAG/rankNNNNN/; engine.pt, client_state.pt and the global manifest are rank 0's, and
rank 0 alone renames the folder and writes `latest`, after every rank's part is durable.

With `"checkpoint": {"use_node_local_storage": true}` (DeepSpeed's key: each node writes to its
own disk) save_dir is each node's own folder at the same path: every node's first rank (local
rank 0) does there what rank 0 does above (its node's manifest, engine.pt, client_state.pt, the
rename, `latest`), and each rank writes its shards on its node's disk
(runtime/dp/sharded_checkpoint.py, Note: node-local checkpoints). Loading, the ranks agree on one
tag every one of them holds (a kill between two nodes' renames or `latest` writes leaves the
nodes naming different tags: the newest tag all hold is taken, with a warning), and that they
read one save of it; a rank that holds none is named with its node and missing shard folder.

Note: what a crash leaves. A checkpoint is written under `.TAG.partial`, every file fdatasync'ed,
the folder fsync'ed, the manifest last; only then does it take the name TAG (replacing an older
TAG atomically: the old one stays valid until the new one is in place), and only then does
`latest` name it. So at any instant `latest` names a complete, verified checkpoint, whatever
moment a kill -9 or power cut lands on (tests/test_crash.py). Folders of saves that died half
way are removed by the next save. Resuming restores everything the next step depends on, so a
resumed run continues bit for bit as one that never stopped (given the same batches).
"""

from __future__ import annotations

import difflib
import errno
import json
import logging
import os
import random
import shutil
import time
from typing import Any, Optional

import torch

from offloadpp.io.durable import recover_aside, swap_into_place, write_atomic
from offloadpp.runtime.accel.cuda import rng_states_all, set_rng_states_all
from offloadpp.runtime.checkpoint import MANIFEST, CheckpointError
from offloadpp.runtime.dp.sharded_checkpoint import NODE_LOCAL, agreed, rank_dir

log = logging.getLogger("offloadpp")

ENGINE_FILE = "engine.pt"
RNG_FILE = "rng.pt"
CLIENT_FILE = "client_state.pt"
CONFIG_FILE = "config.json"  # the model's Hugging Face config (runtime/checkpoint_weights.py reads it)
PARTIAL = ".partial"


def _check_tag(tag: str) -> None:
    if os.sep in tag or tag in ("", ".", "..") or tag.startswith(".") or tag == "latest":
        raise CheckpointError(
            f"checkpoint tag {tag!r} must be a plain folder name (not hidden, not 'latest')"
        )


def rng_states() -> dict:
    import numpy as np

    out = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    cuda = rng_states_all()
    if cuda is not None:
        out["cuda"] = cuda
    return out


def set_rng_states(states: dict) -> None:
    import numpy as np

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states:
        set_rng_states_all(states["cuda"])


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
        log.warning(
            "offloadpp: interrupted (KeyboardInterrupt) while saving checkpoint %r: %s; the next save removes "
            "what this one left", tag, _latest_still(save_dir),
        )  # fmt: skip
        raise
    except OSError as e:  # (one process; over ranks `agreed` has made it a CheckpointError already)
        raise CheckpointError(_save_failed(save_dir, tag, f"{e.strerror or e} ({e.filename!r})", e)) from e
    except CheckpointError as e:
        if not isinstance(e.__cause__, OSError):
            raise
        raise CheckpointError(_save_failed(save_dir, tag, str(e), e.__cause__)) from e.__cause__


def _latest_still(save_dir: str) -> str:
    """What `latest` names after a save that did not finish (it is only replaced at the end)."""
    try:
        latest = _resolve_tag(save_dir, None) if os.path.isdir(save_dir) else None
    except (CheckpointError, OSError):  # (an empty or unreadable `latest`)
        latest = None
    return f"`latest` still names {latest!r}, complete" if latest else "no checkpoint there was complete yet"


# What to do about the errors a save meets most (errno -> advice).
_SAVE_ADVICE = {
    errno.EROFS: "the filesystem is mounted read-only: pass save_checkpoint a folder on a writable one",
    errno.EACCES: "this process may not write there: pass a folder it may write, or change the folder's permissions",
    errno.EPERM: "this process may not write there: pass a folder it may write, or change the folder's permissions",
    errno.ENOSPC: "the disk is full: free space there (older checkpoint tags) or save to another disk",
    errno.EDQUOT: "the disk quota is used up: free space there (older checkpoint tags) or save to another disk",
}


def _save_failed(save_dir: str, tag: str, what: str, e: OSError) -> str:
    advice = _SAVE_ADVICE.get(e.errno, "fix the cause and save again")
    return (
        f"cannot save checkpoint {tag!r} in {save_dir!r}: {what}; {advice}. The checkpoints already there are "
        f"unchanged: {_latest_still(save_dir)}"
    )


def node_local(engine) -> bool:
    """Whether checkpoints go to each node's own disk (`checkpoint.use_node_local_storage`)."""
    return engine.runtime.dp is not None and bool(engine.use_node_local_storage())


def _lead(dp, local: bool) -> bool:
    """Whether this rank writes what is written once per checkpoint folder: rank 0 (one shared
    folder), or each node's first rank (a folder per node)."""
    return dp is None or (dp.local_rank if local else dp.rank) == 0


def _save(engine, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> str:
    _check_tag(tag)
    dp = engine.runtime.dp
    local = node_local(engine)
    lead = _lead(dp, local)
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
            files = (ENGINE_FILE, CLIENT_FILE) + _hf_config(engine.module, tmp)
        own = engine.runtime.rank_dir(tmp)  # (tmp itself for one process)
        os.makedirs(own, exist_ok=True)
        torch.save(rng_states(), os.path.join(own, RNG_FILE))
        return files + ((RNG_FILE,) if dp is None else ())

    files = _together(dp, "writing the checkpoint's small files", small_files)
    engine.runtime.save_state(tmp, meta={"tag": tag, "saved_at": time.time()}, files=files,
                              rank_files=(RNG_FILE,) if dp is not None else (), node_local=local)  # fmt: skip

    def commit() -> None:  # every rank has verified the folder (runtime/dp/sharded_checkpoint.py)
        if lead:
            swap_into_place(tmp, final)

    def name_latest() -> None:  # (node-local: only once every node's folder is in place)
        if lead and save_latest:
            write_atomic(os.path.join(save_dir, "latest"), tag.encode())

    _together(dp, "putting the checkpoint in place", commit)
    # then `latest` names it, for every rank
    _together(dp, "naming the checkpoint in `latest`", name_latest)
    return final


def _hf_config(module, folder: str) -> tuple[str, ...]:
    """The model's Hugging Face config.json in the checkpoint folder, where it has one, so that
    `offloadpp export` makes a folder from_pretrained loads without the model's code
    (runtime/checkpoint_weights.py); a peft model's is its base model's."""
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "to_json_string"):
        return ()
    d = json.loads(cfg.to_json_string())  # (the differences from the defaults, as save_pretrained writes)
    if not d.get("architectures") and getattr(module, "peft_config", None) is None:
        d["architectures"] = [type(module).__name__]  # (save_pretrained records the model's class)
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")
    return (CONFIG_FILE,)


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
    """Returns (path, client_state), or (None, None) when there is no checkpoint, as DeepSpeed.
    (A DeepSpeed checkpoint goes through ds_import.load_checkpoint first.)"""
    dp = engine.runtime.dp
    local = node_local(engine)
    if dp is None:
        tag = _resolve_tag(load_dir, tag)
    else:
        tag = _agree_on_tag(dp, load_dir, tag, local)
    if tag is None:
        _warn_nothing_to_load(load_dir)
        return None, None
    path = os.path.join(load_dir, tag)
    if dp is None:
        recover_aside(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    engine._finish_micro()  # (only now: a load that finds nothing leaves a half-done window as it is)
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


def _warn_nothing_to_load(load_dir: str) -> None:
    """DeepSpeed's warning when `latest` is missing (it returns (None, None) and changes nothing,
    and so does the caller), with what is there instead: a misspelt folder is named as one."""
    latest = os.path.join(load_dir, "latest")
    if os.path.isdir(load_dir):
        why = f"the folder holds no `latest` file ({latest!r})"
    else:
        parent = os.path.dirname(os.path.abspath(load_dir)) or "."
        near = difflib.get_close_matches(
            os.path.basename(os.path.normpath(load_dir)),
            [n for n in (os.listdir(parent) if os.path.isdir(parent) else ()) if os.path.isdir(os.path.join(parent, n))],
            n=1,
        )  # fmt: skip
        why = "the folder does not exist" + (
            f" (did you mean {os.path.join(parent, near[0])!r}?)" if near else ""
        )
    log.warning(
        "offloadpp: load_checkpoint(%r) found no checkpoint to load: %s; nothing was loaded or changed (the "
        "engine goes on from its current state, as DeepSpeed does). To resume, check the path, or pass "
        "tag=... naming a checkpoint folder in it", load_dir, why,
    )  # fmt: skip


def _holding(load_dir: str, tag: str, dp):
    """What this rank holds of checkpoint `tag`: its manifest's save id and step (None where
    the folder, its manifest or, at the saved world size, the rank's own folder is not on this
    rank's disk; at another one the load names each saved rank folder it lacks). A manifest
    that is there but cannot be read is damage, not absence: a str saying why (a save writes it
    whole and atomically, before the folder takes its name)."""
    path = os.path.join(load_dir, tag)
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        return None
    try:
        with open(mpath) as f:  # (verified in full by the load itself)
            m = json.load(f)
    except OSError as e:
        return f"{mpath!r} cannot be read: {e}"
    except (ValueError, UnicodeDecodeError) as e:
        return f"{mpath!r} is not valid JSON: {e}"
    if not isinstance(m, dict):
        return f"{mpath!r} is not a checkpoint manifest (a JSON object)"
    if m.get("world_size") == dp.world and not os.path.isdir(rank_dir(path, dp.rank)):
        return None
    return {"save_id": m.get(NODE_LOCAL, {}).get("save_id"), "step": m.get("runtime", {}).get("global_step", -1)}  # fmt: skip


def _agree_on_tag(dp, load_dir: str, tag: Optional[str], local: bool) -> Optional[str]:
    """The tag every rank loads (None: no rank has a checkpoint). Every rank resolves `latest`
    on its own disk; the ranks agree on the newest tag named that each of them holds, of one
    save, else each raises naming the ranks, nodes and shard folders missing."""
    named = dp.all_gather_object(
        agreed(dp, f"reading {os.path.join(load_dir, 'latest')!r}", lambda: _resolve_tag(load_dir, tag))
    )
    tags = sorted({t for t in named if t is not None})
    if not tags:
        return None
    lead = _lead(dp, local)  # (a kill between swap_into_place's two renames: the old folder back first)
    agreed(dp, "recovering checkpoint folders", lambda: [recover_aside(os.path.join(load_dir, t)) for t in tags if lead])  # fmt: skip
    held = dp.all_gather_object({t: _holding(load_dir, t, dp) for t in tags})
    damaged = {}  # (every rank raises the same message: each has every rank's view)
    for r, h in enumerate(held):
        for t in tags:
            if isinstance(h[t], str):
                damaged.setdefault(h[t], []).append(r)
    if damaged:
        raise CheckpointError(
            "; ".join(f"{why} (read by rank(s) {ranks})" for why, ranks in damaged.items())
            + ": the checkpoint is damaged (its manifest is written whole before the folder is named). Load "
            "another tag with load_checkpoint(..., tag=...), or restore the folder from a copy"
        )
    whole = [t for t in tags if all(h[t] is not None for h in held)]
    if not whole:
        t = named[0] if named[0] is not None else tags[-1]
        lacking = [r for r, h in enumerate(held) if h[t] is None]
        where = (" (a node-local checkpoint, checkpoint.use_node_local_storage: it resumes only on the nodes that "
                 "saved it, each with its own disk at save_dir)") if local else ""  # fmt: skip
        raise CheckpointError(
            f"checkpoint {os.path.join(load_dir, t)!r} is not whole on this job's disks: rank(s) {lacking} on "
            f"node(s) {sorted({r // dp.local_world for r in lacking})} lack it, and its shard folders "
            f"{', '.join(rank_dir(t, r) for r in lacking)} are missing there{where}"
        )
    best = max(whole, key=lambda t: held[0][t]["step"])
    if len({h[best]["save_id"] for h in held}) > 1:
        raise CheckpointError(
            f"checkpoint {os.path.join(load_dir, best)!r} is not one save on every node: its node-local folders come "
            f"from different saves of tag {best!r} (a save killed between the nodes' renames replaced it on some "
            "nodes only); load an older tag"
        )
    if len(tags) > 1:
        log.warning("offloadpp: the ranks' `latest` name %s; resuming from %r, the newest every rank holds "
                    "(a save interrupted between the nodes' commits)", tags, best)  # fmt: skip
    return best


def _load(path: str, name: str):
    """One of the checkpoint's small files (its CRC already checked by the manifest's reader)."""
    try:
        return torch.load(os.path.join(path, name), weights_only=False)
    except Exception as e:  # torch.load raises pickle's, zipfile's and its own errors
        raise CheckpointError(f"checkpoint file {os.path.join(path, name)!r} cannot be read: {e}") from e
