"""The process heap when the CPU acts as the device: freed step memory goes back to the OS.

Note: why. glibc serves an allocation above its mmap threshold with its own mapping, returned
to the OS when freed, and everything smaller from the heap, which it keeps. The threshold starts
at 128 KiB but rises to the size of each mapping freed, up to 32 MiB, so after the first large
free every activation and gradient temporary of a step (1-32 MiB for GPT-2 at width 2048-2560)
comes from the heap; freed in another order than it was taken, it stays resident, fragmented.
Measured through `offloadpp bench capacity` on GPT-2 2.3B: 0.7 GiB of RSS above the engine's
accounted budgets in the first step, more after. On the CPU acting as the device that memory is
the device's: the engine fixes the threshold at MMAP_THRESHOLD (which also stops its rising)
and hands the heap's free tail back at the end of each step (malloc_trim). Elsewhere (CUDA:
the step's tensors live on the GPU) nothing is changed. Other C libraries: nothing is done.

Note: only where memory is the problem. Every allocation above the threshold is then its own
mapping, faulted in and zeroed by the kernel each time: on GPT-2 45M (0.7 GB of training state)
that slowed the whole process by about 4% a step, torch's own GEMMs included. So the engine
applies it only where the training state (16 B/param) passes NEEDED_SHARE of the memory
available when it starts (`needed`): a model that fits with room to spare keeps glibc's fast
path, one larger than memory keeps its RSS at its budgets.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from typing import Optional

MMAP_THRESHOLD = 1 << 20
NEEDED_SHARE = 0.25
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


@functools.lru_cache(maxsize=1)
def _glibc() -> Optional[ctypes.CDLL]:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def needed(state_bytes: int, available_bytes: int) -> bool:
    """Whether a run whose training state is `state_bytes` needs the heap returned (the Note)."""
    return state_bytes > NEEDED_SHARE * available_bytes


def return_freed_memory() -> bool:
    """Large frees go back to the OS from now on (the module Note). True where it was set."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)


def trim() -> bool:
    """Hand the heap's free memory back to the OS (a no-op beyond glibc). True where it was done."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
