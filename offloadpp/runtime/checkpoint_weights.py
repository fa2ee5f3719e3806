"""The weights in a checkpoint folder, after the job: no model code, no engine, no training script.

A checkpoint's manifest (runtime/checkpoint.py) records every unit of the model, and in each the
name, shape, dtype and place in the unit's flat fp32 master of every parameter: that, the masters
in its state files and the config.json that save_checkpoint keeps beside them are all a Hugging
Face folder needs. Two ways out, as DeepSpeed's zero_to_fp32 has:

- export_checkpoint (the `offloadpp export` command): a folder from_pretrained loads, streamed.
- get_fp32_state_dict_from_checkpoint: one dict name -> fp32 tensor in memory, for
  zero_to_fp32's users; refused past a memory bound, naming the streaming way.

Note: bounded memory. One unit's master is read at a time into one buffer (reused), from the
one-process checkpoint's state files, or assembled from the shards the ranks saved (each rank's
range of the unit, read one at a time into a second buffer: runtime/dp/sharded_checkpoint.py),
checked against its manifest (size, CRC-32C); its parameters are converted one at a time and
streamed into shards (io/hf_shards.py) that fill and close in turn. Peak: the largest unit's
master, one saved shard of it, one converted parameter, the writer's staging buffers
(memory_bound).

Note: what a checkpoint cannot give. Frozen parameters of a one-process run (a LoRA base) are
recorded by reference only (docs/frozen.md): their values are not in the checkpoint, so a whole
model cannot be exported from it (the trainable ones can, as a dict). A peft model's names
(base_layer, lora_A/B) are not a model from_pretrained builds from its config.json: merging needs
peft's own config, which the manifest lacks; the export refuses, naming what to do instead.
Persistent buffers are not in a checkpoint (GPT-2's and Llama's are all non-persistent: rebuilt
from config.json).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import psutil
import torch
from tqdm import tqdm

import offloadpp.runtime.checkpoint as ckpt
from offloadpp.io import IOConfig
from offloadpp.io.buffers import aligned_empty
from offloadpp.io.direct_writer import CHUNK_BYTES
from offloadpp.io.hf_shards import ShardedWriter

from .checkpoint import CheckpointError
from .dp.sharded_checkpoint import _Saved

CONFIG_FILE = "config.json"  # the model's Hugging Face config, kept by save_checkpoint
LATEST = "latest"
MEMORY_SHARE = 0.5  # of the memory available: the dict's default bound (as the consolidated state dict's)
PEFT_MARKERS = (".base_layer.", ".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_magnitude_vector")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class WeightsDoNotFitError(MemoryError):
    """The whole model's weights were asked for as one state dict and do not fit in memory."""


def resolve(checkpoint_dir: str, tag: Optional[str] = None) -> str:
    """The checkpoint folder: checkpoint_dir/tag, or the tag `latest` names; a folder holding a
    manifest itself (a TAG folder given directly) is taken as it is when no tag is given."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint folder {checkpoint_dir!r} does not exist")
    if tag is None:
        if os.path.isfile(os.path.join(checkpoint_dir, ckpt.MANIFEST)):
            return checkpoint_dir
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(
                f"{checkpoint_dir!r} has neither a {LATEST!r} file nor a {ckpt.MANIFEST}: pass the tag "
                f"(--tag, tag=...) of one of {sorted(os.listdir(checkpoint_dir))}"
            )
        with open(latest) as f:
            tag = f.read().strip()
        if not tag:
            raise CheckpointError(f"{latest!r} is empty: it names no checkpoint tag; pass the tag")
    path = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint tag {tag!r}: {path!r} does not exist")
    return path


@dataclass(frozen=True)
class Param:
    name: str
    unit: str
    offset: int  # in the unit's flat fp32 master
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype  # the model's


def _dtype(name: str, param: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise CheckpointError(f"parameter {param!r}: the manifest's dtype {name!r} is not a torch dtype")
    return d


class CheckpointWeights:
    """A checkpoint's parameters (from its manifest, checked) and their fp32 values, unit by unit."""

    def __init__(self, path: str, io: Optional[IOConfig] = None):
        self.path = path
        self.manifest = ckpt.read_manifest(path)  # (every file present, its size; the small ones' CRC)
        self.io = io or IOConfig()
        m = self.manifest
        self.world = int(m.get("world_size", 1))
        self.shard_numel = m.get("shard_numel") or {d["unit"]: d["padded_numel"] for d in m["layout"]}
        self.units: list[tuple[str, int, list[Param]]] = []  # (unit, its master's numel, params)
        self.absent: list[str] = []  # frozen parameters recorded by reference: values not here
        for d in m["layout"]:
            params = [
                Param(p["name"], d["unit"], int(p["offset"]), int(p["numel"]), tuple(p["shape"]),
                      _dtype(p["dtype"], p["name"]))
                for p in d["params"]
            ]  # fmt: skip
            self.units.append((d["unit"], int(d["padded_numel"]), params))
            self.absent += [p["name"] for p in (d.get("frozen") or {}).get("params", ())]
        # tied parameters: one slot under several names (meta "tied": first name -> the others)
        self.tied: dict[str, list[str]] = dict(m.get("tied") or {})
        self.frozen_names: set[str] = set(m.get("frozen_params") or ()) | set(self.absent)

    @property
    def params(self) -> list[Param]:
        return [p for _, _, ps in self.units for p in ps]

    def fp32_bytes(self) -> int:
        return 4 * sum(p.numel for p in self.params)

    def read_buffers_bytes(self) -> int:
        """The two read buffers: the largest unit's master, and one saved rank's shard of it."""
        full = max((n for _, n, ps in self.units if ps), default=0)
        shard = max((int(self.shard_numel[u]) for u, _, ps in self.units if ps), default=0)
        return 4 * (full + (shard if self.world > 1 else 0))

    def peft_names(self) -> list[str]:
        return [p.name for p in self.params if any(k in p.name for k in PEFT_MARKERS)]

    def masters(self, progress: bool = False) -> Iterator[tuple[list[Param], torch.Tensor]]:
        """Each unit with trainable state: its parameters and its fp32 master (a buffer reused
        for the next unit: copy what is kept)."""
        todo = [(u, n, ps) for u, n, ps in self.units if ps]
        if not todo:
            return
        full = aligned_empty(max(n for _, n, _ in todo), torch.float32, pin=False)
        part = None
        if self.world > 1:
            part = aligned_empty(max(int(self.shard_numel[u]) for u, _, _ in todo), torch.float32, pin=False)
        saved = _Saved(self.path, self.manifest, self.io)
        try:
            for u, n, ps in tqdm(todo, desc="offloadpp: reading units", disable=not progress, unit="unit"):
                key = f"{u}.master"
                if self.world == 1:
                    st, m = saved.store(0)
                    rec = ckpt._record(m, st, key, saved.folder(0))
                    n = rec["nbytes"] // 4  # (the array as saved: the unit's slot)
                    if n > full.numel():
                        full = aligned_empty(n, torch.float32, pin=False)
                    ckpt.read_array(st, key, full[:n], rec, saved.folder(0))
                else:
                    so = int(self.shard_numel[u])
                    end = max(p.offset + p.numel for p in ps)  # (past it: padding)
                    for k in range(-(-end // so)):
                        st, m = saved.store(k)
                        ckpt.read_array(
                            st, key, part[:so], ckpt._record(m, st, key, saved.folder(k)), saved.folder(k)
                        )
                        a, b = k * so, min(end, (k + 1) * so)
                        full[a:b].copy_(part[: b - a])
                yield ps, full
        finally:
            saved.close()


def value(p: Param, master: torch.Tensor) -> torch.Tensor:
    """Parameter p's fp32 values: a view of its unit's master."""
    return master[p.offset : p.offset + p.numel].view(p.shape)


def available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def get_fp32_state_dict_from_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                        exclude_frozen_parameters: bool = False,
                                        max_bytes: Optional[int] = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """DeepSpeed's get_fp32_state_dict_from_zero_checkpoint for an offloadpp checkpoint: every
    parameter as an fp32 CPU tensor, by name (tied ones under each of their names, one tensor),
    from checkpoint_dir/tag (None: the tag `latest` names). exclude_frozen_parameters: the
    trainable ones only (required where the frozen ones were not saved: a one-process LoRA run).
    Refuses (WeightsDoNotFitError) when the dict and the read buffers would pass max_bytes
    (None: MEMORY_SHARE of the memory available now), naming `offloadpp export`, which streams."""
    cw = CheckpointWeights(resolve(checkpoint_dir, tag))
    keep = [p for p in cw.params if not (exclude_frozen_parameters and p.name in cw.frozen_names)]
    if cw.absent and not exclude_frozen_parameters:
        raise CheckpointError(
            f"checkpoint {cw.path!r} does not hold its {len(cw.absent)} frozen parameters (e.g. {cw.absent[0]!r}): a "
            "one-process run records them by reference only (docs/frozen.md). Pass exclude_frozen_parameters=True "
            "for the trained ones (load them over the base model), or export from the training script"
        )
    need = 4 * sum(p.numel for p in keep) + cw.read_buffers_bytes()
    bound = int(MEMORY_SHARE * available_bytes()) if max_bytes is None else int(max_bytes)
    if need > bound:
        raise WeightsDoNotFitError(
            f"the fp32 weights of checkpoint {cw.path!r} take {need / 2**30:.2f} GiB in memory (with the read "
            f"buffers), past the bound of {bound / 2**30:.2f} GiB (max_bytes; default {MEMORY_SHARE:.0%} of the "
            f"memory available). Stream them to a Hugging Face folder instead: `offloadpp export {checkpoint_dir} "
            "OUT_DIR` (sharded safetensors, one unit in memory at a time)"
        )
    wanted = {p.name for p in keep}
    out: dict[str, torch.Tensor] = {}
    for ps, master in cw.masters():
        for p in ps:
            if p.name in wanted:
                out[p.name] = value(p, master).clone()  # (the buffer is reused for the next unit)
    for first, others in cw.tied.items():
        if first in out:
            out.update(dict.fromkeys(others, out[first]))
    return out


def memory_bound(cw: CheckpointWeights, dtype: Optional[torch.dtype]) -> dict[str, int]:
    """What an export holds at most, by part (module Note: bounded memory)."""
    biggest = max(
        (p.numel * (dtype or p.dtype).itemsize for p in cw.params if (dtype or p.dtype) != torch.float32),
        default=0,
    )  # (an fp32 parameter is written from its view of the master: no copy)
    return {"read buffers": cw.read_buffers_bytes(), "one converted parameter": biggest,
            "write staging": 2 * CHUNK_BYTES}  # fmt: skip


@dataclass(frozen=True)
class ExportResult:
    files: list[str]
    nbytes: int
    bound_bytes: int
    config: bool  # config.json written


def export_checkpoint(checkpoint_dir: str, out_dir: str, *, tag: Optional[str] = None,
                      dtype: Optional[torch.dtype] = None, max_shard_bytes: Optional[int] = None,
                      max_memory_bytes: Optional[int] = None, progress: bool = False,
                      say: Callable[[str], None] = print) -> ExportResult:  # fmt: skip
    """A Hugging Face folder in out_dir from the checkpoint (module docstring): sharded
    safetensors with their index (one file without it when it fits one shard), config.json
    when the checkpoint kept one. dtype: each parameter's own (the model's) unless given.
    Refuses when the memory bound passes max_memory_bytes (None: what is available now)."""
    cw = CheckpointWeights(resolve(checkpoint_dir, tag))
    peft = cw.peft_names()
    if peft:
        raise CheckpointError(
            f"checkpoint {cw.path!r} is of a peft model (e.g. {peft[0]!r}): its adapters are merged with peft's "
            "own config, which a checkpoint does not keep, and its names are not a model from_pretrained "
            "builds. Use offloadpp.get_fp32_state_dict_from_checkpoint(dir) (exclude_frozen_parameters=True where "
            "one process trained it: its base is not in the checkpoint) and load the dict into the PeftModel, or "
            "engine.save_pretrained / save_16bit_model in the training script"
        )
    if cw.absent:
        raise CheckpointError(
            f"checkpoint {cw.path!r} does not hold its {len(cw.absent)} frozen parameters (e.g. {cw.absent[0]!r}): "
            "a one-process run records them by reference only (docs/frozen.md), so the whole model cannot be "
            "exported from it. In the training script, engine.save_pretrained(dir) writes the adapters and "
            "save_16bit_model(dir) the whole model; offloadpp.get_fp32_state_dict_from_checkpoint(dir, "
            "exclude_frozen_parameters=True) gives the trained parameters"
        )
    parts = memory_bound(cw, dtype)
    bound = sum(parts.values())
    limit = available_bytes() if max_memory_bytes is None else int(max_memory_bytes)
    detail = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items())
    say(f"offloadpp export: {cw.path} -> {out_dir}: {len(cw.params)} parameters in {len(cw.units)} units, "
        f"{cw.world} rank(s); memory bound {bound / 2**30:.2f} GiB ({detail}), limit {limit / 2**30:.2f} GiB")  # fmt: skip
    if bound > limit:
        raise WeightsDoNotFitError(
            f"exporting {cw.path!r} needs {bound / 2**30:.2f} GiB ({detail}), past the limit of "
            f"{limit / 2**30:.2f} GiB (--max-memory; default the memory available)"
        )
    out_dtype = {
        p.name: (dtype if dtype is not None and p.dtype.is_floating_point else p.dtype) for p in cw.params
    }
    decl = [(p.name, out_dtype[p.name], p.shape) for p in cw.params]
    w = ShardedWriter(out_dir, decl, max_shard_bytes=max_shard_bytes)
    try:
        for ps, master in cw.masters(progress=progress):
            for p in ps:
                w.write(p.name, value(p, master).to(out_dtype[p.name]))
        files = w.close()
    except BaseException:
        w.abort()
        raise
    config = _copy_config(cw, out_dir, dtype)
    if not config:
        say(
            f"offloadpp export: config.json is missing: {cw.path!r} was saved without the model's Hugging Face "
            "config (a model without one, or an older offloadpp). The weights are written; add it with "
            f"AutoConfig.from_pretrained(BASE_MODEL).save_pretrained({out_dir!r}) (or copy the base model's "
            "config.json) before from_pretrained"
        )
    else:
        files.append(os.path.join(out_dir, CONFIG_FILE))
    return ExportResult(files, w.total_bytes, bound, config)


def _copy_config(cw: CheckpointWeights, out_dir: str, dtype: Optional[torch.dtype]) -> bool:
    """The checkpoint's config.json into out_dir, its "dtype" the weights' (as save_pretrained
    records the model's: the export's, else the parameters' most common floating dtype); False
    where the checkpoint has none."""
    src = os.path.join(cw.path, CONFIG_FILE)
    if not os.path.isfile(src):
        return False
    if dtype is None:
        floats = [p.dtype for p in cw.params if p.dtype.is_floating_point]
        dtype = max(set(floats), key=floats.count) if floats else None
    with open(src) as f:
        cfg = json.load(f)
    if dtype is not None:
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        if "torch_dtype" in cfg:  # (transformers 4's name)
            cfg["torch_dtype"] = cfg["dtype"]
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return True
