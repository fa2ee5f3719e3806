"""Backend selection and probing: which backends are built, which work in a directory, AUTO."""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import Optional

import offloadpp._C as _C

from .config import IOConfig
from .errors import SwapIOError, swap_error

# AUTO's order of preference: libaio is the default, io_uring next, the thread pool always works.
BACKENDS = ("libaio", "io_uring", "threadpool")


@dataclass(frozen=True)
class BackendProbe:
    """Result of a real write + read-back through one backend in one directory."""

    name: str
    available: bool  # compiled in
    works: bool
    detail: str  # what happened, e.g. the errno when O_DIRECT is refused
    errno: int = 0


def build_info() -> dict:
    """Which backends are compiled in ("backends": name -> bool, also as top-level keys), the
    O_DIRECT alignment, and whether CRC-32C uses the CPU instruction."""
    info = dict(_C.io_build_info())
    info["backends"] = {name: bool(info[name]) for name in BACKENDS}
    info["extension"] = _C.__file__
    return info


def crc32c(ptr: int, nbytes: int) -> int:
    """CRC-32C of `nbytes` at address `ptr` (the CPU instruction where there is one), as the
    store checksums payloads; callers keep the memory alive for the call."""
    return int(_C.crc32c(ptr, nbytes))


def open_file(path: str, *, direct: bool = True, create: bool = True):
    """A raw read-write file of the native engine (benchmarks that bypass the TensorStore)."""
    return _C.File(os.fspath(path), read=True, write=True, create=create, direct=direct)


def probe_backends(directory: str, o_direct: bool = True) -> list[BackendProbe]:
    """Probes every backend in `directory` (which must exist) with a 256 KiB O_DIRECT round trip."""
    directory = os.fspath(directory)
    out = []
    for name in BACKENDS:
        n, compiled, works, err, detail = _C.probe_backend(name, directory, o_direct)
        out.append(
            BackendProbe(name=n, available=bool(compiled), works=bool(works), detail=detail, errno=err)
        )
    return out


_auto_cache: dict[tuple, str] = {}
_auto_lock = threading.Lock()


def resolve_backend(config: IOConfig, directory: str) -> str:
    """The concrete backend for `directory`: the configured one, or AUTO's probe winner.

    AUTO raises SwapIOError (errno of the first failure) when no backend works, e.g. a missing
    directory or a filesystem that refuses O_DIRECT; it never silently drops O_DIRECT.
    """
    if config.backend != "auto":
        return config.backend
    try:
        dev = os.stat(directory).st_dev
    except OSError as e:
        raise swap_error(e.errno or 0, "probing I/O backends", directory) from None
    key = (dev, config.o_direct)
    with _auto_lock:
        if key in _auto_cache:
            return _auto_cache[key]
    probes = probe_backends(directory, config.o_direct)
    for p in probes:
        if p.works:
            with _auto_lock:
                _auto_cache[key] = p.name
            return p.name
    first = next((p for p in probes if p.available), probes[0])
    detail = "; ".join(f"{p.name}: {p.detail}" for p in probes)
    # only a refused O_DIRECT (EINVAL at open) is helped by dropping it; a full or read-only disk is not
    hint = (
        " (set IOConfig(o_direct=False) for filesystems without O_DIRECT)"
        if config.o_direct and first.errno == errno.EINVAL
        else ""
    )
    raise swap_error(first.errno, f"every I/O backend ({detail}){hint}", directory)


def make_engine(config: IOConfig, directory: str, clock: Optional[object] = None) -> _C.Engine:
    """A native engine with `config`'s backend (AUTO probed in `directory`), block size, queue
    depth and threads: submit reads and writes of raw addresses to files from open_file()."""
    backend = resolve_backend(config, directory)
    return _C.Engine(backend, config.block_size_bytes, config.queue_depth, config.num_threads, clock)


__all__ = [
    "BACKENDS",
    "BackendProbe",
    "SwapIOError",
    "build_info",
    "crc32c",
    "make_engine",
    "open_file",
    "probe_backends",
    "resolve_backend",
]
