"""The one exception type of the I/O layer.

Every failure of the engine, the tensor store and the DeepSpeed-compatible handle is a
`SwapIOError`: an `OSError` subclass whose `errno` is set and whose message names the path,
the file offset and the errno, e.g.

    pwrite of 1048576 bytes (libaio) failed on /nvme/unit3.swp at offset 8192:
    No space left on device (errno 28)
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Optional


class SwapIOError(OSError):
    """An I/O failure: `errno`, `filename` (the path) and `offset` (bytes, or None) are set."""

    def __init__(self, *args):
        super().__init__(*args)
        self.offset: Optional[int] = None
        self.op: Optional[str] = None

    def __str__(self) -> str:
        # strerror already carries the full message (path, offset, errno) built where the error
        # happened; OSError's default would repeat the path.
        if self.strerror:
            return self.strerror
        return super().__str__()

    def __reduce__(self):
        return (_rebuild, (self.errno, self.strerror, self.filename, self.offset, self.op))


def _rebuild(err, strerror, filename, offset, op):
    e = SwapIOError(err, strerror, filename)
    e.offset = offset
    e.op = op
    return e


def swap_error(err: int, what: str, path: Optional[str] = None, offset: Optional[int] = None) -> SwapIOError:
    """Builds a SwapIOError with the same message shape as the C++ engine's."""
    msg = f"{what} failed"
    if path:
        msg += f" on {path}"
    if offset is not None:
        msg += f" at offset {offset}"
    if err:
        msg += f": {os.strerror(err)} (errno {err})"
    e = SwapIOError(err, msg, path)
    e.offset = offset
    e.op = what
    return e


# errno values used for format-level problems found by the store (not by a syscall).
EBADMSG = _errno.EBADMSG  # foreign file, corrupted header, checksum mismatch
ESTALE = _errno.ESTALE  # generation mismatch, incomplete (interrupted or failed) write
EIO = _errno.EIO  # truncated file
EINVAL = _errno.EINVAL  # misaligned buffer, wrong size or dtype
