"""The current weights as files `from_pretrained` loads, written unit by unit.

Note: bounded memory. Each unit's fp32 master is fetched (from SSD or memory, into a buffer of
the engine's pools), its parameters converted to the export dtype one at a time and streamed
into the file; then the next unit. Nothing holds more than a unit. A name ending in .safetensors
gets safetensors (io/safetensors_stream.py), any other (pytorch_model.bin) torch.save's format
(io/torch_stream.py); both stream. Weights up to `max_shard_bytes` go to one file named as asked;
more are split into shards named as Hugging Face's save_pretrained names them
(model-0000k-of-0000N.safetensors with model.safetensors.index.json; pytorch_model-0000k-of-
0000N.bin with pytorch_model.bin.index.json), which from_pretrained reads. Tied weights (embeddings and lm_head) are one
parameter under two names: stored once under the first name, from_pretrained ties them again.
Files are written under temporary names and renamed when complete, the index last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
from torch import nn
from tqdm import tqdm

from offloadpp.io.hf_shards import DEFAULT_SHARD_BYTES, ShardedWriter

from .unit import Unit

__all__ = ["DEFAULT_SHARD_BYTES", "ExportFormat", "Merge", "export_weights", "trainable_state_dict"]


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for mname, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


@dataclass(frozen=True)
class Merge:
    """Adapters folded into the weights they adapt as an export writes them (docs/frozen.md),
    unit by unit: `rename` gives each parameter's and buffer's written name (None: not written,
    an adapter's own weights); `deltas`, by written name, the low-rank pairs added to that weight:
    (A's name, B's name, scale, transposed) for W + scale * B @ A (transposed: its transpose), in
    fp32. A pair must belong to its weight's unit (a LoRA layer lives in its base layer's block)."""

    rename: Callable[[str], Optional[str]]
    deltas: Mapping[str, tuple[tuple[str, str, float, bool], ...]]


@dataclass(frozen=True)
class ExportFormat:
    """What an export writes: the weights in `dtype`, as safetensors or (another file name)
    torch.save's format, in shards of at most max_shard_bytes (None: DEFAULT_SHARD_BYTES at the
    time of the export), without the frozen parameters if asked; direct=False: through the page
    cache rather than O_DIRECT (io/direct_writer.py; for the benchmark's side-by-side)."""

    dtype: torch.dtype
    filename: str = "model.safetensors"
    max_shard_bytes: Optional[int] = None
    exclude_frozen: bool = False
    direct: bool = True
    merge: Optional[Merge] = None


def export_weights(
    units: list[Unit],
    model: nn.Module,
    save_dir: str,
    fmt: ExportFormat,
    *,
    before: Optional[Callable[[], None]] = None,
    progress: bool = False,
    write: bool = True,
) -> list[str]:
    """Writes the weights to save_dir in `fmt` (see the module Note); returns the files written.
    write=False: over several ranks, a rank other than the writer's, which takes part in
    gathering each unit's master (in the writer's order) and writes nothing."""
    dtype, filename, exclude_frozen, direct = fmt.dtype, fmt.filename, fmt.exclude_frozen, fmt.direct
    max_shard_bytes = fmt.max_shard_bytes or DEFAULT_SHARD_BYTES
    if before is not None:
        before()  # the optimizer quiet: the masters are final
    owner = {}
    for u in units:
        for p, s in u.layout.all_params:
            owner[id(p)] = (u, s)
    entries = []  # (name, unit, slot) in unit order
    seen: set[int] = set()
    by_unit: dict[str, list] = {u.name: [] for u in units}
    merge = fmt.merge
    named = {}  # every parameter name -> (unit, slot): the adapters a merge reads
    for name, p in model.named_parameters(remove_duplicate=False):
        named[name] = owner[id(p)]
        if merge is not None:
            name = merge.rename(name)
        if id(p) in seen or name is None or (exclude_frozen and not p.requires_grad):
            seen.add(id(p))
            continue
        seen.add(id(p))
        u, s = owner[id(p)]
        by_unit[u.name].append((name, u, s))
    for u in units:
        entries.extend(by_unit[u.name])
    if not write:
        for u in units:
            if by_unit[u.name]:
                u.export_master()
                u.end_export()
        return []
    buffers = _persistent_buffers(model)
    if merge is not None:
        buffers = [(merge.rename(n), b) for n, b in buffers if merge.rename(n) is not None]
    decl = [(name, dtype, tuple(s.shape)) for name, _, s in entries] + [
        (name, b.dtype, tuple(b.shape)) for name, b in buffers
    ]
    w = ShardedWriter(save_dir, decl, filename=filename, max_shard_bytes=max_shard_bytes, direct=direct)
    held: Optional[Unit] = None
    master: Optional[torch.Tensor] = None
    try:
        for name, u, s in tqdm(entries, desc="offloadpp: exporting", disable=not progress, leave=False):
            if held is not u:
                if held is not None:
                    held.end_export()
                held = None
                master = u.export_master()
                held = u
            value = u.exported(s, master)
            if merge is not None and name in merge.deltas:
                value = _merged(value, u, master, merge.deltas[name], named)
            w.write(name, value.to(dtype))
        if held is not None:
            held.end_export()
            held = None
        for name, b in buffers:
            w.write(name, b)
        return w.close()
    except BaseException:
        w.abort()
        raise
    finally:
        if held is not None:
            held.end_export()


def _merged(value: torch.Tensor, u: Unit, master: torch.Tensor, deltas, named: dict) -> torch.Tensor:
    """A weight with its adapters' deltas added (Merge), in fp32."""
    out = value.float().clone()
    for a, b, scale, transposed in deltas:
        (ua, sa), (ub, sb) = named[a], named[b]
        if ua is not u or ub is not u:
            raise ValueError(f"merging {a!r} and {b!r}: an adapter outside its weight's unit {u.name!r}")
        delta = u.exported(sb, master).float() @ u.exported(sa, master).float()
        out += (delta.t() if transposed else delta) * scale
    return out


def trainable_state_dict(
    units: list[Unit], before: Optional[Callable[[], None]] = None
) -> dict[str, torch.Tensor]:
    """The trainable parameters' current values by every name they have, in the model's dtypes
    (an adapter's state: peft's save_pretrained filters its keys from this), one unit's master
    at a time; the frozen segments are not read (docs/frozen.md). Over several ranks every rank
    calls it (each unit's master is gathered)."""
    if before is not None:
        before()
    out: dict[str, torch.Tensor] = {}
    for u in units:
        if not any(s.requires_grad for _, s in u.params):
            continue
        master = u.export_master(with_frozen=False)
        try:
            for _, s in u.params:
                if s.requires_grad:
                    v = u.exported(s, master).to(s.dtype, copy=True)
                    out.update(dict.fromkeys(s.names, v))
        finally:
            u.end_export()
    return out
