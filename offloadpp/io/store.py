"""TensorStore: tensors put and got by key, in swap files over one or more directories.

Each key owns one file per directory it is spread over (a "part"): small tensors go whole to
the directory holding the fewest bytes, tensors of at least IOConfig.stripe_min_bytes are cut
into block-aligned parts, one per directory, so a get reads from every SSD at once. Files stay
open and are overwritten in place by the next put of the same key (about twice as fast as
writing a fresh file). See format.py for the file layout and the write order that keeps a
failed put from ever reading as valid, and swap_files.py for the index of keys and their files.

Hot path: an aligned, contiguous CPU tensor goes to disk with no copy; only a tail shorter than
4096 bytes passes through a one-block buffer. Anything else (unaligned, strided, on a GPU)
passes through a reused aligned bounce buffer.

Note: read-only. A checkpoint is read with TensorStore(dirs, create=False, readonly=True): its
files are opened O_RDONLY, put and delete raise EROFS, and AUTO's backend probe (which writes a
file) is not run: the thread pool reads, unless the caller names the backend it already
resolved elsewhere. So a read-only mount or a full disk loads like any other; where the
filesystem refuses O_DIRECT the files are read through the page cache.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import itertools
import os
import threading
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

import offloadpp._C as _C
import offloadpp.io.format as fmt

from .buffers import ALIGNMENT, BounceCache, HeaderBuffers, align_up, aligned_empty, is_direct_capable
from .config import IOConfig
from .engine import make_engine
from .errors import EINVAL, EIO, SwapIOError, swap_error
from .future import DeferredCheck, IOFuture
from .swap_files import SwapFiles, _Entry

# An extension built before its engine checksummed reads and sealed headers (csrc/io/engine.h,
# the checksum Note) takes only 6-field requests: there the calling threads checksum, as they did
# then, rather than every put and get failing until the extension is rebuilt.
_ENGINE_CRC = bool(_C.io_build_info().get("engine_checksums"))
H = fmt.HEADER_BYTES


@dataclass(frozen=True)
class IOStats:
    """Cumulative payload bytes and busy wall time (at least one op outstanding) per direction."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    def __sub__(self, other: IOStats) -> IOStats:
        return IOStats(
            self.bytes_read - other.bytes_read,
            self.bytes_written - other.bytes_written,
            self.read_seconds - other.read_seconds,
            self.write_seconds - other.write_seconds,
        )


def _drain(handles: list) -> None:
    """Waits out already-submitted I/O before its buffers are given back (errors are moot here:
    the caller is raising another one)."""
    for h in handles:
        try:
            h.wait()
        except OSError:
            pass


class TensorStore(SwapFiles):
    """Keyed tensors in swap files over `dirs`. See the module docstring."""

    def __init__(
        self,
        dirs: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
        config: Optional[IOConfig] = None,
        create: bool = True,
        weights: Optional[Sequence[float]] = None,
        readonly: bool = False,
    ):
        """weights: per directory, its share of each striped tensor (e.g. its measured GB/s, so
        that every SSD finishes its part at once); None: equal parts. readonly: the existing
        files are read and nothing is ever written or created in `dirs` (Note: read-only)."""
        if isinstance(dirs, (str, os.PathLike)):
            dirs = [dirs]
        self.dirs = [os.path.abspath(os.fspath(d)) for d in dirs]
        if not self.dirs or len(set(self.dirs)) != len(self.dirs):
            raise swap_error(EINVAL, f"opening a TensorStore over {self.dirs} (need distinct directories)")
        if weights is not None and (len(weights) != len(self.dirs) or not all(w > 0 for w in weights)):
            raise swap_error(EINVAL, f"opening a TensorStore over {self.dirs} with weights {list(weights)} "
                             "(need one weight > 0 per directory)")  # fmt: skip
        self.weights = None if weights is None else [float(w) for w in weights]
        self.config = config if config is not None else IOConfig()
        self.readonly = readonly
        engine_config = self.config
        if readonly and engine_config.backend == "auto":  # AUTO's probe writes a file: not here
            engine_config = engine_config.model_copy(update={"backend": "threadpool"})
        for d in self.dirs:
            if create and not readonly:
                try:
                    os.makedirs(d, exist_ok=True)
                except OSError as e:
                    raise swap_error(e.errno or _errno.EIO, "creating swap directory", d) from None
            elif not os.path.isdir(d):
                raise swap_error(_errno.ENOENT, "opening swap directory", d)
        self._lock = threading.RLock()
        self._clock = _C.BusyClock()
        self._engines: list[_C.Engine] = []
        try:
            for d in self.dirs:
                self._engines.append(make_engine(engine_config, d, self._clock))
        except BaseException:
            for e in self._engines:
                e.close()
            raise
        self.backends = [e.backend for e in self._engines]
        self._headers = HeaderBuffers()
        self._bounce = BounceCache(self.config.bounce_cache_bytes, self.config.pin)
        self._index: dict[str, _Entry] = {}
        self._dir_bytes = [0] * len(self.dirs)
        self._pending: dict[int, IOFuture] = {}
        self._by_kind: dict[tuple[str, bool], int] = {}
        self._since_prune = 0
        self._first_failed: Optional[tuple[str, BaseException]] = None
        self._closed = False
        # files the scan could not index (foreign, corrupted, short, incomplete): path -> why, so
        # that asking for a key one of them held names the file rather than "no such key"
        self._unreadable: dict[str, SwapIOError] = {}
        self._gen = itertools.count(self._scan() + 1)

    # -- public API ---------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, kind: str = "other", crc: Optional[int] = None) -> IOFuture:
        """Starts writing `tensor` under `key`; it must stay alive and unchanged until the future
        completes. A put to a key waits for that key's in-flight operations first. kind: what the
        bytes are, for bytes_by_kind (the runtime's tags: planner/traffic.py). crc: the payload's
        CRC-32C, computed by the caller in a pass it made anyway (the fused Adam's): the header
        is sealed with it instead of a pass of the store's (a key stored in one part; a striped
        key's parts each need their own, and are checksummed as without)."""
        self._check_open()
        self._check_writable(f"put({key!r})")
        self._check_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({key!r}, ...) needs a torch.Tensor, got {type(tensor).__name__}")
        t = tensor.detach()
        dname = fmt.dtype_name(t.dtype)
        nbytes = t.numel() * t.element_size()
        self._wait_key(key, writes_only=False)
        self._count(kind, True, nbytes)
        with self._lock:
            prev = self._index.get(key)
            entry = self._place(key, dname, tuple(t.shape), nbytes)
            entry.generation = next(self._gen)
            parts = list(entry.parts)
        held: list = []  # buffers to give back when the future settles
        handles: list = []
        bounce: Optional[torch.Tensor] = None
        try:
            if is_direct_capable(t):
                src, bounce = t.data_ptr(), None
            else:
                bounce = self._bounce.acquire(align_up(nbytes))
                bounce[:nbytes].view(t.dtype).view(t.shape).copy_(t)
                src = bounce.data_ptr()
            chains: dict[int, list] = {}
            for p in parts:
                f = self._file(p, create=True)
                need = H + align_up(p.nbytes)
                size = f.size()
                if size < need:
                    f.allocate(need)  # ENOSPC here, before any byte of the old file is touched
                elif size > need:
                    f.truncate(need)
                # with the engine's verifier, it fills the CRC into the final header (engine.h)
                given = crc is not None and len(parts) == 1
                seal = self.config.checksum and _ENGINE_CRC and not given
                checksum = 0
                if given:
                    checksum = crc
                elif self.config.checksum and not seal:
                    checksum = _C.crc32c(src + p.offset, p.nbytes)
                stages = []
                if size > 0:  # an old header may read as valid: mark it incomplete first
                    stages.append([self._header_req(entry.header(p, complete=False), f, held, write=True)])
                payload = []
                if bounce is not None:
                    payload.append((True, f, src + p.offset, align_up(p.nbytes), H, 0))
                else:
                    body = p.nbytes // ALIGNMENT * ALIGNMENT
                    if body:
                        payload.append((True, f, src + p.offset, body, H, 0))
                    if p.nbytes > body:
                        tail = self._headers.acquire()
                        held.append(tail)
                        ctypes.memmove(tail.ptr, src + p.offset + body, p.nbytes - body)
                        ctypes.memset(tail.ptr + p.nbytes - body, 0, ALIGNMENT - (p.nbytes - body))
                        payload.append((True, f, tail.ptr, ALIGNMENT, H + body, 0))
                if payload:
                    stages.append(payload)
                final = entry.header(p, complete=True, checksum=checksum, has_checksum=self.config.checksum)
                req = self._header_req(final, f, held, write=True)
                if seal:
                    req += (0, src + p.offset, p.nbytes, fmt.CHECKSUM_AT)
                stages.append([req])
                chains.setdefault(p.dir_index, []).append((p.nbytes, stages))
            for d, cs in chains.items():
                handles.append(self._engines[d].submit([s for _, s in cs], True, sum(n for n, _ in cs)))
        except BaseException:
            _drain(handles)
            self._give_back(held, bounce)
            if entry is not prev:  # nothing was submitted: forget the new layout and its files
                with self._lock:
                    if self._index.get(key) is entry:
                        del self._index[key]
                        self._drop_files(entry)
            raise
        release = lambda: self._give_back(held, bounce)  # noqa: E731
        return self._track(
            entry, IOFuture("put", key, nbytes, handles, None, release, nbytes, self._retire), t
        )

    def get(
        self, key: str, out: Optional[torch.Tensor] = None, kind: str = "other", defer_check: bool = False
    ) -> IOFuture:
        """Starts reading `key` into `out` (same dtype and numel as stored; None allocates an
        aligned tensor of the stored shape). result() returns the tensor. kind: as for put.
        defer_check: the payload's CRC-32C is not checked by the store; the future's `check` (a
        DeferredCheck, future.py) carries the header CRCs to whoever uses the bytes first, who
        must claim and settle it, or verify it, before using them (the fused Adam: docs/io.md)."""
        self._check_open()
        with self._lock:
            if key not in self._index:
                why = self.why_missing(key)
                if why is not None:
                    raise why
                raise KeyError(key)
        self._wait_key(key, writes_only=True)
        with self._lock:
            entry = self._index[key]
            failed = entry.failed
        if failed is not None:
            raise self._write_failed(key, failed)
        with self._lock:
            snap = _Entry(
                entry.key, entry.dtype, entry.shape, entry.nbytes, entry.generation, list(entry.parts)
            )
        dtype = fmt.dtype_from_name(snap.dtype)
        numel = snap.nbytes // dtype.itemsize
        self._count(kind, False, snap.nbytes)
        if out is None:
            out = aligned_empty(snap.shape, dtype, self.config.pin)
        elif not isinstance(out, torch.Tensor):
            raise TypeError(f"get({key!r}, out=...) needs a torch.Tensor, got {type(out).__name__}")
        elif out.dtype != dtype or out.numel() != numel:
            raise swap_error(
                EINVAL,
                f"get({key!r}) into a {out.dtype} tensor of {out.numel()} elements "
                f"(stored: {dtype} x {numel}, shape {list(snap.shape)})",
            )
        held: list = []
        handles: list = []
        bounce = None
        try:
            direct = is_direct_capable(out)
            if direct:
                dst = out.data_ptr()
            else:
                bounce = self._bounce.acquire(align_up(snap.nbytes))
                dst = bounce.data_ptr()
            chains: dict[int, list] = {}
            checks = []  # (part, header buffer, tail buffer or None, body bytes, engine CRC or None)
            crcs: dict[int, int] = {}  # directory -> reads of its handle the engine checksums
            check = DeferredCheck(key) if defer_check and self.config.checksum else None
            verify = self.config.checksum and _ENGINE_CRC and check is None
            for p in snap.parts:
                f = self._file(p, create=False)
                need = H + align_up(p.nbytes)
                size = f.size()
                if size < need:
                    raise swap_error(
                        EIO,
                        f"reading key {key!r} (truncated file: {size} bytes, expected {need})",
                        p.path,
                        size,
                    )
                hb = self._headers.acquire()
                held.append(hb)
                reqs = [(False, f, hb.ptr, H, 0, H)]
                tail, body = None, p.nbytes
                # the engine's verifier thread checksums the payload as it lands (engine.h, the
                # checksum Note): the thread that waits only compares, and checksums a tail
                crc_bytes = 0
                if direct:
                    body = p.nbytes // ALIGNMENT * ALIGNMENT
                    if body:
                        crc_bytes = body if verify else 0
                        reqs.append(
                            (False, f, dst + p.offset, body, H, body) + ((crc_bytes,) if crc_bytes else ())
                        )
                    if p.nbytes > body:
                        tail = self._headers.acquire()
                        held.append(tail)
                        reqs.append((False, f, tail.ptr, ALIGNMENT, H + body, ALIGNMENT))
                elif p.nbytes:
                    n = align_up(p.nbytes)
                    crc_bytes = p.nbytes if verify else 0
                    reqs.append((False, f, dst + p.offset, n, H, n) + ((crc_bytes,) if crc_bytes else ()))
                slot = None
                if crc_bytes:  # (directory, index among its handle's CRCs, bytes covered)
                    slot = (p.dir_index, crcs.get(p.dir_index, 0), crc_bytes)
                    crcs[p.dir_index] = slot[1] + 1
                checks.append((p, hb, tail, body, slot))
                chains.setdefault(p.dir_index, []).append((p.nbytes, [reqs]))
            by_dir = {}
            for d, cs in chains.items():
                by_dir[d] = len(handles)
                handles.append(self._engines[d].submit([s for _, s in cs], False, sum(n for n, _ in cs)))
        except BaseException:
            _drain(handles)
            self._give_back(held, bounce)
            raise

        def finish() -> None:
            for p, hb, tail, body, _ in checks:
                fmt.check(fmt.unpack(memoryview(hb), p.path), snap.header(p), p.path)
                if tail is not None:
                    ctypes.memmove(dst + p.offset + body, tail.ptr, p.nbytes - body)
            left = checks
            if check is not None:
                heads = [(p, fmt.unpack(memoryview(hb), p.path)) for p, hb, _, _, _ in checks]
                if all(h.has_checksum for _, h in heads):  # left to the user of the bytes
                    check.parts = [(p.path, p.offset, p.nbytes, h.checksum) for p, h in heads]
                    left = []
                else:  # a part written without one: no CRC for the whole, the others checked here
                    check.nothing_left()
            for p, hb, _, _, slot in left:
                h = fmt.unpack(memoryview(hb), p.path)
                if not h.has_checksum:
                    continue
                crc, done = 0, 0
                if slot is not None:  # computed by the engine: only the tail is left
                    d, i, done = slot
                    crc = handles[by_dir[d]].crcs[i]
                if p.nbytes > done:
                    crc = _C.crc32c(dst + p.offset + done, p.nbytes - done, crc)
                if crc != h.checksum:
                    raise swap_error(
                        fmt.EBADMSG, f"reading key {key!r} (payload checksum mismatch)", p.path, H
                    )
            if bounce is not None:
                out.copy_(bounce[: snap.nbytes].view(dtype).view(out.shape))

        release = lambda: self._give_back(held, bounce)  # noqa: E731
        fut = IOFuture("get", key, snap.nbytes, handles, finish, release, out, self._retire)
        fut.check = check
        with self._lock:
            live = self._index.get(key)
        return self._track(live if live is not None else snap, fut, out)

    def sync(self) -> None:
        """Waits for every put, then makes every file of the store durable (fdatasync) and
        the directories' entries too (fsync): what a checkpoint needs before it is named."""
        self.wait_all()
        with self._lock:
            parts = [p for e in self._index.values() for p in e.parts]
        for p in parts:
            self._file(p, create=False).sync()
        from .durable import fsync_dir

        for d in self.dirs:
            fsync_dir(d)

    def check_writes(self) -> None:
        """Raises the error of the first put that failed (without waiting for any): the place a
        failed write reports its own cause (a read-only or full disk, an I/O error), not a later
        read of what it left behind."""
        with self._lock:
            done = [f for f in self._pending.values() if f.kind == "put" and f.done()]
        for f in done:
            f._wait_quiet()  # settles it: _retire records a failure
        with self._lock:
            first = self._first_failed
        if first is not None:
            raise self._write_failed(*first)

    @staticmethod
    def _write_failed(key: str, cause: BaseException) -> SwapIOError:
        err = getattr(cause, "errno", None) or EIO
        e = SwapIOError(err, f"writing key {key!r} failed earlier, so its swap file holds no valid copy: {cause}",
                        getattr(cause, "filename", None))  # fmt: skip
        e.__cause__ = cause
        return e

    def delete(self, key: str) -> None:
        """Waits for the key's in-flight operations, then removes its files."""
        self._check_open()
        self._check_writable(f"delete({key!r})")
        with self._lock:
            if key not in self._index:
                raise KeyError(key)
        self._wait_key(key, writes_only=False)
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._drop_files(entry)

    def wait_all(self) -> None:
        """Waits for every outstanding put and get; raises the first error after all finished."""
        with self._lock:
            futures = list(self._pending.values())
        first: Optional[BaseException] = None
        for f in futures:
            try:
                f.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first

    def forget_failures(self) -> list[BaseException]:
        """Waits for every outstanding operation and forgets those that failed (their errors are
        returned: the caller reported them, e.g. an aborted step whose writes are discarded)."""
        with self._lock:
            futures = list(self._pending.values())
        errors = []
        for f in futures:
            try:
                f.wait()
            except BaseException as e:  # noqa: BLE001 - returned
                errors.append(e)
            with self._lock:
                self._pending.pop(id(f), None)
        with self._lock:
            self._first_failed = None
        return errors

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._closed = True
            for e in self._engines:
                e.close()
            with self._lock:
                # closed here, not when the last reference goes (a future or a caller may keep
                # one): close() must leave no descriptor open
                for entry in self._index.values():
                    for p in entry.parts:
                        if p.file is not None and not p.file.closed:
                            p.file.close()
                        p.file = None
            self._bounce.clear()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tagged(self, kind: str):
        """This store, its puts and gets counted as `kind` (bytes_by_kind): a TaggedStore."""
        from .tagged import TaggedStore

        return TaggedStore(self, kind)

    def bytes_by_kind(self) -> dict[tuple[str, bool], int]:
        """Payload bytes asked of put (True) and get (False) so far, per kind tag; counted at the
        call, so a step's count includes its writes still in flight."""
        with self._lock:
            return dict(self._by_kind)

    def _count(self, kind: str, write: bool, nbytes: int) -> None:
        with self._lock:
            self._by_kind[(kind, write)] = self._by_kind.get((kind, write), 0) + nbytes

    @property
    def stats(self) -> IOStats:
        r = w = 0
        for e in self._engines:
            s = e.stats()
            r += s["bytes_read"]
            w += s["bytes_written"]
        return IOStats(r, w, self._clock.read_seconds, self._clock.write_seconds)

    def __repr__(self) -> str:
        return f"<TensorStore {len(self)} keys over {self.dirs} via {self.backends}>"

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise swap_error(_errno.EBADF, "using a closed TensorStore", ", ".join(self.dirs))

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key or len(key.encode()) > fmt.MAX_KEY_BYTES:
            raise swap_error(
                EINVAL, f"put with key {key!r} (need a non-empty str of at most 1024 UTF-8 bytes)"
            )

    def _check_writable(self, what: str) -> None:
        if self.readonly:
            raise swap_error(_errno.EROFS, f"{what} on a store opened read-only", self.dirs[0])

    def _header_req(self, header: fmt.Header, f: _C.File, held: list, write: bool) -> tuple:
        hb = self._headers.acquire()
        held.append(hb)
        header.pack_into(memoryview(hb))
        return (write, f, hb.ptr, H, 0, 0)

    def _give_back(self, held: list, bounce: Optional[torch.Tensor]) -> None:
        for b in held:
            self._headers.release(b)
        held.clear()
        if bounce is not None:
            self._bounce.release(bounce)

    def _track(self, entry: _Entry, fut: IOFuture, tensor: torch.Tensor) -> IOFuture:
        fut.keepalive = tensor  # the kernel reads/writes its memory until the future settles
        with self._lock:
            self._pending[id(fut)] = fut
            entry.pending.append(fut)
            # Every 32 submissions, settle finished puts nobody waits for (their buffers return to
            # the pools). Failed ones stay, so that wait_all/close still report them.
            self._since_prune += 1
            done = []
            if self._since_prune >= 32:
                self._since_prune = 0
                done = [f for f in self._pending.values() if f.kind == "put" and f.done() and not f.failed()]
        for f in done:
            if f is not fut:
                f._wait_quiet()
        return fut

    def _retire(self, fut: IOFuture) -> None:
        with self._lock:
            self._pending.pop(id(fut), None)
            entry = self._index.get(fut.key)
            if entry is not None and fut in entry.pending:
                entry.pending.remove(fut)
            if fut.kind == "put" and entry is not None:
                entry.failed = fut._error  # a later put that succeeds clears it
                if fut._error is not None and self._first_failed is None:
                    self._first_failed = (fut.key, fut._error)

    def _wait_key(self, key: str, writes_only: bool) -> None:
        with self._lock:
            entry = self._index.get(key)
            futs = [f for f in entry.pending if not writes_only or f.kind == "put"] if entry else []
        for f in futs:
            f._wait_quiet()
