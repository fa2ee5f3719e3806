"""AsyncIOHandle: DeepSpeed's `aio_handle` (0.19.8) on the offloadpp engine.

Same constructor arguments and methods, same return values: async_pread/async_pwrite return 0
and queue an op; wait() blocks until every queued op finished and returns how many there were;
sync_*/pread/pwrite(async=False) return that count too; new_cpu_locked_tensor allocates an
aligned (pinned with CUDA) tensor that is_pinned() recognises, views included. DeepSpeed's
swappers (deepspeed/runtime/swap_tensor) run on it unchanged.

Differences, all on the side of safety: failures raise SwapIOError (DeepSpeed prints and returns
-1 or asserts); any buffer works (CPU or not, contiguous or not, any alignment) where DeepSpeed
needs nbytes divisible by intra_op_parallelism; a write never pads the file: the 4096-aligned
body goes through O_DIRECT, the remaining tail bytes through a buffered descriptor.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional, Union

import torch

import offloadpp._C as _C

from .buffers import ALIGNMENT, BounceCache, align_up, aligned_empty, is_direct_capable, is_managed
from .engine import BACKENDS
from .errors import EINVAL, EIO, SwapIOError, swap_error


@dataclass
class _Op:
    handle: object
    buffer: torch.Tensor
    bounce: Optional[torch.Tensor]
    write: bool
    path: str
    offset: int
    nbytes: int
    validate: bool


def _pick_backend(requested: str, block_size: int, queue_depth: int, threads: int) -> _C.Engine:
    if requested != "auto":
        return _C.Engine(requested, block_size, queue_depth, threads)
    errors = []
    for name in BACKENDS:  # AUTO without a directory: the first backend whose setup succeeds
        try:
            return _C.Engine(name, block_size, queue_depth, threads)
        except SwapIOError as e:
            errors.append(f"{name}: {e}")
    raise swap_error(EIO, "creating an I/O engine (" + "; ".join(errors) + ")")


class AsyncIOHandle:
    """Drop-in for `deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle`."""

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        *,
        backend: str = "auto",
    ):
        if block_size <= 0 or queue_depth <= 0 or intra_op_parallelism <= 0:
            raise swap_error(
                EINVAL,
                f"aio handle(block_size={block_size}, queue_depth={queue_depth}, "
                f"intra_op_parallelism={intra_op_parallelism}) (all must be positive)",
            )
        self._block_size = int(block_size)
        self._queue_depth = int(queue_depth)
        self._single_submit = bool(single_submit)  # the engine always batches; kept for the getters
        self._overlap_events = bool(overlap_events)  # the engine always overlaps; kept for the getters
        self._intra_op_parallelism = int(intra_op_parallelism)
        self._engine = _pick_backend(
            backend, align_up(self._block_size), self._queue_depth, self._intra_op_parallelism
        )
        self.backend = self._engine.backend
        self._bounce = BounceCache(256 << 20)
        self._lock = threading.Lock()
        self._pending: list[_Op] = []

    # -- getters ----------------------------------------------------------------------------------

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        return ALIGNMENT

    # -- I/O --------------------------------------------------------------------------------------

    def read(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Synchronous read of the whole file (DeepSpeed requires buffer bytes == file size)."""
        size = self._file_size(filename)
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes != size:
            raise swap_error(EINVAL, f"read into a buffer of {nbytes} bytes (file has {size})", filename)
        self._finish(self._submit(False, buffer, filename, file_offset, validate))
        return 0

    def write(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        self._finish(self._submit(True, buffer, filename, file_offset, validate))
        return 0

    def pread(self, buffer, filename, validate, async_op=None, file_offset: int = 0, **kw) -> int:
        return self._queue(False, buffer, filename, validate, self._async_flag(async_op, kw), file_offset)

    def pwrite(self, buffer, filename, validate, async_op=None, file_offset: int = 0, **kw) -> int:
        return self._queue(True, buffer, filename, validate, self._async_flag(async_op, kw), file_offset)

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._queue(False, buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._queue(True, buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._queue(False, buffer, filename, False, True, file_offset)

    def async_pwrite(
        self, buffer: torch.Tensor, filename: Union[str, int], file_offset: int = 0, **kw
    ) -> int:
        """filename may also be an open file descriptor (DeepSpeed's `fd` overload)."""
        target = kw.pop("fd", filename)
        return self._queue(True, buffer, target, False, True, file_offset)

    def wait(self) -> int:
        """Blocks (GIL released) until every queued op finished; returns how many there were."""
        with self._lock:
            ops, self._pending = self._pending, []
        first: Optional[BaseException] = None
        for op in ops:
            try:
                self._finish(op)
            except BaseException as e:  # noqa: BLE001 - re-raised after all ops settled
                first = first or e
        if first is not None:
            raise first
        return len(ops)

    # -- buffers ----------------------------------------------------------------------------------

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return aligned_empty(int(num_elem), dtype=example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        # The memory goes back when the last view of it dies; nothing to unlock by hand.
        return is_managed(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        if is_managed(buffer):
            return True
        try:
            return bool(buffer.is_pinned())
        except RuntimeError:
            return False

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._engine.close()

    # -- internals --------------------------------------------------------------------------------

    @staticmethod
    def _async_flag(async_op, kw) -> bool:
        if "async" in kw:
            async_op = kw.pop("async")
        if kw:
            raise TypeError(f"unexpected arguments {sorted(kw)}")
        if async_op is None:
            raise TypeError("missing argument 'async'")
        return bool(async_op)

    def _queue(self, write, buffer, target, validate, async_op, file_offset) -> int:
        op = self._submit(write, buffer, target, file_offset, validate)
        with self._lock:
            self._pending.append(op)
        return 0 if async_op else self.wait()

    @staticmethod
    def _file_size(path: str) -> int:
        try:
            return os.stat(path).st_size
        except OSError as e:
            raise swap_error(e.errno or EIO, "stat for read", path) from None

    def _submit(self, write: bool, buffer: torch.Tensor, target, file_offset: int, validate: bool) -> _Op:
        path = f"/proc/self/fd/{target}" if isinstance(target, int) else os.fspath(target)
        nbytes = buffer.numel() * buffer.element_size()
        if file_offset < 0:
            raise swap_error(
                EINVAL, f"{'pwrite' if write else 'pread'} (negative file offset)", path, file_offset
            )
        if not write:
            size = self._file_size(path)
            if file_offset + nbytes > size:
                raise swap_error(
                    EINVAL, f"pread of {nbytes} bytes (the file has only {size} bytes)", path, file_offset
                )
        bounce = None
        if is_direct_capable(buffer):
            base = buffer.data_ptr()
        else:
            bounce = self._bounce.acquire(align_up(nbytes))
            if write:
                bounce[:nbytes].view(buffer.dtype).view(buffer.shape).copy_(buffer)
            base = bounce.data_ptr()
        try:
            body = nbytes // ALIGNMENT * ALIGNMENT if file_offset % ALIGNMENT == 0 else 0
            reqs = []
            if body:
                f = _C.File(path, read=not write, write=write, create=write, direct=True)
                reqs.append((write, f, base, body, file_offset, body))
            if nbytes > body:
                f = _C.File(path, read=not write, write=write, create=write, direct=False)
                reqs.append((write, f, base + body, nbytes - body, file_offset + body, nbytes - body))
            if not reqs and write:  # an empty write still creates the file, as DeepSpeed's does
                _C.File(path, read=False, write=True, create=True, direct=False)
            handle = self._engine.submit([[reqs]], write, nbytes)
        except BaseException:
            if bounce is not None:
                self._bounce.release(bounce)
            raise
        return _Op(handle, buffer, bounce, write, path, file_offset, nbytes, validate)

    def _finish(self, op: _Op) -> None:
        try:
            op.handle.wait()
            if op.bounce is not None and not op.write:
                op.buffer.copy_(op.bounce[: op.nbytes].view(op.buffer.dtype).view(op.buffer.shape))
            if op.validate:
                self._validate(op)
        finally:
            if op.bounce is not None:
                self._bounce.release(op.bounce)
                op.bounce = None

    @staticmethod
    def _validate(op: _Op) -> None:
        fd = os.open(op.path, os.O_RDONLY)
        try:
            on_disk = os.pread(fd, op.nbytes, op.offset)
        finally:
            os.close(fd)
        mine = op.buffer.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        if on_disk != mine:
            raise swap_error(
                EIO,
                f"validating {'pwrite' if op.write else 'pread'} (file and buffer differ)",
                op.path,
                op.offset,
            )
