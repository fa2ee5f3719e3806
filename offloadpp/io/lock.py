"""One run per swap directory: a pid-stamped lock file, held with flock(2) for the run's life.

Note: why flock and a pid. Two jobs sharing a swap directory overwrite each other's state and
die later with errors that blame the files. The kernel drops a flock when its holder exits,
however it exits (kill -9 included), so a lock that can be taken belongs to no live process,
whatever the file says; the pid, host, start time and command written into the file are for the
messages: the live holder is named when a second run is refused, and a dead one's lock is taken
over with a warning naming it.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from typing import Optional, Sequence

from .errors import SwapIOError, swap_error

log = logging.getLogger("offloadpp.io")

LOCK_NAME = ".offloadpp.lock"


class SwapDirBusyError(SwapIOError):
    """Another live process holds the swap directory."""


def _describe(info: dict) -> str:
    parts = [f"process {info.get('pid', '?')}"]
    if info.get("host"):
        parts.append(f"on {info['host']}")
    if info.get("started"):
        parts.append(f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info['started']))}")
    if info.get("command"):
        parts.append(f"({info['command'][:120]})")
    return " ".join(parts)


def _read(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
        return json.loads(raw.decode() or "{}")
    except (OSError, ValueError):
        return {}


class SwapDirLock:
    """Holds the lock of every directory in `dirs` until release() (or the process ends)."""

    def __init__(self, dirs: Sequence[str]):
        self.dirs = [os.path.abspath(os.fspath(d)) for d in dirs]
        self._fds: list[tuple[str, int]] = []
        self.taken_over: list[str] = []  # messages about dead holders whose locks were taken
        try:
            for d in self.dirs:
                self._take(d)
        except BaseException:
            self.release()
            raise

    def _take(self, d: str) -> None:
        path = os.path.join(d, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise swap_error(e.errno or _errno.EIO, "opening the swap directory's lock file", path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(fd)
            os.close(fd)
            if e.errno in (_errno.EWOULDBLOCK, _errno.EAGAIN):
                err = SwapDirBusyError(
                    _errno.EBUSY,
                    f"swap directory {d} is in use by {_describe(holder)}: one run per swap directory (two would "
                    "overwrite each other's training state); stop that run or give this one other nvme paths",
                    d,
                )
                raise err from None
            raise swap_error(e.errno or _errno.EIO, "locking the swap directory", path) from None
        old = _read(fd)
        if old.get("pid") and old.get("pid") != os.getpid():
            msg = f"swap directory {d}: took over the lock of {_describe(old)}, which is no longer running"
            log.warning("%s", msg)
            self.taken_over.append(msg)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "command": " ".join(sys.argv)}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fds.append((path, fd))

    def release(self) -> None:
        """Drops every lock (the files stay: removing one could race a process about to lock it)."""
        fds, self._fds = self._fds, []
        for _path, fd in fds:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)  # closing the descriptor drops the flock

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def __enter__(self) -> SwapDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder_of(d: str) -> Optional[dict]:
    """Who holds `d`'s lock now (None: nobody alive)."""
    path = os.path.join(os.path.abspath(d), LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return _read(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
