"""A safetensors file written tensor by tensor, so that it never has to be whole in memory.

The safetensors library writes a file from a dict of tensors held in memory at once; a model
larger than RAM cannot be. The format is simple enough to stream: an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and [start, end) byte range in the data,
then the data. The header is known before any data (every name, dtype and shape), so it is
written first and each tensor's bytes follow as they come, in the declared order, through
O_DIRECT (direct_writer.py; direct=False: the page cache). Files written here load with
safetensors and `from_pretrained` like any other.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Optional, Sequence

import torch

from .direct_writer import DirectFileWriter

DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


class SafetensorsWriter:
    """entries: (name, dtype, shape) in the order write() will be called."""

    def __init__(self, path: str, entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Optional[dict] = None, *, direct: bool = True):  # fmt: skip
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._order: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
            n = dtype.itemsize
            for d in shape:
                n *= int(d)
            header[name] = {
                "dtype": DTYPES[dtype],
                "shape": [int(d) for d in shape],
                "data_offsets": [offset, offset + n],
            }
            self._order.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the library writes it
        self.path = path
        self.data_bytes = offset
        self._f = DirectFileWriter(path) if direct else open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, nbytes = self._order[self._next]
        if name != want:
            raise ValueError(f"{self.path}: tensor {name!r} written where {want!r} was declared")
        t = tensor.detach().contiguous().cpu()
        if t.numel() * t.element_size() != nbytes:
            raise ValueError(
                f"{self.path}: tensor {name!r} has {t.numel() * t.element_size()} bytes, declared {nbytes}"
            )
        if nbytes:
            self._f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
        self._next += 1

    def close(self) -> None:
        """Finishes the file (every declared tensor must have been written) and makes it durable."""
        if self._f.closed:
            return
        try:
            if self._next != len(self._order):
                raise ValueError(
                    f"{self.path}: {len(self._order) - self._next} declared tensors were not written"
                )
            if isinstance(self._f, DirectFileWriter):
                self._f.close()  # (durable when it returns)
            else:
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()

    def abort(self) -> None:
        if isinstance(self._f, DirectFileWriter):
            self._f.abort()
            return
        self._f.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
