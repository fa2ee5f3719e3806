"""OffloadEngine's save_state and load_state, over one process or several ranks (their
docstrings are the engine's methods'; the files' format and checks: runtime/checkpoint.py and
runtime/dp/sharded_checkpoint.py)."""

from __future__ import annotations

from typing import Callable, Optional

import offloadpp.runtime.checkpoint as ckpt

from .dp.sharded_checkpoint import agreed, load_sharded, save_sharded, verify_sharded


def save_state(engine, path: str, *, meta: Optional[dict] = None, files: tuple[str, ...] = (),
               rank_files: tuple[str, ...] = (), progress: bool = False, node_local: bool = False) -> dict:  # fmt: skip
    """OffloadEngine.save_state (its docstring)."""
    engine._check_open()
    engine._quiesce()
    engine.store.wait_all()
    engine.store.check_writes()
    runtime = {
        "global_step": engine.global_step,
        "hypers": [h.model_dump() for h in engine.hypers],  # one per param group
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
    }
    meta = {"runtime": runtime, **(meta or {})}
    if engine.dp is not None:
        return save_sharded(engine.units, path, dp=engine.dp, io=engine.store.config, meta=meta, files=files,
                            rank_files=rank_files, node_local=node_local)  # fmt: skip
    return ckpt.save_state(engine.units, path, io=engine.store.config, meta=meta, files=files,
                           progress=progress)  # fmt: skip


def load_state(engine, path: str, *, optimizer_states: bool = True, progress: bool = False,
               before_apply: Optional[Callable[[], None]] = None) -> dict:  # fmt: skip
    """OffloadEngine.load_state (its docstring)."""
    engine._check_open()
    manifest = ckpt.read_manifest(path)
    rt, hypers = ckpt.runtime_state(path, manifest)
    engine._quiesce()
    engine.store.wait_all()
    # The backend this engine already resolved: a probe would write into the checkpoint.
    io = engine.store.config.model_copy(update={"backend": engine.store.backends[0]})
    sharded = engine.dp is not None or "world_size" in manifest  # (over ranks: resharded if need be)

    def verify() -> None:
        if sharded:
            verify_sharded(engine.units, path, manifest, dp=engine.dp, io=io, optimizer_states=optimizer_states,
                           progress=progress)  # fmt: skip
        else:
            ckpt.verify_state(engine.units, path, manifest, io=io, optimizer_states=optimizer_states,
                              progress=progress)  # fmt: skip
        if before_apply is not None:
            before_apply()

    if engine.dp is not None:
        agreed(engine.dp, f"verifying checkpoint {path!r}", verify)
    else:
        verify()
    try:
        if sharded:
            load_sharded(engine.units, path, manifest, dp=engine.dp, io=io, optimizer_states=optimizer_states,
                         progress=progress, verified=True)  # fmt: skip
        else:
            ckpt.load_state(engine.units, path, manifest, io=io, optimizer_states=optimizer_states,
                            progress=progress)  # fmt: skip
        engine.store.wait_all()
        engine.store.check_writes()
    except BaseException as e:
        engine.transaction.fail(e)  # half loaded: not to be trained on
        raise
    if optimizer_states:
        engine.global_step = int(rt["global_step"])
        if engine.loss_scaler is not None and rt.get("loss_scaler"):
            engine.loss_scaler.load_state_dict(rt["loss_scaler"])
        if len(hypers) == len(engine.hypers) or all(g == 0 for u in engine.units for g in u.groups):
            engine.set_hypers(hypers)
    engine.micro_in_window = 0
    for u in engine.units:
        u.start_window()
    return manifest
