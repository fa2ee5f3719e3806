"""Measuring the machine: SSD, copies, device FLOP/s, CPU Adam, contention, memory -> HardwareProfile.

Everything goes through the code the runtime uses (the TensorStore and its engine, overwriting
keys in place; adam_step_flat; torch matmuls on the model's GEMM shapes), so the numbers are the
ones a step sees. `profile_hardware()` takes well under a minute at the defaults.

Note: SSD numbers are offloadpp.io.measure_ssd's (overwriting keys in place, as training does),
each directory alone, then all at once: a store over every directory striping each tensor by the
directories' own rates, as the runtime's store does with a plan from this profile. That aggregate
is what the cost model charges; the drives' sum only bounds it (the PCIe root, the CPU and memory
cap it well below on a machine with many drives).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

from offloadpp.io.measure import median_time as _median_time
from offloadpp.planner.hardware import HardwareProfile, IOPoint, SsdProfile
from offloadpp.runtime.accel.cuda import available as cuda_available
from offloadpp.runtime.accel.cuda import device_names

from .visits import measure_visit_overhead

DEFAULT_GEMMS = ((256, 1024, 3072), (256, 1024, 1024), (256, 1024, 4096), (256, 4096, 1024))
IO_GRID = ((256 << 10, 8), (1 << 20, 4), (1 << 20, 8), (1 << 20, 16), (4 << 20, 4), (4 << 20, 8))


@contextlib.contextmanager
def _scratch_store(dirs: Sequence[str], config=None, weights=None) -> Iterator:
    """A TensorStore over a fresh hidden sub-directory of each of `dirs` (striping by `weights`),
    removed afterwards (the probes below write hundreds of MB there)."""
    from offloadpp.io import TensorStore

    sub = [os.path.join(d, f".offloadpp-profile-{uuid.uuid4().hex[:8]}") for d in dirs]
    try:
        with TensorStore(sub, config=config, create=True, weights=weights) as store:
            yield store
    finally:
        for d in sub:
            shutil.rmtree(d, ignore_errors=True)


def measure_dirs(
    dirs: Sequence[str],
    *,
    block_size_bytes: int = 1 << 20,
    queue_depth: int = 8,
    tensor_bytes: int = 16 << 20,
    total_bytes: int = 256 << 20,
    repeats: int = 3,
    weights: Optional[Sequence[float]] = None,
) -> tuple[float, float]:
    """(read GB/s, write GB/s) of a scratch TensorStore over `dirs` (io.measure_ssd), striping
    by `weights` (None: evenly)."""
    from offloadpp.io import IOConfig
    from offloadpp.io import measure_ssd as measure_store

    cfg = IOConfig(block_size_bytes=block_size_bytes, queue_depth=queue_depth)
    with _scratch_store(dirs, cfg, weights) as store:
        return measure_store(store, total_bytes=total_bytes, tensor_bytes=tensor_bytes, repeats=repeats)


@dataclass(frozen=True)
class Busy:
    """What keeps the CPU busy beside a probe (_Spinner): matmuls of these shapes, and the fused
    Adam on `adam_threads` threads (0: none)."""

    gemms: Sequence[tuple[int, int, int]] = DEFAULT_GEMMS
    adam_threads: int = 0


class _Spinner:
    """While the block runs: matmuls on a background thread (torch's intra-op threads), and with
    `adam_threads` the fused Adam on another, as a training step keeps the CPU busy."""

    def __init__(self, gemms: Sequence[tuple[int, int, int]], adam_threads: int = 0):
        import torch

        self.ops = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in gemms]
        self.adam_threads = adam_threads
        self.bufs = [torch.full((1 << 20,), 0.01) for _ in range(4)] if adam_threads else []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._mm, daemon=True)]
        if adam_threads:
            self.threads.append(threading.Thread(target=self._adam, daemon=True))

    def _mm(self) -> None:
        import torch

        while not self.stop.is_set():
            for a, b in self.ops:
                torch.mm(a, b)

    def _adam(self) -> None:
        from offloadpp.optim import AdamHyper, AdamStep, adam_step_flat

        hyper, step = AdamHyper(lr=1e-4), 0
        while not self.stop.is_set():
            step += 1
            adam_step_flat(*self.bufs, AdamStep(step=step, hyper=hyper, num_threads=self.adam_threads))

    def __enter__(self) -> _Spinner:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def _mixed_round(store, bufs, count: int, prefix: str) -> None:
    """Reads keys 0..count-1 into bufs[:count] while writing bufs[count:] to the next count keys,
    requests interleaved (a streamed step's mix), and waits for all of them."""
    futs = []
    for i in range(count):
        futs.append(store.get(f"{prefix}{i}", out=bufs[i]))
        futs.append(store.put(f"{prefix}{count + i}", bufs[count + i]))
    for f in futs:
        f.wait()


def measure_mixed_ssd(
    dirs: Sequence[str],
    *,
    block_size_bytes: int = 1 << 20,
    queue_depth: int = 8,
    tensor_bytes: int = 16 << 20,
    total_bytes: int = 256 << 20,
    repeats: int = 3,
    busy: Optional[Busy] = None,
    weights: Optional[Sequence[float]] = None,
) -> float:
    """GB/s of reads and writes together (half the bytes each, requests interleaved), as the
    runtime's steady state has them: the next units' state read while the last ones' is written.
    `busy`: with its matmuls running on another thread meanwhile, and with its `adam_threads` the
    fused Adam on one more, as a training step keeps the CPU busy beside its I/O (on the CPU
    device the I/O thread then competes for the cores with both)."""
    import torch

    from offloadpp.io import IOConfig, aligned_empty

    count = max(1, total_bytes // tensor_bytes // 2)
    numel = tensor_bytes // 4
    cfg = IOConfig(block_size_bytes=block_size_bytes, queue_depth=queue_depth)
    bufs = [aligned_empty(numel, dtype=torch.float32) for _ in range(2 * count)]
    for b in bufs:
        b.fill_(1.0)
    with _scratch_store(dirs, cfg, weights) as store:
        for f in [store.put(f"probe{i}", b) for i, b in enumerate(bufs)]:
            f.wait()

        def mixed() -> None:
            _mixed_round(store, bufs, count, "probe")

        if busy is not None:
            with _Spinner(busy.gemms, busy.adam_threads):
                t = _median_time(mixed, repeats)
        else:
            t = _median_time(mixed, repeats)
    return 2 * count * numel * 4 / t / 1e9


def measure_io_issue(dirs: Sequence[str], nbytes: int = 1 << 20, keys: int = 8, repeats: int = 10) -> float:
    """CPU seconds the issuing thread spends on one request: the median time for TensorStore.get
    and .put to return (not to complete), gets and puts averaged.

    Note: why it is its own number. The runtime issues every read and write from Python (the
    main thread for fetches and state reads, the optimizer's worker for its writes); on a small
    model with everything streamed that is tens of requests per step, several milliseconds the
    per-visit overhead (measured with everything in memory) does not hold."""
    import torch

    from offloadpp.io import aligned_empty

    bufs = [aligned_empty(nbytes // 4, dtype=torch.float32) for _ in range(keys)]
    gets, puts = [], []
    with _scratch_store(dirs[:1]) as store:
        for i, b in enumerate(bufs):
            b.fill_(float(i))
            store.put(f"k{i}", b).wait()
        for _ in range(repeats):
            for i, b in enumerate(bufs):
                t0 = time.perf_counter()
                f = store.get(f"k{i}", out=b)
                gets.append(time.perf_counter() - t0)
                f.wait()
                t0 = time.perf_counter()
                f = store.put(f"k{i}", b)
                puts.append(time.perf_counter() - t0)
                f.wait()
    return (statistics.median(gets) + statistics.median(puts)) / 2


def measure_ssd_latency(
    dirs: Sequence[str], sizes: tuple[int, int] = (1 << 20, 8 << 20), repeats: int = 9
) -> float:
    """The fixed cost of one request alone, in seconds: puts and gets of two sizes with nothing
    else in flight, t = latency + bytes / rate fitted through the medians (the two directions
    averaged). It holds the store's header round trips and the time the engine takes to fill its
    queue; a request that finds the SSD idle pays it."""
    import torch

    from offloadpp.io import aligned_empty

    bufs = [aligned_empty(n // 4, dtype=torch.float32) for n in sizes]
    for b in bufs:
        b.fill_(1.0)
    times = {}
    with _scratch_store(dirs[:1]) as store:
        for i, b in enumerate(bufs):
            store.put(f"probe{i}", b).wait()
            times[("put", i)] = _median_time(lambda i=i, b=b: store.put(f"probe{i}", b).wait(), repeats)
            times[("get", i)] = _median_time(lambda i=i, b=b: store.get(f"probe{i}", out=b).wait(), repeats)
    s0, s1 = sizes
    fits = [(times[(k, 0)] * s1 - times[(k, 1)] * s0) / (s1 - s0) for k in ("put", "get")]
    return max(0.0, sum(fits) / 2)


def measure_copies(nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float, float]:
    """(h2d GB/s, d2h GB/s, memcpy GB/s). Without CUDA, h2d and d2h are the memcpy rate."""
    import torch

    from offloadpp.io import aligned_empty

    n = nbytes // 4
    src = aligned_empty(n, dtype=torch.float32)
    dst = aligned_empty(n, dtype=torch.float32)
    src.fill_(1.0)
    dst.fill_(0.0)
    memcpy = nbytes / _median_time(lambda: dst.copy_(src), repeats) / 1e9
    if not cuda_available():
        return memcpy, memcpy, memcpy
    pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(n, dtype=torch.float32, device="cuda")

    def h2d() -> None:
        dev.copy_(pinned, non_blocking=True)
        torch.accelerator.synchronize()

    def d2h() -> None:
        pinned.copy_(dev, non_blocking=True)
        torch.accelerator.synchronize()

    h2d()
    return nbytes / _median_time(h2d, repeats) / 1e9, nbytes / _median_time(d2h, repeats) / 1e9, memcpy


def measure_flops(
    gemms: Iterable[tuple[int, int, int]] = DEFAULT_GEMMS,
    dtypes: Optional[Sequence[str]] = None,
    min_s: float = 0.6,
) -> dict[str, float]:
    """FLOP/s of forward matmuls (m x k) @ (k x n) over the shapes, per compute dtype."""
    import torch

    cuda = cuda_available()
    device = "cuda" if cuda else "cpu"
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtypes is None:
        dtypes = ("fp32", "bf16", "fp16") if cuda else ("fp32", "bf16")
    gemms = [tuple(int(x) for x in g) for g in gemms]
    out = {}
    for name in dtypes:
        dt = tdt[name]
        # bf16 matmul on CPUs without native support is ~40x slower: measure it on small shapes.
        shapes = (
            gemms
            if (cuda or name == "fp32")
            else [(min(m, 64), min(k, 256), min(n, 256)) for m, k, n in gemms]
        )
        ops = [
            (torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device))
            for m, k, n in shapes
        ]
        flops = sum(2 * m * k * n for m, k, n in shapes)

        def once(ops=ops) -> None:
            for a, b in ops:
                torch.mm(a, b)
            if cuda:
                torch.accelerator.synchronize()

        once()
        reps, t0 = 0, time.perf_counter()
        while True:
            once()
            reps += 1
            if time.perf_counter() - t0 >= (min_s if name == "fp32" or cuda else min_s / 3):
                break
        out[name] = flops * reps / (time.perf_counter() - t0)
    return out


def measure_adam(numel: int = 4 << 20, threads: Sequence[int] = (1,), repeats: int = 5) -> dict[int, float]:
    """Parameters per second of adam_step_flat over fp32 params, grads and moments."""
    import torch

    from offloadpp.optim import AdamHyper, AdamStep, adam_step_flat

    bufs = [torch.full((numel,), 0.01) for _ in range(4)]
    hyper = AdamHyper(lr=1e-4)
    out = {}
    step = [0]
    for t in threads:

        def once(t=t) -> None:
            step[0] += 1
            adam_step_flat(*bufs, AdamStep(step=step[0], hyper=hyper, num_threads=t))

        once()
        out[int(t)] = numel / _median_time(once, repeats)
    return out


def measure_contention(
    gemms: Sequence[tuple[int, int, int]] = DEFAULT_GEMMS,
    adam_threads: int = 1,
    numel: int = 2 << 20,
    run_s: float = 1.0,
) -> tuple[float, float]:
    """(compute slowdown under Adam, Adam slowdown under compute) on the CPU: each alone, then
    both at once (matmuls on this thread with torch's threads, Adam on a worker thread)."""
    import torch

    from offloadpp.optim import AdamHyper, AdamStep, adam_step_flat

    ops = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in gemms]
    bufs = [torch.full((numel,), 0.01) for _ in range(4)]
    hyper = AdamHyper(lr=1e-4)

    def gemm_once() -> None:
        for a, b in ops:
            torch.mm(a, b)

    step = [0]

    def adam_once() -> None:
        step[0] += 1
        adam_step_flat(*bufs, AdamStep(step=step[0], hyper=hyper, num_threads=adam_threads))

    def rate(fn, stop: threading.Event, out: list) -> None:
        n, t0 = 0, time.perf_counter()
        while not stop.is_set():
            fn()
            n += 1
        out.append((time.perf_counter() - t0) / max(n, 1))

    gemm_once()
    adam_once()
    alone_g = _median_time(gemm_once, 5)
    alone_a = _median_time(adam_once, 5)
    stop = threading.Event()
    adam_out: list = []
    worker = threading.Thread(target=rate, args=(adam_once, stop, adam_out), daemon=True)
    worker.start()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < run_s:
        gemm_once()
        n += 1
    both_g = (time.perf_counter() - t0) / n
    stop.set()
    worker.join()
    both_a = adam_out[0]
    return max(1.0, both_g / alone_g), max(1.0, both_a / alone_a)


def measure_io_contention(
    dirs: Sequence[str],
    gemms: Sequence[tuple[int, int, int]] = DEFAULT_GEMMS,
    tensor_bytes: int = 4 << 20,
    count: int = 8,
    window_s: float = 0.2,
    pairs: int = 10,
) -> float:
    """Compute slowdown while the SSD streams (>= 1): matmuls on this thread in short windows,
    alternately alone and while another thread keeps reads and writes in flight through a
    TensorStore, as a streamed step does; the median of the `pairs` (busy / alone) ratios (the
    machine's load moves between windows, and a pair sees the same load).

    Note: why it is measured and not folded into the per-unit times. On the CPU acting as the
    device the I/O engine's thread and the kernel's block layer take CPU from compute only while
    requests are in flight; the replay applies it for exactly that time, so an in-memory plan is
    not charged and a streamed one is."""
    import torch

    from offloadpp.io import aligned_empty

    ops = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in gemms]

    def gemm_rate(seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for a, b in ops:
                torch.mm(a, b)
            n += 1
        return (time.perf_counter() - t0) / n

    bufs = [aligned_empty(tensor_bytes // 4, dtype=torch.float32) for _ in range(2 * count)]
    ratios = []
    go, idle, stop = threading.Event(), threading.Event(), threading.Event()
    with _scratch_store(dirs[:1]) as store:
        for i, b in enumerate(bufs):
            b.fill_(1.0)
            store.put(f"p{i}", b).wait()

        def stream() -> None:
            while not stop.is_set():
                if not go.is_set():
                    idle.set()  # nothing in flight: the alone window may start
                    go.wait(0.05)
                    continue
                idle.clear()
                _mixed_round(store, bufs, count, "p")

        io = threading.Thread(target=stream, daemon=True)
        io.start()
        try:
            gemm_rate(0.05)
            for _ in range(pairs):
                idle.wait()
                alone = gemm_rate(window_s)
                go.set()
                busy = gemm_rate(window_s)
                go.clear()
                ratios.append(busy / alone)
        finally:
            stop.set()
            go.set()
            io.join()
    return max(1.0, statistics.median(ratios))


def available_memory() -> tuple[int, int]:
    """(host bytes available, device bytes free); on the CPU the device figure is the host's."""
    import psutil
    import torch

    host = int(psutil.virtual_memory().available)
    if cuda_available():
        free, _ = torch.accelerator.get_memory_info()
        return host, int(free)
    return host, host


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor()
            )
    except OSError:
        return platform.processor() or "cpu"


def profile_hardware(
    dirs: Sequence[str],
    *,
    gemms: Optional[Iterable[tuple[int, int, int]]] = None,
    total_bytes: int = 256 << 20,
    io_grid: bool = True,
    adam_threads: int = 1,
    quick: bool = False,
    log=None,
) -> HardwareProfile:
    """Measures everything the cost model needs. `dirs`: the swap directories (each must exist).
    `quick`: shorter timing loops (tests; the numbers are noisier)."""
    import torch

    t_start = time.perf_counter()
    say = log or (lambda msg: None)
    dirs = [os.path.abspath(d) for d in dirs]
    for d in dirs:
        if not os.path.isdir(d):
            raise FileNotFoundError(
                f"profile directory {d!r} does not exist (create it, or mount the SSD there)"
            )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ssds = []
    weights = None
    if len(dirs) > 1:
        for d in dirs:
            r, w = measure_dirs([d], total_bytes=total_bytes)
            ssds.append(SsdProfile(d, r, w, free_bytes=int(shutil.disk_usage(d).free)))
            say(f"SSD {d}: read {r:.2f} GB/s, write {w:.2f} GB/s alone")
        weights = [s.mix_gbps for s in ssds]  # each drive's share of a striped tensor
    read, write = measure_dirs(dirs, total_bytes=total_bytes, weights=weights)
    if len(dirs) == 1:
        ssds.append(SsdProfile(dirs[0], read, write, free_bytes=int(shutil.disk_usage(dirs[0]).free)))
    else:
        sr, sw = sum(s.read_gbps for s in ssds), sum(s.write_gbps for s in ssds)
        say(f"SSD (all {len(dirs)} at once, striped by their rates): read {read:.2f} GB/s "
            f"({read / sr:.0%} of their sum), write {write:.2f} GB/s ({write / sw:.0%})")  # fmt: skip
    gemms = tuple(gemms) if gemms else DEFAULT_GEMMS
    mixed = measure_mixed_ssd(dirs, total_bytes=total_bytes, weights=weights)
    mixed_busy = 0.0
    if not cuda_available():
        mixed_busy = measure_mixed_ssd(dirs, total_bytes=total_bytes, busy=Busy(gemms, adam_threads), repeats=5,
                                       weights=weights)  # fmt: skip
    say(
        f"SSD reads and writes together: {mixed:.2f} GB/s"
        + (f", {mixed_busy:.2f} GB/s while computing" if mixed_busy else "")
    )
    latency = measure_ssd_latency(dirs)
    say(f"SSD round trip of a small request alone: {latency * 1e3:.2f} ms")
    io_issue = measure_io_issue(dirs)
    say(f"CPU time to issue one request: {io_issue * 1e3:.3f} ms")
    grid = []
    if io_grid:
        for bs, qd in IO_GRID:
            r, w = measure_dirs(
                dirs,
                block_size_bytes=bs,
                queue_depth=qd,
                total_bytes=total_bytes // 2,
                repeats=2,
                weights=weights,
            )
            grid.append(IOPoint(bs, qd, r, w))
            say(f"  block {bs >> 10} KiB qd {qd}: read {r:.2f}, write {w:.2f} GB/s")
    h2d, d2h, memcpy = measure_copies((32 << 20) if quick else (256 << 20))
    say(f"copies: h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s, memcpy {memcpy:.1f} GB/s")
    flops = measure_flops(gemms, min_s=0.1 if quick else 0.6)
    say("device FLOP/s: " + ", ".join(f"{k} {v / 1e9:.1f} G" for k, v in flops.items()))
    adam = measure_adam(numel=(1 << 20) if quick else (4 << 20), threads=sorted({1, adam_threads, cores}))
    say("CPU Adam: " + ", ".join(f"{k} thr {v / 1e9:.2f} Gparam/s" for k, v in adam.items()))
    slow_c = slow_a = slow_io = 1.0
    cuda = cuda_available()
    if not cuda:
        slow_c, slow_a = measure_contention(gemms, adam_threads=adam_threads, run_s=0.2 if quick else 1.0)
        say(f"contention: compute x{slow_c:.2f} while Adam runs, Adam x{slow_a:.2f} while compute runs")
        slow_io = measure_io_contention(
            dirs, gemms, window_s=0.05 if quick else 0.2, pairs=4 if quick else 10
        )
        say(f"contention: compute x{slow_io:.2f} while the SSD streams")
    visit_f, visit_b = measure_visit_overhead(8 if quick else 15)
    say(f"runtime overhead per unit visit: forward {visit_f * 1e3:.2f} ms, backward {visit_b * 1e3:.2f} ms")
    host, dev = available_memory()
    return HardwareProfile(
        device="cuda" if cuda else "cpu",
        device_name=device_names()[0] if cuda else _cpu_name(),
        cpu_cores=cores,
        ssd_read_gbps=read,
        ssd_write_gbps=write,
        ssd_mixed_gbps=mixed,
        ssd_mixed_busy_gbps=mixed_busy,
        ssd_latency_s=latency,
        io_issue_s=io_issue,
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        memcpy_gbps=memcpy,
        device_flops_per_s=flops,
        adam_params_per_s=adam,
        host_memory_bytes=host,
        device_memory_bytes=dev,
        ssds=tuple(ssds),
        io_grid=tuple(grid),
        runtime_forward_visit_s=visit_f,
        runtime_backward_visit_s=visit_b,
        compute_slowdown_under_adam=slow_c,
        adam_slowdown_under_compute=slow_a,
        compute_slowdown_under_io=slow_io,
        torch_threads=torch.get_num_threads(),
        measured_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        measure_s=time.perf_counter() - t_start,
    )


def scratch_dir() -> str:
    """A directory for a quick profile when none is named (tests)."""
    return tempfile.mkdtemp(prefix="offloadpp-profile-")
