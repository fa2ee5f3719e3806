"""measure_ssd: what a TensorStore's directories deliver, measured the way training uses them.

Note: training overwrites existing keys (about twice as fast as writing fresh files on the
development machine's disk), several puts or gets in flight at once, each about one unit's
array. So: lay out `total_bytes` as keys of `tensor_bytes` first, then time overwriting all of
them (issued together, waited together) and reading all of them back; the median of `repeats`
rounds. The probe keys are removed afterwards.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Callable, Optional

import torch

from .buffers import aligned_empty


def median_time(fn: Callable[[], None], repeats: int) -> float:
    """The median wall time of `repeats` calls of `fn` (every probe of the machine times this way)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ssd(
    store, *, total_bytes: int = 64 << 20, tensor_bytes: Optional[int] = None, repeats: int = 1
) -> tuple[float, float]:
    """(read GB/s, write GB/s) of `store`, overwriting in place (the module Note). tensor_bytes:
    the size of each key (None: one key of total_bytes)."""
    tensor_bytes = tensor_bytes or total_bytes
    count = max(1, total_bytes // tensor_bytes)
    numel = tensor_bytes // 4
    bufs = [aligned_empty(numel, dtype=torch.float32) for _ in range(count)]
    for b in bufs:
        b.fill_(1.0)
    tag = uuid.uuid4().hex[:8]
    keys = [f"__offloadpp_probe_{tag}_{i}" for i in range(count)]

    def write() -> None:
        for f in [store.put(k, b) for k, b in zip(keys, bufs)]:
            f.wait()

    def read() -> None:
        for f in [store.get(k, out=b) for k, b in zip(keys, bufs)]:
            f.wait()

    try:
        write()  # lays the files out: the timed writes overwrite, as training does
        w = median_time(write, repeats)
        r = median_time(read, repeats)
    finally:
        for k in keys:
            if store.contains(k):
                store.delete(k)
    nbytes = count * numel * 4
    return nbytes / r / 1e9, nbytes / w / 1e9
