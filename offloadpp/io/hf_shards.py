"""Weights written as Hugging Face's save_pretrained writes them, one tensor at a time.

Every tensor's name, dtype and shape is declared first; the tensors then come one by one in that
order and go into the shard they were planned into, each shard a file streamed front to back
(safetensors_stream.py for a name ending in .safetensors, torch_stream.py for torch.save's
format), so nothing holds more than the tensor being written and the writer's staging buffers.
Up to `max_shard_bytes` go into one file named as asked; more are split into shards named as
save_pretrained names them (model-0000k-of-0000N.safetensors with model.safetensors.index.json;
pytorch_model-0000k-of-0000N.bin with pytorch_model.bin.index.json), which from_pretrained reads.
Each shard is written under a temporary name and renamed once complete, the index last; what an
earlier export of the same name left and this one did not write is removed after (from_pretrained
prefers a single file to an index, so an old one would shadow new shards).
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional, Sequence

import torch

from .durable import fsync_dir, write_atomic
from .safetensors_stream import SafetensorsWriter
from .torch_stream import TorchSaveWriter

DEFAULT_SHARD_BYTES = 5 * 10**9  # save_pretrained's max_shard_size="5GB"
INDEX_SUFFIX = ".index.json"


def shard_names(filename: str, n: int) -> list[str]:
    if n == 1:
        return [filename]
    stem, ext = os.path.splitext(filename)
    return [f"{stem}-{i + 1:05d}-of-{n:05d}{ext}" for i in range(n)]


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


class ShardedWriter:
    """decl: (name, dtype, shape) in the order write() will be called. A tensor never spans two
    shards; a shard takes tensors while they fit max_shard_bytes (a larger tensor alone)."""

    def __init__(self, save_dir: str, decl: Sequence[tuple[str, torch.dtype, Sequence[int]]], *,
                 filename: str = "model.safetensors", max_shard_bytes: Optional[int] = None,
                 direct: bool = True):  # fmt: skip
        limit = max_shard_bytes or DEFAULT_SHARD_BYTES
        if limit <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {limit}")
        self.save_dir, self.filename, self.direct = save_dir, filename, direct
        self.decl = [(n, d, tuple(int(x) for x in s)) for n, d, s in decl]
        self.sizes = [nbytes_of(d, s) for _, d, s in self.decl]
        shards: list[list[int]] = [[]]
        total = 0
        for i, n in enumerate(self.sizes):
            if shards[-1] and total + n > limit:
                shards.append([])
                total = 0
            shards[-1].append(i)
            total += n
        self.shards = shards
        self.names = shard_names(filename, len(shards))
        self.written: list[str] = []
        self.weight_map: dict[str, str] = {}
        self._shard = -1  # the shard being written
        self._w = None
        self._tmp = ""
        self._next = 0  # the next declared tensor
        os.makedirs(save_dir, exist_ok=True)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def _open(self, k: int) -> None:
        fname = self.names[k]
        decl = [self.decl[i] for i in self.shards[k]]
        self._tmp = os.path.join(self.save_dir, f".{fname}.tmp")
        if self.filename.endswith(".safetensors"):
            self._w = SafetensorsWriter(self._tmp, decl, {"format": "pt"}, direct=self.direct)
        else:
            self._w = TorchSaveWriter(self._tmp, decl, direct=self.direct)
        self._shard = k

    def _finish_shard(self) -> None:
        self._w.close()
        final = os.path.join(self.save_dir, self.names[self._shard])
        os.replace(self._tmp, final)
        self.written.append(final)
        self._w = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next declared tensor (converted to its declared dtype by the caller)."""
        i = self._next
        if i >= len(self.decl):
            raise ValueError(f"{self.save_dir}: tensor {name!r} written after every declared tensor")
        if self._w is None or i not in self.shards[self._shard]:
            if self._w is not None:
                self._finish_shard()
            self._open(self._shard + 1)
        self._w.write(name, tensor)  # (checks the name and size against the declaration)
        self.weight_map[name] = self.names[self._shard]
        self._next += 1

    def close(self) -> list[str]:
        """Finishes the last shard, writes the index (several shards), removes what an earlier
        export of the same name left, makes the folder durable; returns the files written."""
        if self._next != len(self.decl):
            raise ValueError(
                f"{self.save_dir}: {len(self.decl) - self._next} declared tensors were not written"
            )
        if self._w is None and self.decl == [] and not self.written:
            self._open(0)  # (no tensor: an empty file, as the libraries write one)
        if self._w is not None:
            self._finish_shard()
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
            path = os.path.join(self.save_dir, self.filename + INDEX_SUFFIX)
            write_atomic(path, json.dumps(index, indent=2).encode())
            self.written.append(path)
        _remove_stale(self.save_dir, self.filename, self.names)
        fsync_dir(self.save_dir)
        return self.written

    def abort(self) -> None:
        """Drops the shard being written (the shards already complete stay, under their names)."""
        if self._w is not None:
            self._w.abort()
            self._w = None


def _remove_stale(save_dir: str, filename: str, names: list[str]) -> None:
    """Removes what an earlier export of the same name left that this one did not write: its
    single file, shards or index. Called only after the new files and index are durable: until
    then the old export is whole."""
    stem, ext = os.path.splitext(filename)
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}" + re.escape(ext))
    index = filename + INDEX_SUFFIX
    for f in os.listdir(save_dir):
        if f in names or (f == index and len(names) > 1):
            continue
        if f in (filename, index) or shard.fullmatch(f):
            os.unlink(os.path.join(save_dir, f))
