"""Writing so that a crash never leaves a half-written file or folder in place of a good one.

write_atomic(path, data)        temporary name, fsync, rename, fsync of the directory
fsync_dir(path)                 a directory's entries (new names, renames) made durable
swap_into_place(new, final)     a finished folder replaces `final`; the old one stays valid
                                until the new one is in place (renameat2 RENAME_EXCHANGE)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import os
import shutil
import uuid
from typing import Optional

from .errors import swap_error

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc: Optional[ctypes.CDLL] = None


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        raise swap_error(e.errno or _errno.EIO, "fsync of directory", path) from None
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        raise swap_error(e.errno or _errno.EIO, "fsync", path) from None
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """`path` holds `data` or what it held before, never a mix, whatever happens meanwhile."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise swap_error(e.errno or _errno.EIO, "writing", path) from None
    fsync_dir(d)


def _exchange(a: str, b: str) -> bool:
    """Atomically swaps the names a and b (Linux renameat2); False where it is not available."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (_errno.EINVAL, _errno.ENOSYS, _errno.EOPNOTSUPP):
        return False  # the filesystem cannot exchange: fall back to two renames
    raise swap_error(err, f"exchanging {a!r} and", b)


def swap_into_place(new: str, final: str) -> None:
    """Moves the finished folder `new` to `final`. If `final` exists it stays valid until `new`
    is in place: the two are exchanged atomically (or, where the filesystem cannot, `final` is
    renamed aside first and recover_aside() puts it back after a crash in between); the old
    one is removed after."""
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.exists(final):
        os.rename(new, final)
        fsync_dir(parent)
        return
    if _exchange(new, final):
        fsync_dir(parent)
        shutil.rmtree(new, ignore_errors=True)  # `new` now names the old folder
        return
    aside = aside_name(final)
    os.rename(final, aside)
    os.rename(new, final)
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


def aside_name(final: str) -> str:
    head, tail = os.path.split(os.path.abspath(final))
    return os.path.join(head, f".{tail}.old")


def recover_aside(final: str) -> None:
    """After a crash between the two renames of swap_into_place: the old folder back in place."""
    aside = aside_name(final)
    if os.path.isdir(aside) and not os.path.exists(final):
        os.rename(aside, final)
        fsync_dir(os.path.dirname(os.path.abspath(final)))
