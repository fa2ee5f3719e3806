"""Runs moved over from ZeRO-Infinity: a DeepSpeed ZeRO-3 checkpoint, or a universal one, as an
offloadpp checkpoint folder that load_checkpoint resumes.

    DeepSpeed TAG/ (ZeRO-3: *_model_states.pt, *_optim_states.pt, NVMe: offloaded_tensors/)
      -> DeepSpeed's own conversion, deepspeed.checkpoint.ds_to_universal, called as a library
    universal TAG/ (zero/NAME/fp32.pt, exp_avg.pt, exp_avg_sq.pt; zero/optimizer_state.pt; the
                    model_states file: scheduler, step counters, client state)
      -> write_offloadpp: unit by unit, in the layout of the engine that will load it
    offloadpp TAG/ (runtime/checkpoint.py: manifest.json, state/*.oswp, engine.pt, client_state.pt)

What carries over: the fp32 master weights, both Adam moments, each parameter's Adam step (its
ZeRO sub-group's), the param groups' lr, betas, eps and weight decay, the LR scheduler's state,
global_steps, global_samples and the client_state saved beside. What does not: DeepSpeed's random
number generator states (it saves none; the load warns), the fp16 loss scaler, buffers (the
model's own, from its code), frozen parameters (refused) and data-sampler or curriculum state.

Note: why the engine's layout. An offloadpp checkpoint stores each unit's flat arrays, and the
unit split is the engine's (its Plan), so the folder is written for one engine: load_checkpoint
writes it for itself, and `offloadpp import-deepspeed` builds the engine the training run will
build (the same DeepSpeed JSON and model, on the meta device) to write it once, ahead of the run.

Note: the NVMe optimizer's checkpoint. With `offload_optimizer` on NVMe, ZeRO-3 keeps the fp32
partitions and moments of each sub-group of 1 MiB or more in swap files, and its optimizer files
hold empty tensors in their place (smaller sub-groups stay in memory and in the file);
save_checkpoint copies the swap files into TAG/offloaded_tensors/rankNN/, and only DeepSpeed's
own engine, with the same swap folder layout, reads them back. ds_to_universal reads the optimizer
files alone, so _staged first writes a copy of them with each swapped sub-group's tensors read
from its swap files (named after the ds_ids of the sub-group's first and last parameters) and
converts that (tests/test_ds_import.py, against real ZeRO-Infinity checkpoints with both kinds).

Note: memory. The universal format is one file per parameter and state, so the offloadpp side
holds one unit's array and one parameter at a time. DeepSpeed's conversion is the exception: it
loads each rank's optimizer file whole (the rank's share of the master and moments, 12 bytes per
parameter over the ranks) and writes the universal folder (24 bytes per parameter: its
parameter files and an optimizer_state.pt that repeats rank 0's state) besides its fragments.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io as _io
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any, Iterator, Optional

import torch

from offloadpp.io.durable import write_atomic
from offloadpp.runtime.checkpoint import ARRAYS, CheckpointError, model_layout, write_state

from .checkpoint import (
    _GROUP_KEYS,
    CLIENT_FILE,
    ENGINE_FILE,
    _check_tag,
    _resolve_tag,
    load_engine_checkpoint,
)

log = logging.getLogger("offloadpp")

ZERO_DIR = "zero"  # the universal folder's per-parameter states
OPTIM_STATE = "optimizer_state.pt"
LATEST_UNIVERSAL = "latest_universal"  # ds_to_universal names its output there, beside `latest`
_UNIVERSAL_FILE = {"master": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}
# the keys of DeepSpeed's model_states file that are DeepSpeed's own (engine.py
# _common_checkpoint_state); the rest is the client_state save_checkpoint was given
_DS_KEYS = frozenset((
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "universal_checkpoint_info", "checkpoint_parallel_dimensions",
))  # fmt: skip


class DeepSpeedImportError(CheckpointError):
    """A folder that cannot be moved over from DeepSpeed: names the folder, file or parameter."""


def kind_of(path: str) -> Optional[str]:
    """What the folder `path` holds: "offloadpp" (a checkpoint of ours), "universal" (DeepSpeed's
    universal format), "deepspeed" (a DeepSpeed engine's checkpoint tag), or None."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return "offloadpp"
    if os.path.isfile(os.path.join(path, ZERO_DIR, OPTIM_STATE)):
        return "universal"
    if glob.glob(os.path.join(path, "*_optim_states.pt")) or glob.glob(
        os.path.join(path, "*model_states.pt")
    ):
        return "deepspeed"
    return None


def resolve(load_dir: str, tag: Optional[str], latest: str = "latest") -> str:
    """The checkpoint folder named by load_dir (a tag folder itself, or a save_dir whose `latest`
    file, or `tag`, names one), as DeepSpeed resolves it."""
    if tag is not None:
        return os.path.join(load_dir, str(tag))
    if kind_of(load_dir) is not None:
        return load_dir
    named = os.path.join(load_dir, latest)
    if not os.path.isfile(named):
        raise DeepSpeedImportError(
            f"{load_dir!r} is not a DeepSpeed checkpoint: it has no {latest!r} file naming a tag and no checkpoint "
            "files of its own; pass the tag folder or tag=..."
        )
    with open(named) as f:
        return os.path.join(load_dir, f.read().strip())


def _load(path: str):
    """A torch.save file, memory-mapped where it can be (its tensors are read only where used)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise DeepSpeedImportError(f"{path!r} cannot be read: {e}") from e
        return torch.load(path, map_location="cpu", weights_only=False)  # (an old, non-zip file)
    except Exception as e:  # torch.load raises pickle's, zipfile's and its own errors
        raise DeepSpeedImportError(f"{path!r} cannot be read: {e}") from e


def zero_stage(path: str) -> int:
    """The ZeRO stage of the DeepSpeed checkpoint folder `path`."""
    optim = sorted(glob.glob(os.path.join(path, "*_optim_states.pt")))
    if not optim:
        raise DeepSpeedImportError(
            f"{path!r} is not a DeepSpeed ZeRO checkpoint: it has no *_optim_states.pt files (a checkpoint saved "
            "without ZeRO, or with load_module_only, holds no optimizer state to carry over)"
        )
    sd = _load(optim[0]).get("optimizer_state_dict")
    if not isinstance(sd, dict):
        raise DeepSpeedImportError(
            f"{optim[0]!r} is not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict)"
        )
    return int(sd.get("zero_stage", 1))


def to_universal(ds_path: str, out_root: str) -> str:
    """DeepSpeed's conversion of the ZeRO-3 checkpoint folder `ds_path` into the universal format,
    under out_root (its name: out_root/<tag>); returns the universal folder."""
    stage = zero_stage(ds_path)
    if stage != 3:
        raise DeepSpeedImportError(
            f"{ds_path!r} is a ZeRO stage {stage} checkpoint; offloadpp moves over ZeRO stage 3 runs (ZeRO-Infinity). "
            "Convert it with DeepSpeed's ds_to_universal.py and load the universal folder with "
            '"checkpoint": {"load_universal": true}'
        )
    from deepspeed.checkpoint import ds_to_universal

    out = os.path.join(out_root, os.path.basename(os.path.normpath(ds_path)))
    staged = _staged(ds_path, out_root)
    args = argparse.Namespace(input_folder=staged, output_folder=out, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=False)  # fmt: skip
    said = _io.StringIO()  # its progress prints, kept for the log
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(said):
        ds_to_universal.main(args)
    if staged != ds_path:
        shutil.rmtree(os.path.dirname(staged), ignore_errors=True)
    log.info(
        "offloadpp: DeepSpeed's ds_to_universal converted %s in %.1fs", ds_path, time.perf_counter() - t0
    )
    log.debug("%s", said.getvalue())
    return out


OFFLOADED = "offloaded_tensors"  # ZeRO-Infinity's optimizer swap files, copied by its save_checkpoint
_SWAP_FILE = re.compile(r"^(?:(exp_avg|exp_avg_sq)-)?(\d+)_(\d+)\.tensor\.swp$")


def _staged(ds_path: str, work: str) -> str:
    """ds_path itself where its optimizer files hold the optimizer state; for ZeRO-Infinity with
    the optimizer on NVMe, a copy under `work` whose optimizer files are filled from the swap
    files DeepSpeed saved beside them (Note: the NVMe optimizer's checkpoint)."""
    off = os.path.join(ds_path, OFFLOADED)
    if not os.path.isdir(off):
        return ds_path
    stage = os.path.join(work, "staged", os.path.basename(os.path.normpath(ds_path)))
    os.makedirs(stage)
    models = sorted(glob.glob(os.path.join(ds_path, "*model_states.pt")))
    for f in models:
        os.symlink(os.path.abspath(f), os.path.join(stage, os.path.basename(f)))
    for f in sorted(glob.glob(os.path.join(ds_path, "*_optim_states.pt"))):
        m = re.search(r"zero_pp_rank_(\d+)_mp_rank_", os.path.basename(f))
        if m is None:
            raise DeepSpeedImportError(f"{f!r}: cannot tell its rank from its name")
        rank = int(m.group(1))
        model = _load(next((g for g in models if f"zero_pp_rank_{rank}_" in os.path.basename(g)), models[0]))
        sd = torch.load(
            f, map_location="cpu", weights_only=False
        )  # (a swapped sub-group's tensors are empty)
        _fill_from_swap(sd["optimizer_state_dict"], model, os.path.join(off, f"rank{rank:02d}"), f)
        torch.save(sd, os.path.join(stage, os.path.basename(f)))
    return stage


def _fill_from_swap(osd: dict, model: dict, folder: str, where: str) -> None:
    """Each ZeRO-3 sub-group's fp32 partition and Adam moments that DeepSpeed kept on NVMe, read
    from its swap files in `folder` (Note: the NVMe optimizer's checkpoint). Only sub-groups of at
    least DeepSpeed's least aio size (1 MiB, or the aio block size) go to NVMe; the others keep
    their tensors in the optimizer file, where they stay. DeepSpeed names a swap file after the
    ds_ids of its sub-group's first and last parameter (`A_B.tensor.swp`, `exp_avg-A_B.tensor.swp`,
    ...), and ds_ids count the parameters an engine converts, in the module's order, from wherever
    the process's count stood: each file follows from its sub-group's places in the module plus
    one offset, found as the one that names a file for every swapped sub-group."""
    groups = model.get("param_shapes") or []
    state = osd["optimizer_state_dict"]["state"]
    if len(groups) != len(osd["fp32_flat_groups"]):
        raise DeepSpeedImportError(
            f"{where!r}: {len(osd['fp32_flat_groups'])} ZeRO sub-group(s), its model file {len(groups)}"
        )
    swapped = [
        i for i in range(len(groups))
        if osd["fp32_flat_groups"][i].numel() == 0
        or any(state.get(i, {}).get(k) is None or state[i][k].numel() == 0 for k in ("exp_avg", "exp_avg_sq"))
    ]  # fmt: skip
    if not swapped:
        return
    if not os.path.isdir(folder):
        raise DeepSpeedImportError(f"{where!r}: its optimizer state was on NVMe and {folder!r} is missing")
    files = {}
    for name in os.listdir(folder):
        m = _SWAP_FILE.match(name)
        if m:
            files[(m.group(1) or "fp32", int(m.group(2)), int(m.group(3)))] = os.path.join(folder, name)
    # ds_ids follow module.parameters(): the state dict's order, buffers and tied second names aside
    named = {n for g in groups for n in g}
    order = {n: i for i, n in enumerate(k for k in (model.get("module") or {}) if k in named)}
    if any(n not in order for i in swapped for n in groups[i]):
        raise DeepSpeedImportError(
            f"{where!r}: the parameters of its model file's param_shapes are not all in its module state"
        )
    spans = {i: (order[next(iter(groups[i]))], order[list(groups[i])[-1]]) for i in swapped}
    offsets = None
    for first, last in spans.values():
        fits = {a - first for (key, a, b) in files if key == "fp32" and b - a == last - first}
        offsets = fits if offsets is None else offsets & fits
    if len(offsets) != 1:
        raise DeepSpeedImportError(
            f"{where!r}: {len(swapped)} sub-group(s) were on NVMe and the swap files in {folder!r} "
            f"({sorted(os.listdir(folder))[:6]}...) cannot be matched to them"
        )
    base = offsets.pop()
    pc = osd.get("partition_count", 1)  # (the data-parallel ranks the state is split over)
    partitions = max(int(pc[0] if isinstance(pc, (list, tuple)) else pc), 1)
    misread = misread_gradients(groups, swapped, partitions, model.get("ds_config"))
    if misread:
        log.warning(
            "offloadpp: %s: the ZeRO-Infinity run that saved it trained %s on gradients DeepSpeed did not read "
            "back from NVMe (each starts at a byte offset in its sub-group that is not a multiple of 512; "
            "DeepSpeed 0.19.8 reads a swapped gradient "
            "into the sub-group's buffer at that offset, and an O_DIRECT read into an address that is not "
            "512-byte aligned reads nothing and reports success). Their state carries over as saved; offloadpp "
            "trains them on their gradients from here, so the run will not retrace that run's own continuation "
            "(docs/checkpoints.md, 'Moving a run over from ZeRO-Infinity')",
            where, misread[:8] + ([f"and {len(misread) - 8} more"] if len(misread) > 8 else []),
        )  # fmt: skip
    for i in swapped:
        a, b = spans[i][0] + base, spans[i][1] + base
        numel = sum(_partition_numel(s, partitions) for s in groups[i].values())
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = files.get((key, a, b))
            if path is None or os.path.getsize(path) < numel * 4:
                raise DeepSpeedImportError(
                    f"{where!r}: sub-group {i}'s {key} ({numel} values) is not among the NVMe optimizer files in {folder!r}"
                )
            t = torch.from_file(path, shared=False, size=numel, dtype=torch.float32)
            if key == "fp32":
                osd["fp32_flat_groups"][i] = t
            else:
                state.setdefault(i, {})[key] = t


_O_DIRECT_ALIGN = 512  # the least alignment an O_DIRECT read's buffer needs (a 512-byte sector)


def misread_gradients(
    groups: list, swapped: list[int], partitions: int, ds_config: Optional[dict]
) -> list[str]:
    """The parameters whose gradients DeepSpeed 0.19.8's NVMe optimizer reads back into an address
    that is not 512-byte aligned, and so not at all (both its optimizer swappers: a swappable
    gradient, the part of it in whole 1 KiB runs that is at least the least aio size, is read into
    the sub-group's pinned, aligned buffer at the parameter's offset in the sub-group; DeepSpeed's
    aio reads nothing into a misaligned address and reports success: tests/test_ds_import.py). The
    run that saved the checkpoint trained them on what that buffer held. `groups`: the model file's
    param_shapes (one ordered dict per sub-group), `swapped`: the sub-groups on NVMe."""
    aio = (ds_config or {}).get("aio") or {}
    least = max(1 << 20, int(aio.get("block_size", 1 << 20)))  # (MIN_AIO_BYTES, the aio block size)
    run = 1024 * int(aio.get("intra_op_parallelism", 1)) // 4  # (AIO_ALIGNED_BYTES, in fp32 values)
    out = []
    for i in swapped:
        offset = 0
        for name, shape in groups[i].items():
            numel = _partition_numel(shape, partitions)
            if numel // run * run * 4 >= least and offset * 4 % _O_DIRECT_ALIGN:
                out.append(name)
            offset += numel
    return out


def _partition_numel(shape, partitions: int) -> int:
    """A parameter's values in one rank's partition (DeepSpeed pads each to a whole share)."""
    return -(-_numel(shape) // partitions)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Universal:
    """A universal checkpoint folder, read lazily: its parameters' shapes and step counts and the
    engine's counters and scheduler from its small files; the arrays one file at a time."""

    def __init__(self, path: str):
        self.path = path
        zero = os.path.join(path, ZERO_DIR)
        if not os.path.isfile(os.path.join(zero, OPTIM_STATE)):
            raise DeepSpeedImportError(
                f"{path!r} is not a universal checkpoint: {ZERO_DIR}/{OPTIM_STATE} is missing"
            )
        models = sorted(glob.glob(os.path.join(path, "*model_states.pt")))
        if not models:
            raise DeepSpeedImportError(
                f"{path!r} is not a universal checkpoint: it has no *model_states.pt file"
            )
        self.model_state = {k: v for k, v in _load(models[0]).items() if k != "module"}
        optim = _load(os.path.join(zero, OPTIM_STATE))
        inner = optim.get("optimizer_state_dict", optim)
        self.param_groups = optim.get("param_groups") or inner.get("param_groups") or []
        shapes = self.model_state.get("param_shapes") or []
        if isinstance(shapes, dict):
            shapes = [shapes]
        self.shapes: dict[str, list[int]] = {n: list(s) for group in shapes for n, s in group.items()}
        # Each ZeRO-3 sub-group (a flat partition) keeps its own Adam step; its parameters take it.
        state = inner.get("state", {})
        self.steps: dict[str, int] = {}
        for i, group in enumerate(shapes):
            step = state.get(i, {}).get("step")
            for n in group:
                self.steps[n] = int(step) if step is not None else 0
        names = {d for d in os.listdir(zero) if os.path.isdir(os.path.join(zero, d))}
        if not self.shapes:  # (a universal folder of ZeRO 1/2: shapes from the files themselves)
            self.shapes = {n: None for n in names}
        for n in names:
            step_file = os.path.join(zero, n, "step.pt")
            if os.path.isfile(step_file):  # ZeRO 1/2's universal folders keep one per parameter
                self.steps[n] = int(_load(step_file))
        self.on_disk = names

    def array(self, name: str, array: str) -> torch.Tensor:
        path = os.path.join(self.path, ZERO_DIR, name, _UNIVERSAL_FILE[array])
        if not os.path.isfile(path):
            raise DeepSpeedImportError(f"universal checkpoint {self.path!r}: {path!r} is missing")
        t = _load(path)
        if isinstance(t, dict):  # ZeRO 1/2's universal files: {"param": tensor, "cat_dim": ...}
            t = t.get("param")
        if not isinstance(t, torch.Tensor):
            raise DeepSpeedImportError(f"universal checkpoint {self.path!r}: {path!r} holds no tensor")
        return t


def check(layout: list[dict], uni: Universal) -> None:
    """The universal checkpoint's parameters against the engine's, names and shapes; the first
    difference named."""
    want = {p["name"]: p for d in layout for p in d["params"]}
    missing = sorted(set(want) - set(uni.shapes))
    if missing:
        raise DeepSpeedImportError(
            f"the DeepSpeed checkpoint {uni.path!r} lacks parameter(s) of the model: {missing[:8]}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    extra = sorted(set(uni.shapes) - set(want))
    if extra:
        raise DeepSpeedImportError(
            f"the DeepSpeed checkpoint {uni.path!r} has parameter(s) the model lacks: {extra[:8]}"
            + (f" and {len(extra) - 8} more" if len(extra) > 8 else "")
        )
    for name, p in want.items():
        got = uni.shapes[name]
        if got is not None and list(got) != list(p["shape"]):
            raise DeepSpeedImportError(
                f"parameter {name!r}: the DeepSpeed checkpoint has shape {list(got)}, the model {p['shape']}"
            )
        if name not in uni.on_disk:
            raise DeepSpeedImportError(
                f"universal checkpoint {uni.path!r} has no state for parameter {name!r}"
            )


def _arrays(uni: Universal, d: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """One unit's master and moments, gathered parameter by parameter into its flat layout."""
    for array in ARRAYS:
        flat = torch.zeros(d["padded_numel"], dtype=torch.float32)
        for p in d["params"]:
            t = uni.array(p["name"], array)
            if t.numel() != p["numel"]:
                raise DeepSpeedImportError(
                    f"parameter {p['name']!r}: the DeepSpeed checkpoint's {_UNIVERSAL_FILE[array]} has {t.numel()} "
                    f"values, the model {p['numel']} ({p['shape']})"
                )
            flat[p["offset"] : p["offset"] + p["numel"]].copy_(t.reshape(-1))
            del t
        yield array, flat


def write_offloadpp(engine, uni: Universal, out: str, tag: str) -> str:
    """The offloadpp checkpoint of `uni` for `engine` in the new folder out/tag (and out/latest):
    master and moments, step counts, hyper-parameters, scheduler, counters, client_state."""
    _check_tag(tag)
    rt = engine.runtime
    if rt.dp is not None:
        raise DeepSpeedImportError(
            "moving a DeepSpeed checkpoint over runs in one process: convert it with `offloadpp import-deepspeed`, "
            "then load the offloadpp checkpoint at any world size"
        )
    layout = model_layout(rt.units)
    if any(d.get("frozen") for d in layout):
        raise DeepSpeedImportError(
            "moving a DeepSpeed checkpoint over is not supported for a model with frozen parameters "
            "(requires_grad=False); its trainable state would load over a base the checkpoint does not hold"
        )
    check(layout, uni)
    groups = _groups(engine, uni)
    path = os.path.join(out, tag)
    os.makedirs(path)  # (no manifest until the end: a folder left by a failure is not a checkpoint)
    ms = uni.model_state
    gas = engine.gradient_accumulation_steps()
    torch.save(
        {
            "global_steps": int(ms.get("global_steps", 0)),
            "micro_steps": int(ms.get("global_steps", 0)) * gas,
            "global_samples": int(ms.get("global_samples", 0)),
            "lr_scheduler": ms.get("lr_scheduler"),
            "param_groups_lr": [g["lr"] for g in groups],
            "param_groups_hyper": [
                {k: tuple(g[k]) if k == "betas" else g[k] for k in _GROUP_KEYS if k in g} for g in groups
            ],
        },
        os.path.join(path, ENGINE_FILE),
    )
    torch.save({k: v for k, v in ms.items() if k not in _DS_KEYS}, os.path.join(path, CLIENT_FILE))
    hypers = [
        h.model_copy(
            update={
                "lr": g["lr"],
                "beta1": g["betas"][0],
                "beta2": g["betas"][1],
                "eps": g["eps"],
                "weight_decay": g["weight_decay"],
            }
        )  # fmt: skip
        for h, g in zip(rt.hypers if len(rt.hypers) == len(groups) else [rt.hypers[0]] * len(groups), groups)
    ]
    runtime = {"global_step": int(ms.get("global_steps", 0)), "hypers": [h.model_dump() for h in hypers],
               "loss_scaler": None}  # fmt: skip
    steps = {p["name"]: uni.steps.get(p["name"], 0) for d in layout for p in d["params"]}
    write_state(layout, path, io=rt.store.config, arrays_of=lambda d: _arrays(uni, d), param_steps=steps,
                meta={"runtime": runtime, "tag": tag, "saved_at": time.time(), "imported_from": uni.path},
                files=(ENGINE_FILE, CLIENT_FILE))  # fmt: skip
    write_atomic(os.path.join(out, "latest"), tag.encode())
    return path


def _groups(engine, uni: Universal) -> list[dict]:
    """DeepSpeed's param groups (lr, betas, eps, weight_decay), one per group of the engine's."""
    groups = [g for g in uni.param_groups if isinstance(g, dict)]
    have = len(engine.optimizer.param_groups)
    if len(groups) != have:
        raise DeepSpeedImportError(
            f"the DeepSpeed checkpoint {uni.path!r} has {len(groups)} optimizer param group(s), this engine {have}: "
            "build the optimizer with the same groups"
        )
    for i, g in enumerate(groups):
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key not in g:
                raise DeepSpeedImportError(
                    f"the DeepSpeed checkpoint {uni.path!r}: param group {i} has no {key!r}"
                )
    return groups


def import_checkpoint(
    engine, load_dir: str, tag: Optional[str], out: str, work: str, *, universal: bool
) -> str:
    """The DeepSpeed checkpoint load_dir/tag (a ZeRO-3 one, or a universal one: with `universal`
    it is named by `latest_universal` as DeepSpeed names it) written as the offloadpp checkpoint
    out/<its tag> for `engine`, `out/latest` naming it; `work` takes DeepSpeed's universal
    conversion meanwhile. Returns the tag."""
    src = resolve(load_dir, tag, LATEST_UNIVERSAL if universal else "latest")
    if not os.path.isdir(src):
        raise DeepSpeedImportError(f"checkpoint {src!r} does not exist")
    kind = kind_of(src)
    if kind == "deepspeed":
        uni_path = to_universal(src, os.path.join(work, "universal"))
    elif kind == "universal":
        uni_path = src
    else:
        raise DeepSpeedImportError(
            f"{src!r} is not a DeepSpeed checkpoint: no *_optim_states.pt / *_model_states.pt files, and no "
            f"{ZERO_DIR}/{OPTIM_STATE} of a universal one"
            + (
                " (an offloadpp checkpoint: load it without checkpoint.load_universal)"
                if kind == "offloadpp"
                else ""
            )
        )
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(os.path.normpath(src))).lstrip(".") or "imported"
    if os.path.exists(os.path.join(out, name)):
        raise DeepSpeedImportError(f"{os.path.join(out, name)!r} exists already: give another output folder")
    try:
        write_offloadpp(engine, Universal(uni_path), out, name)
    finally:
        if kind == "deepspeed":
            shutil.rmtree(os.path.join(work, "universal"), ignore_errors=True)  # (read; no longer needed)
    return name


def load_checkpoint(engine, load_dir: str, tag: Optional[str], **kw) -> tuple[Optional[str], Any]:
    """engine.load_checkpoint: an offloadpp checkpoint as checkpoint.load_engine_checkpoint loads
    it; a DeepSpeed ZeRO-3 one (or, with `checkpoint.load_universal`, a universal one) first
    written as an offloadpp checkpoint in a folder of the swap directory, loaded from there, and
    that folder removed. Returns (path, client_state) as DeepSpeed."""
    universal = bool(engine.load_universal_checkpoint()) and _universal_folder(load_dir, tag)
    if not universal and not _deepspeed_folder(load_dir, tag):
        return load_engine_checkpoint(engine, load_dir, tag, **kw)
    engine._finish_micro()  # (a half-done window is completed before the load replaces it)
    work = tempfile.mkdtemp(prefix="import-", dir=engine.runtime.store.dirs[0])
    try:
        out = os.path.join(work, "offloadpp")
        name = import_checkpoint(engine, load_dir, tag, out, work, universal=universal)
        _, client = load_engine_checkpoint(engine, out, name, **kw)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return (load_dir if tag is None else os.path.join(load_dir, str(tag))), client


def _universal_folder(load_dir: str, tag: Optional[str]) -> bool:
    """With `checkpoint.load_universal`: whether load_dir/tag (or the tag `latest_universal`
    names, or load_dir itself) is a universal checkpoint; the run's own offloadpp checkpoints,
    saved after the move, still load as ever with the switch left on."""
    if tag is not None:
        return kind_of(os.path.join(load_dir, str(tag))) == "universal"
    if kind_of(load_dir) is not None:
        return kind_of(load_dir) == "universal"
    return os.path.isfile(os.path.join(load_dir, LATEST_UNIVERSAL))


def _deepspeed_folder(load_dir: str, tag: Optional[str]) -> bool:
    """Whether load_dir/tag (or the tag load_dir's `latest` names, or load_dir itself) is a
    DeepSpeed checkpoint (an engine's or a universal one) rather than one of ours."""
    try:
        t = _resolve_tag(load_dir, tag)
    except CheckpointError:
        t = None
    ours = ("deepspeed", "universal")  # (a universal folder named outright loads without the switch too)
    if t is not None:
        return kind_of(os.path.join(load_dir, t)) in ours
    return kind_of(load_dir) in ours
