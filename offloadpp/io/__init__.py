"""offloadpp.io: the Python face of the direct-I/O engine.

    from offloadpp.io import TensorStore, IOConfig, SwapIOError, aligned_empty
    store = TensorStore(["/nvme0/swap", "/nvme1/swap"], config=IOConfig())
    store.put("unit3.exp_avg", t).wait()
    t2 = store.get("unit3.exp_avg", out=buf).result()

AsyncIOHandle is a drop-in for DeepSpeed's aio_handle. probe_backends/build_info feed
`offloadpp doctor`. Errors are SwapIOError (an OSError) naming path, offset and errno.
"""

import offloadpp._C as _C

from .aio_handle import AsyncIOHandle
from .buffers import ALIGNMENT, BounceCache, aligned_empty, is_direct_capable, is_managed
from .config import IOConfig
from .engine import (
    BACKENDS,
    BackendProbe,
    build_info,
    crc32c,
    make_engine,
    open_file,
    probe_backends,
    resolve_backend,
)
from .errors import SwapIOError
from .future import IOFuture
from .layout import remove_swap_files
from .lock import SwapDirBusyError, SwapDirLock
from .measure import measure_ssd
from .store import IOStats, TensorStore

if not ALIGNMENT == 4096 == int(_C.ALIGNMENT):
    raise ImportError(
        f"offloadpp._C was built with ALIGNMENT={_C.ALIGNMENT}, offloadpp.io expects 4096: rebuild"
    )

__all__ = [
    "ALIGNMENT",
    "AsyncIOHandle",
    "BACKENDS",
    "BackendProbe",
    "BounceCache",
    "IOConfig",
    "IOFuture",
    "IOStats",
    "SwapDirBusyError",
    "SwapDirLock",
    "SwapIOError",
    "TensorStore",
    "aligned_empty",
    "build_info",
    "crc32c",
    "make_engine",
    "measure_ssd",
    "open_file",
    "is_direct_capable",
    "is_managed",
    "probe_backends",
    "remove_swap_files",
    "resolve_backend",
]
