"""runtime/host_heap.py: on the CPU acting as the device, a step's freed memory leaves the process.

Each case runs in its own interpreter: the heap's settings are process-wide."""

import json
import subprocess
import sys
import threading

import pytest

from offloadpp.runtime import host_heap

SCRIPT = r"""
import ctypes, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("host_heap", sys.argv[2])  # the module alone, not the package
host_heap = importlib.util.module_from_spec(spec); spec.loader.exec_module(host_heap)

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))

set_it = sys.argv[1] == "1"
if set_it:
    assert host_heap.return_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def alloc(n):  # malloc'ed and touched, as torch's CPU allocator does for a tensor
    p = libc.malloc(n); ctypes.memset(p, 1, n); return p

# a freed 16 MiB mapping lifts glibc's own threshold to 16 MiB: what a step's first large free does
libc.free(alloc(16 << 20))
base = rss()
ts = [alloc(4 << 20) for _ in range(200)]  # 4 MiB each, as a step's activations
for i, p in enumerate(ts):
    if i % 50:  # a few outlive the rest, as saved tensors do
        libc.free(p)
print(json.dumps({"retained": rss() - base}))
"""


def _retained(set_it: bool) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if set_it else "0", host_heap.__file__], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])["retained"]


@pytest.mark.skipif(host_heap._glibc() is None, reason="glibc only")
def test_freed_step_memory_leaves_the_process():
    mib = 1 << 20
    assert _retained(False) > 300 * mib  # the heap keeps what it served (the case the module fixes)
    assert _retained(True) < 64 * mib  # each buffer was its own mapping, returned when freed


def test_trim_is_safe_to_call_anywhere():
    """From the main thread and from another one, before and after large frees: it returns, and
    says it trimmed exactly where the C library is glibc."""
    glibc = host_heap._glibc() is not None
    assert host_heap.trim() is glibc
    blocks = [bytearray(1 << 20) for _ in range(8)]
    del blocks
    done = []
    t = threading.Thread(target=lambda: done.append(host_heap.trim()))
    t.start()
    t.join()
    assert done == [glibc]


def test_only_runs_whose_state_crowds_memory_return_the_heap():
    gib = 1 << 30
    assert not host_heap.needed(int(0.7 * gib), 20 * gib)  # GPT-2 45M: glibc's fast path stays
    assert host_heap.needed(21 * gib, 22 * gib)  # GPT-2 1.31B on a 24 GiB machine
