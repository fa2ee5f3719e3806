"""The swap file format: one 4096-byte header block, then the payload padded to 4096 bytes.

Header (little-endian), checked field by field on every read:
    magic "OFPPSWAP", format version, header size, flags (COMPLETE, CHECKSUM), ndim,
    generation, total tensor bytes, this part's byte offset and length in the tensor,
    part index and count, payload offset, payload CRC-32C, dtype name, key length,
    then the shape (ndim x int64) and the key (UTF-8); the last 4 bytes are a CRC-32 of the
    rest of the block, so a corrupted header is told apart from a foreign file.

Note: write order. A put first overwrites the header with flags=0 (incomplete), then writes the
payload, then the final header, each step only after the previous one completed (a chain in the
engine). An interrupted or failed put therefore leaves a header that reads as incomplete, never
as valid. The generation, kept by the store per key, catches a file that is complete but older
than the store's index (a restored copy, a put that went to another file).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from .errors import EBADMSG, EINVAL, ESTALE, SwapIOError, swap_error

MAGIC = b"OFPPSWAP"
VERSION = 1
HEADER_BYTES = 4096
FLAG_COMPLETE = 1
FLAG_CHECKSUM = 2
MAX_NDIM = 64
MAX_KEY_BYTES = 1024

_FIXED = struct.Struct("<8sIIII QQQQ II Q I 16s I")
_CRC = struct.Struct("<I")
# where the payload CRC-32C sits in the header: the engine seals a header there (csrc/io/engine.h)
CHECKSUM_AT = struct.calcsize(_FIXED.format[: _FIXED.format.rindex("I 16s I")])

# Every dtype torch can store; the name is what goes into the header.
_DTYPES: dict[str, torch.dtype] = {}
for _name in (
    "float64 float32 float16 bfloat16 complex128 complex64 int64 int32 int16 int8 uint8 bool "
    "uint16 uint32 uint64 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
).split():
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise swap_error(EINVAL, f"storing dtype {dtype} (not supported by the swap format)") from None


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class Header:
    key: str
    dtype: str
    shape: tuple[int, ...]
    generation: int
    total_nbytes: int
    part_offset: int
    part_nbytes: int
    part_index: int
    part_count: int
    checksum: int = 0
    complete: bool = True
    has_checksum: bool = False

    def pack_into(self, mv: memoryview) -> None:
        """Writes this header into the first HEADER_BYTES of `mv` (the rest of the block zeroed)."""
        key = self.key.encode()
        flags = (FLAG_COMPLETE if self.complete else 0) | (FLAG_CHECKSUM if self.has_checksum else 0)
        fixed = _FIXED.pack(
            MAGIC,
            VERSION,
            HEADER_BYTES,
            flags,
            len(self.shape),
            self.generation,
            self.total_nbytes,
            self.part_offset,
            self.part_nbytes,
            self.part_index,
            self.part_count,
            HEADER_BYTES,
            self.checksum,
            self.dtype.encode(),
            len(key),
        )
        body = fixed + struct.pack(f"<{len(self.shape)}q", *self.shape) + key
        block = bytearray(HEADER_BYTES)
        block[: len(body)] = body
        _CRC.pack_into(block, HEADER_BYTES - 4, zlib.crc32(block[: HEADER_BYTES - 4]))
        mv[:HEADER_BYTES] = block


def unpack(mv: memoryview, path: str) -> Header:
    """Parses a header block; SwapIOError (EBADMSG) for a foreign file or a corrupted header."""
    block = bytes(mv[:HEADER_BYTES])
    if block[:8] != MAGIC:
        raise swap_error(EBADMSG, "reading swap header (not an offloadpp swap file: bad magic)", path, 0)
    (stored_crc,) = _CRC.unpack_from(block, HEADER_BYTES - 4)
    if zlib.crc32(block[: HEADER_BYTES - 4]) != stored_crc:
        raise swap_error(EBADMSG, "reading swap header (corrupted: header checksum mismatch)", path, 0)
    (
        _magic,
        version,
        header_bytes,
        flags,
        ndim,
        generation,
        total,
        part_off,
        part_n,
        idx,
        count,
        payload_off,
        checksum,
        dtype,
        key_len,
    ) = _FIXED.unpack_from(block, 0)
    if version != VERSION:
        raise swap_error(
            EBADMSG, f"reading swap header (format version {version}, expected {VERSION})", path, 0
        )
    if (
        header_bytes != HEADER_BYTES
        or payload_off != HEADER_BYTES
        or ndim > MAX_NDIM
        or key_len > MAX_KEY_BYTES
    ):
        raise swap_error(EBADMSG, "reading swap header (corrupted: impossible field values)", path, 0)
    pos = _FIXED.size
    shape = struct.unpack_from(f"<{ndim}q", block, pos)
    pos += 8 * ndim
    key = block[pos : pos + key_len].decode(errors="replace")
    return Header(
        key=key,
        dtype=dtype.rstrip(b"\0").decode(errors="replace"),
        shape=tuple(shape),
        generation=generation,
        total_nbytes=total,
        part_offset=part_off,
        part_nbytes=part_n,
        part_index=idx,
        part_count=count,
        checksum=checksum,
        complete=bool(flags & FLAG_COMPLETE),
        has_checksum=bool(flags & FLAG_CHECKSUM),
    )


def check(found: Header, expected: Header, path: str) -> None:
    """Raises SwapIOError unless `found` is the complete header `expected` describes."""
    if found.key != expected.key:
        raise swap_error(
            EBADMSG, f"reading key {expected.key!r} (the file belongs to key {found.key!r})", path, 0
        )
    if not found.complete:
        raise swap_error(
            ESTALE,
            f"reading key {expected.key!r} (incomplete file: a put of generation {found.generation} "
            "failed or was interrupted)",
            path,
            0,
        )
    if found.generation != expected.generation:
        raise swap_error(
            ESTALE,
            f"reading key {expected.key!r} (stale file: generation {found.generation} on disk, "
            f"expected {expected.generation})",
            path,
            0,
        )
    mismatch = [
        f"{name} {getattr(found, name)!r} != {getattr(expected, name)!r}"
        for name in (
            "dtype",
            "shape",
            "total_nbytes",
            "part_offset",
            "part_nbytes",
            "part_index",
            "part_count",
        )
        if getattr(found, name) != getattr(expected, name)
    ]
    if mismatch:
        raise swap_error(
            EBADMSG, f"reading key {expected.key!r} (header mismatch: {', '.join(mismatch)})", path, 0
        )


__all__ = ["HEADER_BYTES", "Header", "SwapIOError", "check", "dtype_from_name", "dtype_name", "unpack"]
