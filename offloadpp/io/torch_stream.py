"""A torch.save file (`pytorch_model.bin`) written tensor by tensor, never whole in memory.

torch.save pickles a dict whose tensors are all in memory, then writes their storages. Its
format is a zip archive: `data.pkl` (the pickled dict, each tensor a call of
`torch._utils._rebuild_tensor_v2` on a storage named by a persistent id), a few small records,
then one record `data/<key>` per storage. Every name, dtype and shape is known before any data,
so the pickle is written first, from stand-ins that pickle exactly as torch pickles a tensor
with a storage of its own, and each tensor's bytes follow as a record of their own as they come
(torch's own zip writer, 64-byte aligned records, into a file written through O_DIRECT:
direct_writer.py; direct=False: the page cache). Files written here load with
`torch.load(..., weights_only=True)`, with or without mmap, and with `from_pretrained`.

Note: no CRC-32. The records' checksum fields are left 0, as torch.save leaves them with
`torch.serialization.config.save.compute_crc32 = False`; torch.load never checks them. Torch's
writer computes them at about 0.15 GB/s on the development machine, 4-6x the time of writing
the bytes (1 GiB: 7.1 s with, 1.2-1.7 s without, fsync included), which for a model larger than
memory is minutes.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
from typing import Sequence

import torch

from .direct_writer import DirectFileWriter

# the typed-storage class torch pickles for each dtype (TypedStorage._pickle_storage_type)
_STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float16: "HalfStorage", torch.bfloat16: "BFloat16Storage",
    torch.float64: "DoubleStorage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}  # fmt: skip
_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


class _Storage:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", getattr(torch, _STORAGE_TYPES[obj.dtype]), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, _Tensor):
            stride, n = [], 1
            for d in reversed(obj.shape):
                stride.append(n)
                n *= d
            args = (obj.storage, 0, obj.shape, tuple(reversed(stride)), False, collections.OrderedDict())
            return torch._utils._rebuild_tensor_v2, args
        return NotImplemented


class TorchSaveWriter:
    """entries: (name, dtype, shape) in the order write() will be called; the file holds the
    dict {name: tensor}, as torch.save would have written it."""

    def __init__(
        self, path: str, entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], *, direct: bool = True
    ):
        self._order: list[tuple[str, str, int]] = []  # (name, record, bytes)
        obj = {}
        for i, (name, dtype, shape) in enumerate(entries):
            if dtype not in _STORAGE_TYPES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be written here")
            shape = tuple(int(d) for d in shape)
            numel = 1
            for d in shape:
                numel *= d
            key = str(i)
            obj[name] = _Tensor(_Storage(key, dtype, numel), shape)
            self._order.append((name, f"data/{key}", numel * dtype.itemsize))
        buf = io.BytesIO()
        _Pickler(buf, protocol=_PROTOCOL).dump(obj)
        self.path = path
        self.data_bytes = sum(n for _, _, n in self._order)
        self._file = DirectFileWriter(path) if direct else None
        # no CRC-32 (module Note)
        self._zip = torch._C.PyTorchFileWriter(self._file if direct else path, False)
        self._open = True
        pkl = buf.getvalue()
        self._zip.write_record("data.pkl", pkl, len(pkl))
        self._zip.write_record(".format_version", "1", 1)
        self._zip.write_record(".storage_alignment", "64", 2)
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, record, nbytes = self._order[self._next]
        if name != want:
            raise ValueError(f"{self.path}: tensor {name!r} written where {want!r} was declared")
        t = tensor.detach().contiguous().cpu()
        if t.numel() * t.element_size() != nbytes:
            raise ValueError(
                f"{self.path}: tensor {name!r} has {t.numel() * t.element_size()} bytes, declared {nbytes}"
            )
        if nbytes:
            # the tensor's own bytes, as a storage (a slice of a larger one is a view, no copy)
            off = t.storage_offset() * t.element_size()
            self._zip.write_record(record, t.untyped_storage()[off : off + nbytes], nbytes)
        else:
            self._zip.write_record(record, b"", 0)
        self._next += 1

    def close(self) -> None:
        """Finishes the archive (every declared tensor must have been written) and makes it durable."""
        if not self._open:
            return
        self._open = False
        if self._next != len(self._order):
            raise ValueError(
                f"{self.path}: {len(self._order) - self._next} declared tensors were not written"
            )
        self._zip.write_end_of_file()
        del self._zip  # closes the file (or, writing through self._file, flushes it)
        if self._file is not None:
            self._file.close()  # durable when it returns
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def abort(self) -> None:
        self._open = False
        self.__dict__.pop("_zip", None)
        if self._file is not None:
            self._file.abort()
        try:
            os.unlink(self.path)
        except OSError:
            pass
