"""Checkpoints over data-parallel ranks: one shard per rank and a global manifest, and loading
at the same world size or another one.

    CKPT/manifest.json     written last, by rank 0, once every rank's folder is durable: the
                           model's layout, the world size and each unit's shard size, each rank
                           folder's manifest with its size and CRC-32C, the step counts, the
                           runtime's state, and the small files the caller wrote (as
                           runtime/checkpoint.py's manifest, which it is a superset of)
    CKPT/rank00000/        rank 0's shards: a runtime checkpoint of its own (runtime/checkpoint.py:
                           state/*.oswp and its manifest) and the rank's own small files (its RNG)
    CKPT/rank00001/        ...

Note: crash consistency. Every rank makes its folder durable (fsync, its manifest last), the
ranks meet, and only then does rank 0 write the global manifest (temporary name, fsync, rename):
without it the folder is not a checkpoint, and with it every rank's part is there and verified
by CRC. Naming the folder and `latest` stays the caller's, as for one process.

Note: the commit. The caller renames the folder (rank 0, after save_sharded returns), so every
rank must be done with the folder's old name first: save_sharded returns only after every rank
has read and verified the global manifest at `path` (three agreements, each an all-gather of
every rank's error or none). Returning earlier (a barrier, then the other ranks reading the
manifest) let rank 0 rename the folder under them: "manifest.json is missing" on rank 1 in most
two-rank launches. A failure on any rank (a full disk, a bad CRC) is raised on every rank,
naming the rank, instead of the others hanging in the next collective; rank 0 renames nothing.

Note: resharding. A checkpoint's shards are ranges of each unit's flat layout, which does not
depend on the world size (only the padding after the last parameter does). Loaded at another
world size (one process included, and a one-process checkpoint into several ranks), each rank
reads, unit by unit, the parts of the saved ranks' shards that overlap its own range, one saved
shard in memory at a time; every rank's folder must then be readable from every rank (one
node, or a shared filesystem), else the load is refused naming the folder.

Note: node-local checkpoints (save_sharded(node_local=True); DeepSpeed's
`checkpoint.use_node_local_storage`). `path` is each node's own disk, at the same path on every
node: every rank writes its folder there as above, and each node's first rank (local rank 0)
writes the node's manifest where rank 0 writes the global one. It records what a shared one
does for the node's own files (so it verifies on that node alone), and under "node_local"
which node ran which ranks, every rank folder's manifest record and one save id (the same on
every node: the ranks of a resumed job check that they read one save). Such a checkpoint
resumes on the same nodes with the same ranks each; elsewhere the shards it lacks are named.
"""

from __future__ import annotations

import os
import uuid
from typing import Callable, Optional

import torch

import offloadpp.runtime.checkpoint as ckpt
from offloadpp.io import IOConfig, TensorStore
from offloadpp.io.durable import fsync_dir, fsync_file

from ..checkpoint import MANIFEST, STATE_DIR, CheckpointError
from ..slots import Hold
from ..state import init_compute_copy, to_device
from ..unit import Unit
from .distributed import DataParallel

RANK_DIR = "rank{:05d}"
NODE_LOCAL = "node_local"  # the manifest's record of a node-local checkpoint's nodes


def rank_dir(path: str, rank: int) -> str:
    return os.path.join(path, RANK_DIR.format(rank))


def _range(u: Unit) -> tuple[int, int]:
    """This rank's range of the unit's flat layout (one process: all of it)."""
    return getattr(u, "lo", 0), getattr(u, "hi", u.padded_numel)


def agreed(dp: DataParallel, what: str, fn: Callable[[], object]):
    """Runs `fn` on every rank, then every rank learns whether all succeeded: if one failed,
    every rank raises CheckpointError naming it (rather than the others waiting forever in the
    next barrier for a rank that is gone). A collective; returns `fn`'s result."""
    result, err = None, ""
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - told to every rank, re-raised below
        err = f"{type(e).__name__}: {e}"
        failure = e
    errors = dp.all_gather_object(err)
    bad = [(r, m) for r, m in enumerate(errors) if m]
    if bad:
        r, m = bad[0]
        if err:
            raise CheckpointError(f"{what} failed on rank {dp.rank}: {err}") from failure
        raise CheckpointError(f"{what} failed on rank {r}: {m}")
    return result


def save_sharded(units: list[Unit], path: str, *, dp: DataParallel, io: IOConfig, meta: dict,
                 files: tuple[str, ...] = (), rank_files: tuple[str, ...] = (), node_local: bool = False) -> dict:  # fmt: skip
    """Every rank writes its shards into rank_dir(path, rank) (with `rank_files`, written there
    by the caller); then rank 0 the global manifest with `meta` and the small `files` it wrote
    into `path`; then every rank reads and verifies that manifest. A collective: when it returns
    on any rank, every rank has verified the checkpoint at `path` and holds its manifest, so
    rank 0 may rename the folder (module Note: the commit). Returns the global manifest.

    node_local: `path` is each node's own folder (module Note: node-local checkpoints): each
    node's first rank writes the node's manifest (and its `files`) where rank 0 writes the
    global one."""
    rd = rank_dir(path, dp.rank)

    def own() -> dict:
        os.makedirs(rd, exist_ok=True)
        shard = {"rank": dp.rank, "world_size": dp.world, "ranges": {u.name: list(_range(u)) for u in units}}
        ckpt.save_state(units, rd, io=io, meta={"shard": shard}, files=rank_files)
        return ckpt._file_record(os.path.join(rd, MANIFEST), path)

    mine = agreed(dp, "saving this rank's shards", own)  # every rank's folder is durable
    lead, extra, ranks = dp.rank == 0, {}, range(dp.world)
    if node_local:  # each node's manifest, naming every rank's node and shard
        gathered = dp.all_gather_object((dp.node, mine, uuid.uuid4().hex))
        lead, ranks = dp.local_rank == 0, [r for r in ranks if gathered[r][0] == dp.node]
        nodes: dict[int, list[int]] = {}
        for r, (n, _, _) in enumerate(gathered):
            nodes.setdefault(n, []).append(r)
        extra = {NODE_LOCAL: {"node": dp.node, "nodes": [nodes[n] for n in sorted(nodes)],
                              "rank_manifests": [rec for _, rec, _ in gathered], "save_id": gathered[0][2]}}  # fmt: skip

    def glob() -> None:
        if not lead:
            return
        records = []
        for name in files:
            fsync_file(os.path.join(path, name))
            records.append(ckpt._file_record(os.path.join(path, name), path))
        for r in ranks:  # each rank's manifest (on this node), whose own records cover its files
            records.append(ckpt._file_record(os.path.join(rank_dir(path, r), MANIFEST), path))
        manifest = {
            "format": ckpt.FORMAT,
            "world_size": dp.world,
            "shard_numel": {u.name: u.shard_numel for u in units},
            "layout": ckpt.model_layout(units),
            "arrays": {},
            "state_files": {},
            "files": records,
            "param_steps": {s.name: step for u in units for (_, s), step in zip(u.params, u.steps)},
            **meta,
            **extra,
        }
        fsync_dir(path)
        ckpt.write_manifest(path, manifest)

    agreed(dp, "writing the node's manifest" if node_local else "writing the global manifest", glob)
    # Every rank reads the global manifest here, at `path`, before any rank may rename it.
    return agreed(dp, "verifying the saved checkpoint", lambda: ckpt.read_manifest(path))


def missing_shards(node_local: dict, ranks: list[int], path: str) -> str:
    """The rank folders of a node-local checkpoint at `path`, each with the node that wrote it."""
    node_of = {r: n for n, rs in enumerate(node_local["nodes"]) for r in rs}
    return ", ".join(f"{rank_dir(path, r)} (node {node_of.get(r, '?')}'s)" for r in ranks)


class _Saved:
    """The saved ranks' shards of one checkpoint, opened as they are needed."""

    def __init__(self, path: str, manifest: dict, io: IOConfig):
        self.path = path
        self.world = int(manifest.get("world_size", 1))
        self.sharded = "world_size" in manifest  # else a one-process checkpoint: its own folder
        self.shard_numel = manifest.get("shard_numel") or {
            d["unit"]: d["padded_numel"] for d in manifest["layout"]
        }
        self.io = io
        self._stores: dict[int, tuple[TensorStore, dict]] = {}
        self._single = manifest
        self.node_local = manifest.get(NODE_LOCAL)

    def folder(self, k: int) -> str:
        return rank_dir(self.path, k) if self.sharded else self.path

    def store(self, k: int) -> tuple[TensorStore, dict]:
        if k not in self._stores:
            folder = self.folder(k)
            if not os.path.isdir(folder) and self.node_local:
                raise CheckpointError(
                    f"checkpoint {self.path!r} is node-local: {missing_shards(self.node_local, [k], self.path)} "
                    f"is on another node's disk, not this one's; it resumes on its {len(self.node_local['nodes'])} "
                    f"nodes of {len(self.node_local['nodes'][0])} ranks each, or at another world size once every "
                    "node's rank folders are copied into one folder every rank sees"
                )
            if not os.path.isdir(folder):
                raise CheckpointError(
                    f"checkpoint {self.path!r} was saved by {self.world} ranks; loading it at another world size "
                    f"reads every rank's folder, and {folder!r} is not here: put every rank folder under the "
                    f"checkpoint folder (a shared filesystem), or resume with {self.world} ranks"
                )
            m = ckpt.read_manifest(folder) if self.sharded else self._single
            self._stores[k] = (
                ckpt.reader(os.path.join(folder, STATE_DIR), self.io),
                m,
            )
        return self._stores[k]

    def close(self) -> None:
        for st, _ in self._stores.values():
            st.close()
        self._stores.clear()


def _overlaps(u: Unit, so: int):
    """The saved shards (of `so` elements each) holding part of this rank's range of `u`: (k, a,
    b), [a, b) in the unit's flat layout."""
    lo, hi = _range(u)
    end = min(hi, u.numel)  # (past the parameters: padding, zeros)
    for k in range(lo // so if so else 0, -(-end // so) if so else 0):
        a, b = max(lo, k * so), min(end, (k + 1) * so)
        if a < b:
            yield k, a, b


def _saved_parts(saved: _Saved, slot, u: Unit, so: int, key: str):
    """Each saved shard of `key` overlapping this rank's range of `u` (_overlaps), read and checked
    into a buffer of the slot's pool: (its [a, b) part, a, b); the buffer goes back to the pool as
    the caller moves on."""
    for k, a, b in _overlaps(u, so):
        st, m = saved.store(k)
        rec = ckpt._record(m, st, key, saved.folder(k))
        part = slot.pool.get(so, torch.float32)
        try:
            ckpt.read_array(st, key, part, rec, saved.folder(k))
            yield part[a - k * so : b - k * so], a, b
        finally:
            slot.pool.put(part)


def _own(units: list[Unit], path: str, rank: int) -> tuple[str, dict]:
    """This rank's folder and manifest where the world sizes agree, its ranges checked."""
    rd = rank_dir(path, rank)
    own = ckpt.read_manifest(rd)
    saved_range = own.get("shard", {}).get("ranges", {})
    for u in units:
        if saved_range.get(u.name) != list(_range(u)):
            raise CheckpointError(
                f"checkpoint {rd!r}: unit {u.name!r} was saved as another range of its layout"
            )
    return rd, own


def verify_sharded(units: list[Unit], path: str, manifest: dict, *, dp: Optional[DataParallel], io: IOConfig,
                   optimizer_states: bool = True, progress: bool = False) -> None:  # fmt: skip
    """Everything load_sharded will take on this rank, checked and nothing changed (checkpoint.py's
    Note: all or nothing): its own folder where the world sizes agree, else every saved shard
    part its range overlaps. Not a collective (load_sharded makes the ranks agree)."""
    world, rank = (dp.world, dp.rank) if dp is not None else (1, 0)
    ckpt.check_layout(manifest["layout"], units, (int(manifest.get("world_size", 1)), world))
    ckpt.check_steps(manifest, units)
    if int(manifest.get("world_size", 1)) == world and "world_size" in manifest:
        rd, own = _own(units, path, rank)
        ckpt.verify_state(units, rd, own, io=io, optimizer_states=optimizer_states, progress=progress)
        return
    saved = _Saved(path, manifest, io)
    try:
        for u in units:
            so = int(saved.shard_numel[u.name])
            for array, slot in ckpt._taken(u, optimizer_states):
                for _ in _saved_parts(saved, slot, u, so, f"{u.name}.{array}"):
                    pass  # (read_array checks each part)
    finally:
        saved.close()


def load_sharded(units: list[Unit], path: str, manifest: dict, *, dp: Optional[DataParallel], io: IOConfig,
                 optimizer_states: bool = True, progress: bool = False, verified: bool = False) -> None:  # fmt: skip
    """Reads a checkpoint (save_sharded's, or a one-process one) into this rank's units: its own
    folder where the world sizes agree, else its range from the saved shards (module Note).
    All or nothing, and over ranks: unless the caller did (verified=True), every rank verifies
    what it will read, the ranks agree that all passed (a failure on one is raised on all), and
    only then does any rank change its engine."""
    if not verified:
        verify = lambda: verify_sharded(units, path, manifest, dp=dp, io=io,  # noqa: E731
                                        optimizer_states=optimizer_states, progress=progress)  # fmt: skip
        agreed(dp, f"verifying checkpoint {path!r}", verify) if dp is not None else verify()
    world, rank = (dp.world, dp.rank) if dp is not None else (1, 0)
    if int(manifest.get("world_size", 1)) == world and "world_size" in manifest:
        rd, own = _own(units, path, rank)
        ckpt.load_state(units, rd, own, io=io, optimizer_states=optimizer_states, progress=progress)
    else:
        _reshard(units, path, manifest, io=io, optimizer_states=optimizer_states)
    if optimizer_states:
        for u in units:
            u.steps = [int(manifest["param_steps"][s.name]) for _, s in u.params]
    if dp is not None:
        _regather_resident(units, dp)


def _reshard(units: list[Unit], path: str, manifest: dict, *, io: IOConfig, optimizer_states: bool) -> None:
    saved = _Saved(path, manifest, io)
    try:
        for u in units:
            so = int(saved.shard_numel[u.name])
            lo, _ = _range(u)
            for array, slot in ckpt._taken(u, optimizer_states):
                slot.acquire(Hold.EXPORT, overwrite=True)
                try:
                    buf = slot.wait()
                    buf.zero_()
                    for part, a, b in _saved_parts(saved, slot, u, so, f"{u.name}.{array}"):
                        buf[a - lo : b - lo].copy_(part)
                    if slot.stored:
                        g = slot.write_generation()
                        slot.wrote(slot.store.put(slot.key_of(g), buf), g)
                    if slot is u.master and u.compute is not u.master:
                        init_compute_copy(u)
                    elif slot is u.master and u.device.copies and u.weights.resident:
                        to_device(u)
                finally:
                    slot.release(Hold.EXPORT)
    finally:
        saved.close()


def _regather_resident(units: list[Unit], dp: DataParallel) -> None:
    """Units resident on the device take every rank's loaded shard (in unit order, every rank)."""
    from .sharded import place_and_gather

    for u in units:
        if not u.weights.resident:
            continue
        u.compute.acquire(Hold.EXPORT)
        shard, full = u.compute.wait(), u.weights.tensor
        # with copies: the next bind's compute waits for the gather (gathered.bind), and the
        # shard's host buffer goes back after the copy up reads it (gathered.host_reuse); the
        # host waited for it here once, on a method events do not have (on every copies device)
        gathered = dp.fetch.run(lambda: place_and_gather(u, shard, full, dp, u.device, worker=False))  # noqa: B023
        u.weights.regathered(gathered)
        u.compute.release(Hold.EXPORT, after=(u.weights.last_copy,))


__all__ = [
    "NODE_LOCAL",
    "RANK_DIR",
    "agreed",
    "missing_shards",
    "load_sharded",
    "rank_dir",
    "save_sharded",
    "verify_sharded",
]
