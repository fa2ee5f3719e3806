"""The engine's state in a checkpoint folder, streamed unit by unit, and back.

    CKPT/manifest.json      written last: the model's layout, every file with its size and
                            CRC-32C, step counts, hyper-parameters, the loss scaler, and what
                            the caller adds (the DeepSpeed adapter: counters, scheduler, ...)
    CKPT/state/*.oswp       fp32 master weights and Adam moments, one key per unit and array,
                            in the TensorStore's format (headers, payload CRC); of the trainable
                            parameters only: frozen ones are recorded by reference (model_layout)

Note: bounded memory, disk speed. One unit's array is read from its home (SSD or memory) into
a buffer of the engine's own pools, and written to the checkpoint's store while the next one is
read: the buffer returns to its pool when its write is done, so the pools' budgets bound the
memory, and both disks stream. Loading does the reverse, one unit at a time.

Note: durable and verified. Every file is fdatasync'ed and the folders fsync'ed before the
manifest is written (temporary name, fsync, rename); a checkpoint without a manifest is not one.
Loading checks the manifest's layout against the model (names, shapes, dtypes: a mismatch is
refused naming it) and every file's size before reading a byte, and each array's CRC-32C after.
The manifest carries a CRC-32C of its own content (format 3), so a changed step count or
layout entry is refused too; format 2 manifests (without it) still load, with a warning.

Note: all or nothing. A load must leave the engine as it was when it fails, so it runs in two
passes: verify_state reads every array it will take, one at a time into a buffer of the slot's
own pool (bounded memory), and checks it, changing nothing; only then does load_state read them
again into the engine. The checkpoint is read twice (a load costs two reads of the state, once
per load: the price of never leaving a half-loaded engine after a checksum error). A failure in
the second pass (the disk failing between the two) leaves the engine marked failed, so it is
not trained on.
Naming the folder (and `latest`) is the caller's: see integrations/deepspeed/checkpoint.py.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Iterator, Optional

import torch
from tqdm import tqdm

from offloadpp.io import IOConfig, TensorStore, crc32c
from offloadpp.io.durable import fsync_dir, fsync_file, write_atomic
from offloadpp.optim import AdamHyper

from .slots import Hold
from .state import init_compute_copy, to_device
from .unit import Unit

FORMAT = 3  # 3: the manifest carries its own CRC-32C (2: without, still read)
MANIFEST = "manifest.json"
MANIFEST_CRC = "manifest_crc32c"
STATE_DIR = "state"
ARRAYS = ("master", "exp_avg", "exp_avg_sq")

log = logging.getLogger("offloadpp")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this engine: names the file, key or parameter."""


def _slots(u: Unit):
    return u.master, u.exp_avg, u.exp_avg_sq


def _param_record(s) -> dict:
    return {"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
            "offset": s.offset, "numel": s.numel}  # fmt: skip


def model_layout(units: list[Unit]) -> list[dict]:
    """The model as the checkpoint records it: units, and each parameter's place and shape; for
    a unit with frozen parameters, the reference to its frozen segment (docs/frozen.md): their
    names, shapes and dtypes and the segment's CRC-32C, which proves the base a checkpoint is
    loaded over is the one it was trained on (the segment itself is not in the checkpoint)."""
    out = []
    for u in units:
        d = {
            "unit": u.name,
            "padded_numel": u.padded_numel,
            "params": [_param_record(s) for _, s in u.params],
        }
        if u.frozen:
            d["frozen"] = {"params": [_param_record(s) for _, s in u.frozen], "crc32c": u.frozen_crc,
                           "dtype": str(u.frozen_slot.dtype).removeprefix("torch.")}  # fmt: skip
        out.append(d)
    return out


def _check_frozen(got: Optional[dict], want: Optional[dict], unit: str) -> None:
    """The checkpoint's reference to unit's frozen segment against the engine's (model_layout)."""
    if got == want:
        return
    if got is None or want is None:
        has, lacks = ("the checkpoint", "the model") if want is None else ("the model", "the checkpoint")
        raise CheckpointError(
            f"unit {unit!r}: {has} has frozen parameters, {lacks} none: the parameters frozen "
            "(requires_grad=False) must be the same when a checkpoint is loaded"
        )
    names = ([p["name"] for p in got["params"]], [p["name"] for p in want["params"]])
    if names[0] != names[1] or got["params"] != want["params"] or got["dtype"] != want["dtype"]:
        raise CheckpointError(
            f"unit {unit!r}: the frozen parameters differ (checkpoint {names[0]}, {got['dtype']}; model {names[1]}, "
            f"{want['dtype']}): the parameters frozen must be the same when a checkpoint is loaded"
        )
    raise CheckpointError(
        f"unit {unit!r}: the frozen parameters' values differ from the base the checkpoint was trained on "
        f"(CRC-32C {got['crc32c']:#010x} in the checkpoint, {want['crc32c']:#010x} here): load the same base "
        "model (checkpoints hold the trainable state only)"
    )


def _check_split(got: dict, want: dict, unit: str, worlds: tuple[int, int]) -> None:
    """A checkpoint saved on the other side of one process / several ranks from this run, for a
    model with frozen parameters (docs/frozen.md: one process keeps them in a frozen segment,
    recorded by reference only; several data-parallel ranks in the units' flat buffers, as
    state): refused, saying how to resume it. worlds: (the checkpoint's world size, this run's)."""
    saved, run = worlds
    if (saved > 1) == (run > 1):
        return
    saved_frozen = {p["name"] for p in (got.get("frozen") or {}).get("params", ())}
    run_frozen = {p["name"] for p in (want.get("frozen") or {}).get("params", ())}
    if saved_frozen & {p["name"] for p in want["params"]} or run_frozen & {p["name"] for p in got["params"]}:
        then, now = (
            (f"{saved} data-parallel ranks" if saved > 1 else "one process"),
            (f"{run} data-parallel ranks" if run > 1 else "one process"),
        )
        raise CheckpointError(
            f"unit {unit!r}: the checkpoint was saved by {then} and this run is {now}: one process keeps frozen "
            "parameters (requires_grad=False, e.g. a LoRA base) in a read-only segment recorded by reference only, "
            "several ranks keep them in the units' flat buffers as state (docs/frozen.md), so the two do not "
            f"load into each other. Resume it with {'several ranks' if saved > 1 else 'one process'}, or start "
            "this run from the base model and the trained weights (peft: save_pretrained, then "
            "PeftModel.from_pretrained)"
        )


def names_meta(units: list[Unit]) -> dict:
    """What the layout does not say and an export without the model needs
    (runtime/checkpoint_weights.py): "tied", each tied parameter's first name -> its other names
    (the layout records the first); "frozen_params", the names of the parameters that were not
    trained (requires_grad=False; over several ranks they are in the layout with the others)."""
    tied = {s.name: list(s.names[1:]) for u in units for _, s in u.params + u.frozen if len(s.names) > 1}
    frozen = [n for u in units for _, s in u.params + u.frozen if not s.requires_grad for n in s.names]
    return {"tied": tied, "frozen_params": frozen}


def check_layout(saved: list[dict], units: list[Unit], worlds: tuple[int, int] = (1, 1)) -> None:
    """Refuses a checkpoint of another model, naming the first difference. worlds: the
    checkpoint's world size and this run's (a model with frozen parameters: _check_split)."""
    have = {d["unit"]: d for d in saved}
    for u, want in zip(units, model_layout(units)):
        got = have.get(u.name)
        if got is None:
            raise CheckpointError(f"the checkpoint has no unit {u.name!r}; it has {list(have)}")
        _check_split(got, want, u.name, worlds)
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
        _check_frozen(got.get("frozen"), want.get("frozen"), u.name)
    extra_units = set(have) - {u.name for u in units}
    if extra_units:
        raise CheckpointError(f"the checkpoint has units the model lacks: {sorted(extra_units)}")


def _crc(data: bytes) -> int:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    return crc32c(buf.data_ptr(), len(data)) if buf is not None else 0


def _file_record(path: str, base: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    return {"file": os.path.relpath(path, base), "nbytes": len(data), "crc32c": _crc(data)}


def _manifest_crc(manifest: dict) -> int:
    """The CRC-32C of the manifest's content (every key but the CRC itself), over a canonical
    JSON text (sorted keys, no spaces): a changed value anywhere (a step count) changes it."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CRC}
    return _crc(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(path: str, manifest: dict) -> None:
    """manifest.json in the folder `path`, with its own CRC-32C, durably (temporary name, fsync,
    rename): the last file of a checkpoint."""
    sealed = {**manifest, MANIFEST_CRC: _manifest_crc(manifest)}
    write_atomic(os.path.join(path, MANIFEST), json.dumps(sealed, indent=1).encode())


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
            for array, slot in zip(ARRAYS, _slots(u)) if u.numel else ():  # (no trainable parameter: nothing)
                slot.acquire(Hold.EXPORT)
                buf = slot.wait()
                key = f"{u.name}.{array}"
                nbytes = buf.numel() * buf.element_size()
                arrays[key] = {"nbytes": nbytes, "crc32c": crc32c(buf.data_ptr(), nbytes)}
                fut = ck.put(key, buf)
                slot.release(Hold.EXPORT, after=(fut,))  # back to its pool once written
        ck.sync()
        parts = {os.path.relpath(p, path): n for p, n in ck.file_sizes().items()}
    steps = {s.name: step for u in units for (_, s), step in zip(u.params, u.steps)}
    return _seal(path, model_layout(units), arrays, parts, steps, meta, files)


def _seal(path: str, layout: list[dict], arrays: dict, parts: dict, param_steps: dict, meta: dict,
          files: tuple[str, ...]) -> dict:  # fmt: skip
    """The manifest of a checkpoint whose arrays are written and synced: the small files
    fsync'ed and recorded, the folder fsync'ed, the manifest written last."""
    records = []
    for name in files:
        fsync_file(os.path.join(path, name))
        records.append(_file_record(os.path.join(path, name), path))
    manifest = {
        "format": FORMAT,
        "layout": layout,
        "arrays": arrays,
        "state_files": parts,
        "files": records,
        "param_steps": param_steps,
        **meta,
    }
    fsync_dir(path)
    write_manifest(path, manifest)
    return manifest


def write_state(layout: list[dict], path: str, *, io: IOConfig, arrays_of: Callable[[dict], Iterator[tuple[str, torch.Tensor]]],
                param_steps: dict, meta: dict, files: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """save_state's folder from another source than a running engine's units (a run moved over
    from DeepSpeed: integrations/deepspeed/ds_import.py). `layout` is model_layout's records of
    the engine that will load it; arrays_of(unit_record) yields each of ARRAYS as a flat fp32
    tensor of the unit's padded_numel, one at a time: each is written (and waited for) before
    the next is asked for, so memory holds one unit's array. Returns the manifest."""
    if any(d.get("frozen") for d in layout):
        raise CheckpointError(
            "writing a checkpoint from another source for a model with frozen parameters (requires_grad=False) "
            "is not supported: their reference is the engine's own"
        )
    state_dir = os.path.join(path, STATE_DIR)
    os.makedirs(state_dir)
    arrays: dict[str, dict] = {}
    cfg = io.model_copy(update={"checksum": True})
    with TensorStore([state_dir], config=cfg, create=False) as ck:
        for d in layout:
            got = []
            for array, buf in arrays_of(d) if d["params"] else ():
                if buf.dtype != torch.float32 or buf.numel() != d["padded_numel"]:
                    raise CheckpointError(
                        f"unit {d['unit']!r}: its {array} must be {d['padded_numel']} fp32 values, got "
                        f"{buf.numel()} {buf.dtype}"
                    )
                buf = buf.contiguous()
                key = f"{d['unit']}.{array}"
                nbytes = buf.numel() * buf.element_size()
                arrays[key] = {"nbytes": nbytes, "crc32c": crc32c(buf.data_ptr(), nbytes)}
                ck.put(key, buf).wait()
                got.append(array)
            if d["params"] and sorted(got) != sorted(ARRAYS):
                raise CheckpointError(
                    f"unit {d['unit']!r}: got the arrays {got}, a checkpoint needs {list(ARRAYS)}"
                )
        ck.sync()
        parts = {os.path.relpath(p, path): n for p, n in ck.file_sizes().items()}
    return _seal(path, layout, arrays, parts, param_steps, meta, files)


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at `path`, with every file it names checked (present,
    its size; the small files' CRC too). Raises CheckpointError naming what is wrong."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path!r} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath!r} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{mpath!r} is not a checkpoint manifest (a JSON object)")
    fmt = manifest.get("format")
    if fmt == FORMAT:
        want = manifest.get(MANIFEST_CRC)
        if want != _manifest_crc(manifest):
            raise CheckpointError(
                f"{mpath!r} does not match its own CRC-32C ({MANIFEST_CRC} {want!r}): the manifest was changed or "
                "damaged after it was written; load an older tag"
            )
    elif fmt == 2:  # written before manifests had their own checksum: its files' are still checked
        log.warning(
            "offloadpp: %s has no checksum of its own (format 2, an older offloadpp's); its files are checked",
            mpath,
        )
    else:
        raise CheckpointError(f"checkpoint {path!r} has format {fmt!r}; this offloadpp reads 2 and {FORMAT}")
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


def reader(state_dir: str, io: IOConfig) -> TensorStore:
    """A checkpoint's store, opened to read only (no probe file, nothing written: a read-only
    mount or a full disk loads), every payload's checksum checked."""
    return TensorStore(
        [state_dir], config=io.model_copy(update={"checksum": True}), create=False, readonly=True
    )


def read_array(ck: TensorStore, key: str, out: torch.Tensor, rec: dict, where: str) -> None:
    """Reads `key` into `out`, checked against the manifest's record (size and CRC-32C)."""
    if rec["nbytes"] != out.numel() * out.element_size():
        raise CheckpointError(
            f"checkpoint {where!r}: {key} has {rec['nbytes']} bytes, this engine's array {out.numel() * out.element_size()}"
        )
    try:
        ck.get(key, out=out).wait()  # the header's CRC checked by the store
    except OSError as e:
        raise CheckpointError(f"checkpoint {where!r}: {key} cannot be read: {e}") from e
    if crc32c(out.data_ptr(), rec["nbytes"]) != rec["crc32c"]:
        raise CheckpointError(f"checkpoint {where!r}: {key} does not match its manifest's CRC-32C")


def _record(manifest: dict, ck: TensorStore, key: str, where: str) -> dict:
    rec = manifest["arrays"].get(key)
    if rec is None or key not in ck:
        unit, array = key.rsplit(".", 1)
        why = ck.why_missing(key) if rec is not None else None
        if why is not None:  # a file of the key's name is there: say what is wrong with it
            raise CheckpointError(f"checkpoint {where!r}: the {array} of unit {unit!r}: {why}")
        raise CheckpointError(f"checkpoint {where!r} has no {array} for unit {unit!r}")
    return rec


def _taken(u: Unit, optimizer_states: bool):
    if not u.numel:  # no trainable parameter: no state (its frozen segment is checked by reference)
        return []
    return [(a, s) for a, s in zip(ARRAYS, _slots(u)) if a == "master" or optimizer_states]


def check_steps(manifest: dict, units: list[Unit]) -> None:
    """Every parameter's step count is in the manifest, a whole number >= 0."""
    steps = manifest.get("param_steps")
    for u in units:
        for _, s in u.params:
            v = steps.get(s.name) if isinstance(steps, dict) else None
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CheckpointError(f"the checkpoint's step count of parameter {s.name!r} is {v!r}")


def runtime_state(path: str, manifest: dict) -> tuple[dict, list[AdamHyper]]:
    """The engine's own entry of the manifest (its global step, loss scaler) and its param
    groups' hyper-parameters, checked before a load changes anything."""
    rt = manifest.get("runtime")
    if not isinstance(rt, dict) or not isinstance(rt.get("global_step"), int):
        raise CheckpointError(f"checkpoint {path!r}: its manifest has no runtime state (global step)")
    try:
        return rt, [AdamHyper(**h) for h in (rt["hypers"] if "hypers" in rt else [rt["hyper"]])]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r}: its hyper-parameters cannot be read: {e}") from None


def verify_state(units: list[Unit], path: str, manifest: dict, *, io: IOConfig, optimizer_states: bool = True,
                 progress: bool = False) -> None:  # fmt: skip
    """Everything load_state will take from the checkpoint at `path` (its manifest already read),
    checked and nothing changed: the layout, the step counts, every array read into a buffer of
    its slot's pool and checked (size, CRC-32C), one at a time (Note: all or nothing)."""
    check_layout(manifest["layout"], units)
    check_steps(manifest, units)
    with reader(os.path.join(path, STATE_DIR), io) as ck:
        for u in tqdm(units, desc="offloadpp: verifying", disable=not progress, leave=False):
            for array, slot in _taken(u, optimizer_states):
                key = f"{u.name}.{array}"
                rec = _record(manifest, ck, key, path)
                part = slot.pool.get(slot.numel, slot.dtype)
                try:
                    read_array(ck, key, part, rec, path)
                finally:
                    slot.pool.put(part)


def load_state(units: list[Unit], path: str, manifest: dict, *, io: IOConfig, optimizer_states: bool = True,
               progress: bool = False, after_unit: Optional[Callable[[Unit], None]] = None) -> None:  # fmt: skip
    """Reads the checkpoint at `path` (its manifest already read, and verify_state passed: this
    changes the engine from its first array on) into every unit's homes; optimizer_states=False
    takes the weights only. Between steps, the optimizer quiet."""
    check_layout(manifest["layout"], units)
    with reader(os.path.join(path, STATE_DIR), io) as ck:
        for u in tqdm(units, desc="offloadpp: loading", disable=not progress, leave=False):
            for array, slot in _taken(u, optimizer_states):
                key = f"{u.name}.{array}"
                rec = _record(manifest, ck, key, path)
                slot.acquire(Hold.EXPORT, overwrite=True)
                try:
                    buf = slot.wait()
                    read_array(ck, key, buf, rec, path)
                    if slot.stored:
                        g = slot.write_generation()
                        slot.wrote(slot.store.put(slot.key_of(g), buf), g)
                    if slot is u.master and u.compute is not u.master:
                        init_compute_copy(u)  # (and copied up where resident on the device)
                    elif slot is u.master and u.device.copies and u.weights.resident:
                        to_device(u)
                finally:
                    slot.release(Hold.EXPORT)
            if optimizer_states:
                u.steps = [int(manifest["param_steps"][s.name]) for _, s in u.params]
            if after_unit is not None:
                after_unit(u)
