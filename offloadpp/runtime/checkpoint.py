"""The engine's state in a checkpoint folder, streamed unit by unit, and back.

    CKPT/manifest.json      written last: the model's layout, every file with its size and
                            CRC-32C, step counts, hyper-parameters, the loss scaler, and what
                            the caller adds (the DeepSpeed adapter: counters, scheduler, ...)
    CKPT/state/*.oswp       fp32 master weights and Adam moments, one key per unit and array,
                            in the TensorStore's format (headers, payload CRC)

Note: bounded memory, disk speed. One unit's array is read from its home (SSD or memory) into
a buffer of the engine's own pools, and written to the checkpoint's store while the next one is
read: the buffer returns to its pool when its write is done, so the pools' budgets bound the
memory, and both disks stream. Loading does the reverse, one unit at a time.

Note: durable and verified. Every file is fdatasync'ed and the folders fsync'ed before the
manifest is written (temporary name, fsync, rename); a checkpoint without a manifest is not one.
Loading checks the manifest's layout against the model (names, shapes, dtypes: a mismatch is
refused naming it) and every file's size before reading a byte, and each array's CRC-32C after.
Naming the folder (and `latest`) is the caller's: see integrations/deepspeed/checkpoint.py.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
from tqdm import tqdm

from offloadpp.io import IOConfig, TensorStore, crc32c
from offloadpp.io.durable import fsync_dir, fsync_file, write_atomic

from .slots import Hold
from .state import init_compute_copy, to_device
from .unit import Unit

FORMAT = 2
MANIFEST = "manifest.json"
STATE_DIR = "state"
ARRAYS = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this engine: names the file, key or parameter."""


def _slots(u: Unit):
    return u.master, u.exp_avg, u.exp_avg_sq


def model_layout(units: list[Unit]) -> list[dict]:
    """The model as the checkpoint records it: units, and each parameter's place and shape."""
    return [
        {
            "unit": u.name,
            "padded_numel": u.padded_numel,
            "params": [
                {
                    "name": s.name,
                    "shape": list(s.shape),
                    "dtype": str(s.dtype).removeprefix("torch."),
                    "offset": s.offset,
                    "numel": s.numel,
                }  # fmt: skip
                for _, s in u.params
            ],
        }
        for u in units
    ]


def check_layout(saved: list[dict], units: list[Unit]) -> None:
    """Refuses a checkpoint of another model, naming the first difference."""
    have = {d["unit"]: d for d in saved}
    for u, want in zip(units, model_layout(units)):
        got = have.get(u.name)
        if got is None:
            raise CheckpointError(f"the checkpoint has no unit {u.name!r}; it has {list(have)}")
        gp = {p["name"]: p for p in got["params"]}
        for p in want["params"]:
            q = gp.get(p["name"])
            if q is None:
                raise CheckpointError(f"parameter {p['name']!r} (unit {u.name!r}) is not in the checkpoint")
            for field in ("shape", "dtype"):
                if q[field] != p[field]:
                    raise CheckpointError(
                        f"parameter {p['name']!r}: the checkpoint has {field} {q[field]}, the model {p[field]}"
                    )
            if (q["offset"], q["numel"]) != (p["offset"], p["numel"]):
                raise CheckpointError(
                    f"parameter {p['name']!r} sits elsewhere in unit {u.name!r} in the checkpoint"
                )
        extra = set(gp) - {p["name"] for p in want["params"]}
        if extra:
            raise CheckpointError(
                f"the checkpoint's unit {u.name!r} has parameters the model lacks: {sorted(extra)}"
            )
    extra_units = set(have) - {u.name for u in units}
    if extra_units:
        raise CheckpointError(f"the checkpoint has units the model lacks: {sorted(extra_units)}")


def _file_record(path: str, base: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    crc = crc32c(buf.data_ptr(), len(data)) if buf is not None else 0
    return {"file": os.path.relpath(path, base), "nbytes": len(data), "crc32c": crc}


def save_state(units: list[Unit], path: str, *, io: IOConfig, meta: dict, files: tuple[str, ...] = (),
               progress: bool = False) -> dict:  # fmt: skip
    """Writes every unit's master and moments under `path` (an empty folder), then the manifest
    with `meta` and the small `files` the caller already wrote there. Call between steps, with
    the optimizer quiet. Returns the manifest."""
    state_dir = os.path.join(path, STATE_DIR)
    os.makedirs(state_dir)
    arrays: dict[str, dict] = {}
    cfg = io.model_copy(update={"checksum": True})  # a checkpoint is always checksummed
    with TensorStore([state_dir], config=cfg, create=False) as ck:
        for u in tqdm(units, desc="offloadpp: saving", disable=not progress, leave=False):
            for array, slot in zip(ARRAYS, _slots(u)):
                slot.acquire(Hold.EXPORT)
                buf = slot.wait()
                key = f"{u.name}.{array}"
                nbytes = buf.numel() * buf.element_size()
                arrays[key] = {"nbytes": nbytes, "crc32c": crc32c(buf.data_ptr(), nbytes)}
                fut = ck.put(key, buf)
                slot.release(Hold.EXPORT, after=(fut,))  # back to its pool once written
        ck.sync()
        parts = {os.path.relpath(p, path): n for p, n in ck.file_sizes().items()}
    records = []
    for name in files:
        fsync_file(os.path.join(path, name))
        records.append(_file_record(os.path.join(path, name), path))
    manifest = {
        "format": FORMAT,
        "layout": model_layout(units),
        "arrays": arrays,
        "state_files": parts,
        "files": records,
        "param_steps": {s.name: step for u in units for (_, s), step in zip(u.params, u.steps)},
        **meta,
    }
    fsync_dir(path)
    write_atomic(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at `path`, with every file it names checked (present,
    its size; the small files' CRC too). Raises CheckpointError naming what is wrong."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path!r} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{mpath!r} is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path!r} has format {manifest.get('format')!r}; this offloadpp reads {FORMAT}"
        )
    for rel, n in manifest["state_files"].items():
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            raise CheckpointError(f"checkpoint file {p!r} is missing")
        if os.path.getsize(p) != n:
            raise CheckpointError(
                f"checkpoint file {p!r} has {os.path.getsize(p)} bytes, the manifest says {n}"
            )
    for rec in manifest["files"]:
        p = os.path.join(path, rec["file"])
        if not os.path.isfile(p):
            raise CheckpointError(f"checkpoint file {p!r} is missing")
        got = _file_record(p, path)
        if (got["nbytes"], got["crc32c"]) != (rec["nbytes"], rec["crc32c"]):
            raise CheckpointError(f"checkpoint file {p!r} does not match its manifest (size or CRC-32C)")
    return manifest


def load_state(units: list[Unit], path: str, manifest: dict, *, io: IOConfig, optimizer_states: bool = True,
               progress: bool = False, after_unit: Optional[Callable[[Unit], None]] = None) -> None:  # fmt: skip
    """Reads the checkpoint at `path` (its manifest already read) into every unit's homes;
    optimizer_states=False takes the weights only. Between steps, the optimizer quiet."""
    check_layout(manifest["layout"], units)
    cfg = io.model_copy(update={"checksum": True})
    with TensorStore([os.path.join(path, STATE_DIR)], config=cfg, create=False) as ck:
        for u in tqdm(units, desc="offloadpp: loading", disable=not progress, leave=False):
            for array, slot in zip(ARRAYS, _slots(u)):
                if array != "master" and not optimizer_states:
                    continue
                key = f"{u.name}.{array}"
                rec = manifest["arrays"].get(key)
                if rec is None or key not in ck:
                    why = ck.why_missing(key) if rec is not None else None
                    if why is not None:  # a file of the key's name is there: say what is wrong with it
                        raise CheckpointError(f"checkpoint {path!r}: the {array} of unit {u.name!r}: {why}")
                    raise CheckpointError(f"checkpoint {path!r} has no {array} for unit {u.name!r}")
                slot.acquire(Hold.EXPORT, overwrite=True)
                buf = slot.wait()
                ck.get(key, out=buf).wait()  # the header's CRC checked by the store
                if crc32c(buf.data_ptr(), rec["nbytes"]) != rec["crc32c"]:
                    slot.release(Hold.EXPORT)
                    raise CheckpointError(f"checkpoint {path!r}: {key} does not match its manifest's CRC-32C")
                if slot.stored:
                    g = slot.write_generation()
                    slot.wrote(slot.store.put(slot.key_of(g), buf), g)
                if slot is u.master and u.compute is not u.master:
                    init_compute_copy(u)  # (and copied up where resident on the device)
                elif slot is u.master and u.device.is_cuda and u.weights.resident:
                    to_device(u)
                slot.release(Hold.EXPORT)
            if optimizer_states:
                u.steps = [int(manifest["param_steps"][s.name]) for _, s in u.params]
            if after_unit is not None:
                after_unit(u)
