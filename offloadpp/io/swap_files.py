"""A TensorStore's index of its keys and the swap files that hold them (`SwapFiles`, the half of
store.py's TensorStore that knows the files, not the I/O): each key's entry and its parts, where
a new key's files go (layout.py stripes them), opening them, the complete keys the directories
hold when a store opens (`_scan`), and why a key asked for is missing.

Everything here runs under the store's lock, or takes it; the requests that read and write the
files are store.py's."""

from __future__ import annotations

import errno as _errno
import os
from dataclasses import dataclass, field
from typing import Optional

import offloadpp._C as _C
import offloadpp.io.format as fmt

from .errors import EINVAL, EIO, ESTALE, SwapIOError, swap_error
from .future import IOFuture
from .layout import SUFFIX, _file_stem, _stripe

H = fmt.HEADER_BYTES


@dataclass
class _Part:
    index: int
    dir_index: int
    path: str
    offset: int  # byte offset of this part inside the tensor
    nbytes: int
    file: Optional[_C.File] = None


@dataclass
class _Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    generation: int
    parts: list[_Part]
    pending: list[IOFuture] = field(default_factory=list)
    failed: Optional[BaseException] = None  # the error of the key's last put, if it failed

    def header(self, p: _Part, **kw) -> fmt.Header:
        return fmt.Header(
            key=self.key,
            dtype=self.dtype,
            shape=self.shape,
            generation=self.generation,
            total_nbytes=self.nbytes,
            part_offset=p.offset,
            part_nbytes=p.nbytes,
            part_index=p.index,
            part_count=len(self.parts),
            **kw,
        )


class SwapFiles:
    """The index and the files of a TensorStore (a mixin: TensorStore sets `dirs`, `config`,
    `readonly`, `weights`, `_lock`, `_index`, `_dir_bytes` and `_unreadable`)."""

    def file_sizes(self) -> dict[str, int]:
        """{path: bytes} of every file of the store."""
        with self._lock:
            paths = [p.path for e in self._index.values() for p in e.parts]
        return {path: os.stat(path).st_size for path in paths}

    def why_missing(self, key: str) -> Optional[SwapIOError]:
        """Why `key` is not in the store, where a cause is on disk: a file of the key's name the
        scan found unreadable (its header corrupted, say), or a swap directory removed while the
        store used it. None: the key was simply never stored."""
        stem = _file_stem(key) + "."
        gone = self._removed_dir(os.path.join(self.dirs[0], f"{stem}0{SUFFIX}"))
        if gone is not None:
            return gone
        for path, err in self._unreadable.items():
            if os.path.basename(path).startswith(stem):
                return err
        return None

    def _removed_dir(self, path: str) -> Optional[SwapIOError]:
        """The error for `path`, a swap file, when one of the store's directories is gone."""
        for d in self.dirs:
            if not os.path.isdir(d):
                e = SwapIOError(
                    _errno.ENOENT,
                    f"swap directory {d!r} was removed while this run used it (missing swap file {path!r}): the "
                    "training state in it is lost; restart from a checkpoint (errno 2)",
                    path,
                )
                e.op = "opening a swap file"
                return e
        return None

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    __contains__ = contains

    def nbytes(self, key: str) -> int:
        with self._lock:
            return self._index[key].nbytes

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def disk_bytes(self) -> int:
        """Bytes the store's files occupy (their sizes: headers, payloads, padding)."""
        total = 0
        with self._lock:
            paths = [p.path for e in self._index.values() for p in e.parts]
        for path in paths:
            try:
                total += os.stat(path).st_size
            except FileNotFoundError:
                pass
        return total

    def _place(self, key: str, dname: str, shape: tuple[int, ...], nbytes: int) -> _Entry:
        """The key's entry with a layout for `nbytes` (kept when the size is unchanged)."""
        entry = self._index.get(key)
        if entry is not None and entry.nbytes == nbytes:
            entry.dtype, entry.shape = dname, shape
            return entry
        if entry is not None:
            self._drop_files(entry)
        n = len(self.dirs)
        start = min(range(n), key=lambda i: self._dir_bytes[i])
        stem = _file_stem(key)
        parts: list[_Part] = []
        if n > 1 and nbytes >= max(self.config.stripe_min_bytes, 1):
            block = self.config.block_size_bytes
            for i, (d, off, size) in enumerate(_stripe(nbytes, n, start, block, self.weights)):
                parts.append(_Part(i, d, os.path.join(self.dirs[d], f"{stem}.{i}{SUFFIX}"), off, size))
        else:
            parts.append(_Part(0, start, os.path.join(self.dirs[start], f"{stem}.0{SUFFIX}"), 0, nbytes))
        for p in parts:
            self._dir_bytes[p.dir_index] += p.nbytes
        entry = _Entry(key, dname, shape, nbytes, 0, parts, entry.pending if entry else [])
        self._index[key] = entry
        return entry

    def _drop_files(self, entry: _Entry) -> None:
        for p in entry.parts:
            self._dir_bytes[p.dir_index] -= p.nbytes
            p.file = None
            try:
                os.unlink(p.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise swap_error(e.errno or EIO, "removing swap file", p.path) from None

    def _file(self, p: _Part, create: bool) -> _C.File:
        f = p.file
        if f is None or f.closed:
            try:
                if self.readonly:
                    f = self._open_read(p.path)
                else:
                    f = _C.File(p.path, read=True, write=True, create=create, direct=self.config.o_direct)
            except OSError as e:
                gone = self._removed_dir(p.path) if e.errno == _errno.ENOENT else None
                if gone is not None:
                    raise gone from None
                raise
            p.file = f
        return f

    def _open_read(self, path: str) -> _C.File:
        """A file opened for reading only; on a filesystem that refuses O_DIRECT (tmpfs, some
        network mounts) a read-only store reads it through the page cache instead."""
        try:
            return _C.File(path, read=True, write=False, create=False, direct=self.config.o_direct)
        except SwapIOError as e:
            if not (self.readonly and self.config.o_direct and e.errno == EINVAL):
                raise
        return _C.File(path, read=True, write=False, create=False, direct=False)

    def _scan(self) -> int:
        """Indexes complete keys found in the directories; returns the highest generation seen."""
        found: dict[str, list[tuple[fmt.Header, str, int]]] = {}
        hb = _C.AlignedBuffer(H)
        for d_index, d in enumerate(self.dirs):
            for name in sorted(os.listdir(d)):
                if not name.endswith(SUFFIX):
                    continue
                path = os.path.join(d, name)
                try:
                    f = self._open_read(path)
                    f.pread_into(hb.ptr, H, 0)
                    h = fmt.unpack(memoryview(hb), path)
                except SwapIOError as e:
                    self._unreadable[path] = e  # foreign, corrupted or short: reported if asked for
                    continue
                if h.complete:
                    found.setdefault(h.key, []).append((h, path, d_index))
                else:
                    self._unreadable[path] = swap_error(
                        ESTALE,
                        f"reading key {h.key!r} (incomplete file: a put failed or was interrupted)",
                        path,
                        0,
                    )
        top = 0
        for key, items in found.items():
            h0 = items[0][0]
            items.sort(key=lambda x: x[0].part_index)
            ok = len(items) == h0.part_count and all(
                h.generation == h0.generation and h.total_nbytes == h0.total_nbytes and h.part_index == i
                for i, (h, _, _) in enumerate(items)
            )
            if not ok:
                continue
            parts = [_Part(h.part_index, di, path, h.part_offset, h.part_nbytes) for h, path, di in items]
            for p in parts:
                self._dir_bytes[p.dir_index] += p.nbytes
            self._index[key] = _Entry(key, h0.dtype, h0.shape, h0.total_nbytes, h0.generation, parts)
            top = max(top, h0.generation)
        return top
