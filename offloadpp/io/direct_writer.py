"""A file written front to back through O_DIRECT, double-buffered: the exports' sink.

Note: why not write() into the page cache. An export writes the model once (9.3 GB for GPT-2
2.3B in fp32) on a machine whose memory it does not fit in: buffered writes fill the page cache
with dirty pages the kernel must write back under memory pressure, throttle the writer, then
the final fsync waits for the rest; on the development machine that ran at 0.3-1.3 GB/s. Here
the bytes are copied into one of two aligned staging buffers; a full buffer goes to the disk
as one O_DIRECT write through the I/O engine (AsyncIOHandle: its 4096-aligned body direct, an
unaligned tail buffered) while the other fills, so the copy, the caller's work (reading and
converting the next unit) and the disk overlap, and no dirty page is left behind. Where the
filesystem refuses O_DIRECT (tmpfs) the same class writes through the page cache.

`write(data)` takes any bytes-like object (a memoryview of a tensor: no copy until staging), so
it serves as the file object of torch's zip writer (PyTorchFileWriter(file)) as well as of the
safetensors writer.
"""

from __future__ import annotations

import errno
import os
from typing import Optional

import numpy as np
import torch

from .aio_handle import AsyncIOHandle
from .buffers import aligned_empty
from .errors import swap_error

CHUNK_BYTES = 64 << 20  # each staging buffer; two of them: 128 MiB while a file is open


def direct_supported(path: str) -> bool:
    """Whether `path` (created, emptied) can be opened with O_DIRECT."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            open(path, "wb").close()
            return False
        raise swap_error(e.errno or errno.EIO, "create", path) from None
    os.close(fd)
    return hasattr(os, "O_DIRECT")


class DirectFileWriter:
    def __init__(self, path: str, chunk_bytes: int = CHUNK_BYTES):
        self.path = path
        self.direct = direct_supported(path)
        self.bytes_written = 0
        self._f = None if self.direct else open(path, "r+b")
        if self.direct:
            self._aio: Optional[AsyncIOHandle] = AsyncIOHandle(block_size=1 << 20, queue_depth=8)
            self._bufs = [aligned_empty(chunk_bytes, torch.uint8) for _ in range(2)]
            self._np = [b.numpy() for b in self._bufs]
            self._i = 0  # the staging buffer being filled
            self._fill = 0
        self._offset = 0  # file offset of the buffer being filled
        self.closed = False

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if self._f is not None:
            self._f.write(mv)
            self.bytes_written += n
            return n
        src = np.frombuffer(mv, dtype=np.uint8)
        pos, cap = 0, len(self._np[0])
        while pos < n:
            k = min(cap - self._fill, n - pos)
            self._np[self._i][self._fill : self._fill + k] = src[pos : pos + k]
            self._fill += k
            pos += k
            if self._fill == cap:
                self._submit()
        self.bytes_written += n
        return n

    def _submit(self) -> None:
        self._aio.wait()  # the other buffer's write is done: it is the one filled next
        if self._fill:
            self._aio.async_pwrite(self._bufs[self._i][: self._fill], self.path, self._offset)
        self._offset += self._fill
        self._i ^= 1
        self._fill = 0

    def flush(self) -> None:
        """(torch's writer calls it; the bytes are on their way either way)"""

    def close(self) -> None:
        """Writes what is staged, waits, and makes the file durable."""
        if self.closed:
            return
        self.closed = True
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            return
        try:
            self._submit()
            self._aio.wait()
        finally:
            self._release()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)  # the buffered tail, and the file's size
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Stops (what was submitted is waited for) and removes the file."""
        if not self.closed:
            self.closed = True
            if self._f is not None:
                self._f.close()
            else:
                try:
                    self._aio.wait()
                except OSError:
                    pass
                self._release()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _release(self) -> None:
        self._aio.close()
        self._aio = None
        self._bufs = self._np = []
