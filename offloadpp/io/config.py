"""IOConfig: the I/O engine's settings, validated once, the only place their defaults live."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, field_validator

ALIGNMENT = 4096  # mirrors offloadpp._C.ALIGNMENT (checked at import of offloadpp.io)

Backend = Literal["auto", "libaio", "io_uring", "threadpool"]


class IOConfig(BaseModel):
    """How swap I/O is done.

    backend: "auto" probes libaio, io_uring, then the thread pool with a real O_DIRECT write and
        read-back in the target directory and takes the first that works.
    block_size_bytes: a large request is split into blocks of this size (multiple of 4096),
        queue_depth of them in flight together per worker thread.
    num_threads: worker threads per directory, each with its own kernel queue.
    o_direct: bypass the page cache (the point of the exercise); False only for filesystems
        without O_DIRECT support.
    checksum: CRC-32C of every payload, verified on read, so a flipped bit on disk is an error
        naming the key and file, never silently different training (the CPU's CRC instruction:
        a pass over memory each way; docs/performance.md has the cost on a step).
    stripe_min_bytes: with several directories, tensors at least this large are split over all
        of them (one file each) so one get reads from every SSD; smaller ones go whole to the
        directory holding the fewest bytes.
    pin: page-lock buffers the store allocates (None: when CUDA is available).
    bounce_cache_bytes: bounce buffers (for unaligned or non-contiguous tensors) kept for reuse.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Backend = "auto"
    block_size_bytes: int = 1 << 20
    queue_depth: int = 8
    num_threads: int = 1
    o_direct: bool = True
    checksum: bool = True
    stripe_min_bytes: int = 16 << 20
    pin: Optional[bool] = None
    bounce_cache_bytes: int = 256 << 20

    @field_validator("block_size_bytes")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if v < ALIGNMENT or v % ALIGNMENT:
            raise ValueError(f"block_size_bytes={v} must be a positive multiple of {ALIGNMENT}")
        if v > 1 << 30:
            raise ValueError(f"block_size_bytes={v} exceeds 1 GiB")
        return v

    @field_validator("queue_depth")
    @classmethod
    def _queue_depth(cls, v: int) -> int:
        if not 1 <= v <= 4096:
            raise ValueError(f"queue_depth={v} must be in [1, 4096]")
        return v

    @field_validator("num_threads")
    @classmethod
    def _num_threads(cls, v: int) -> int:
        if not 1 <= v <= 64:
            raise ValueError(f"num_threads={v} must be in [1, 64]")
        return v

    @field_validator("stripe_min_bytes", "bounce_cache_bytes")
    @classmethod
    def _non_negative(cls, v: int, info) -> int:
        if v < 0:
            raise ValueError(f"{info.field_name}={v} must be >= 0")
        return v
