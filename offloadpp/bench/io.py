"""`offloadpp bench io`: SSD read and write GB/s of offloadpp next to fio and DeepSpeed's aio_handle.

All contenders move the same bytes with O_DIRECT at the same block size and queue depth, in the
same run, on the same file, interleaved per repeat (offloadpp, store, fio, deepspeed, offloadpp, ...) so that machine
noise hits them alike; every timed write overwrites a file written once beforehand. The table
shows medians over the repeats (GB/s = 1e9 bytes/s) and the ratios the I/O engine is held to:
offloadpp >= 0.9x fio and >= 1.0x DeepSpeed aio, in both directions.

DeepSpeed's async_io op is JIT-compiled on first use (about 4-5 minutes on a 2-core machine, then
cached under ~/.cache/torch_extensions); the bench builds it once and says so, and carries on
without it if it cannot be built.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from typing import Callable, Optional

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=os.path.join("runs", "nvme"), help="directory on the SSD to measure")
    p.add_argument("--size-mb", type=int, default=1024, help="bytes moved per measurement, in MiB")
    p.add_argument("--block-kb", type=int, default=1024, help="block size in KiB (all contenders)")
    p.add_argument("--queue-depth", type=int, default=8, help="blocks in flight (all contenders)")
    p.add_argument("--repeats", type=int, default=7, help="repeats per contender and direction (>= 3)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "libaio", "io_uring", "threadpool", "all"],
        help="offloadpp backend; 'all' measures each built backend as its own contender",
    )
    p.add_argument("--no-fio", action="store_true", help="skip fio")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's aio_handle")
    p.add_argument("--no-store", action="store_true", help="skip the TensorStore row")
    p.add_argument("--keep-files", action="store_true", help="keep the benchmark files in --dir")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH")


class Contender:
    def __init__(
        self, name: str, write: Callable[[], float], read: Callable[[], float], close=None, verify=None
    ):
        self.name = name
        self.write = write  # each returns bytes/s for one measurement
        self.read = read
        self.close = close or (lambda: None)
        self.verify = verify  # optional: a full write + read-back compared byte for byte
        self.results: dict[str, list[float]] = {"write": [], "read": []}


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _log(msg: str) -> None:
    print(msg, flush=True)


def _offloadpp_engine(args, backend: str, path: str, buf) -> Contender:
    from offloadpp.io import IOConfig, crc32c, make_engine, open_file

    n = buf.numel()
    cfg = IOConfig(backend=backend, block_size_bytes=args.block_kb << 10, queue_depth=args.queue_depth)
    eng = make_engine(cfg, os.path.dirname(path) or ".")
    f = open_file(path)
    eng.write(f, buf.data_ptr(), n, 0).wait()  # lay the file down once: timed writes overwrite
    ptr = buf.data_ptr()

    def write() -> float:
        return n / _timed(lambda: eng.write(f, ptr, n, 0).wait())

    def read() -> float:
        return n / _timed(lambda: eng.read(f, ptr, n, 0).wait())

    def verify() -> None:
        # Other contenders overwrite the shared file with their own data, so check a round trip of
        # our own: the whole buffer written, wiped, read back and compared by CRC-32C.
        crc = crc32c(ptr, n)
        eng.write(f, ptr, n, 0).wait()
        buf.zero_()
        eng.read(f, ptr, n, 0).wait()
        if crc32c(ptr, n) != crc:
            raise RuntimeError(f"offloadpp ({backend}): data read back differs from the data written")

    return Contender(f"offloadpp ({backend})", write, read, eng.close, verify)


def _offloadpp_store(args, backend: str, directory: str, buf) -> Contender:
    from offloadpp.io import IOConfig, TensorStore

    cfg = IOConfig(backend=backend, block_size_bytes=args.block_kb << 10, queue_depth=args.queue_depth)
    store = TensorStore(directory, cfg)
    n = buf.numel()
    store.put("bench", buf).wait()

    def write() -> float:
        return n / _timed(lambda: store.put("bench", buf).wait())

    def read() -> float:
        return n / _timed(lambda: store.get("bench", out=buf).wait())

    return Contender(f"offloadpp store ({backend})", write, read, store.close)


def _fio(args, path: str, nbytes: int) -> Optional[Contender]:
    exe = shutil.which("fio")
    if exe is None:
        _log("fio: not installed, skipped")
        return None
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()

    def run(rw: str) -> float:
        cmd = [
            exe, "--name=offloadpp-bench", f"--filename={path}", f"--rw={rw}", f"--bs={args.block_kb}k",
            f"--iodepth={args.queue_depth}", "--ioengine=libaio", "--direct=1", f"--size={nbytes}",
            "--numjobs=1", "--output-format=json",
        ]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"fio failed: {r.stderr.strip() or r.stdout.strip()}")
        job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0][rw]
        return job["io_bytes"] / (job["runtime"] / 1000.0)  # bytes/s over fio's own runtime

    run("write")  # lay the file down once
    return Contender(f"{version} (libaio)", lambda: run("write"), lambda: run("read"))


def _deepspeed(args, path: str, nbytes: int) -> Optional[Contender]:
    try:
        import logging

        import torch
        from torch.utils.cpp_extension import _get_build_directory

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        import deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:  # noqa: BLE001 - reported, the bench goes on
        _log(f"deepspeed: not available ({type(e).__name__}: {e}), skipped")
        return None
    from offloadpp.integrations.deepspeed.op_locks import clear_stale_build_locks

    clear_stale_build_locks(report=_log)  # an interrupted build's lock would be waited on forever
    try:
        built = os.path.exists(os.path.join(_get_build_directory("async_io", False), "async_io.so"))
        if not built:
            _log(
                "deepspeed: building its async_io op once (JIT, about 4-5 minutes here; cached afterwards) ..."
            )
        t0 = time.perf_counter()
        op = AsyncIOBuilder().load(verbose=False)
        if not built:
            _log(f"deepspeed: async_io built in {time.perf_counter() - t0:.0f} s")
    except Exception as e:  # noqa: BLE001 - reported, the bench goes on
        _log(f"deepspeed: cannot build or load its async_io op ({type(e).__name__}: {e}), skipped")
        return None
    h = op.aio_handle(args.block_kb << 10, args.queue_depth, False, True, 1)
    buf = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buf.view(torch.int64).copy_(torch.arange(nbytes // 8))
    h.sync_pwrite(buf, path)  # lay the file down once

    def write() -> float:
        return nbytes / _timed(lambda: h.sync_pwrite(buf, path))

    def read() -> float:
        return nbytes / _timed(lambda: h.sync_pread(buf, path))

    return Contender(
        f"deepspeed {deepspeed.__version__} aio", write, read, lambda: h.free_cpu_locked_tensor(buf)
    )


def _machine(directory: str) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    fs = "?"
    try:
        real = os.path.realpath(directory)
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fs = mnt, f"{typ} on {dev} (mounted at {mnt})"
    except OSError:
        pass
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "fs": fs,
    }


def _summary(values: list[float]) -> dict:
    return {
        "median_gbps": statistics.median(values) / GB,
        "min_gbps": min(values) / GB,
        "max_gbps": max(values) / GB,
        "all_gbps": [v / GB for v in values],
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from offloadpp.io import ALIGNMENT, aligned_empty, build_info, resolve_backend
    from offloadpp.io.config import IOConfig

    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (the table reports medians)")
    nbytes = args.size_mb << 20
    if (args.block_kb << 10) % ALIGNMENT or nbytes % ALIGNMENT:
        raise SystemExit(f"--block-kb and --size-mb must give multiples of {ALIGNMENT} bytes")
    os.makedirs(args.dir, exist_ok=True)
    work = os.path.join(args.dir, "bench-io")
    os.makedirs(work, exist_ok=True)

    if args.backend == "all":
        backends = [b for b, ok in build_info()["backends"].items() if ok]
    elif args.backend == "auto":
        backends = [resolve_backend(IOConfig(), work)]
    else:
        backends = [args.backend]

    _log(
        f"offloadpp bench io: {args.size_mb} MiB per measurement, block {args.block_kb} KiB, queue depth "
        f"{args.queue_depth}, O_DIRECT, {args.repeats} repeats, in {os.path.abspath(args.dir)}"
    )
    buf = aligned_empty(nbytes, torch.uint8)
    buf.view(torch.int64).copy_(torch.arange(nbytes // 8))  # touch every page before timing

    # One file for the engine, fio and DeepSpeed: the same extents on the same device, so where a
    # file happens to lie is not part of the comparison.
    shared = os.path.join(work, "shared.bin")
    contenders: list[Contender] = []
    try:
        _log("setting up (each contender writes its file once) ...")
        for b in backends:
            contenders.append(_offloadpp_engine(args, b, shared, buf))
            if not args.no_store:
                contenders.append(_offloadpp_store(args, b, os.path.join(work, f"store-{b}"), buf))
        if not args.no_fio:
            c = _fio(args, shared, nbytes)
            if c is not None:
                contenders.append(c)
        if not args.no_deepspeed:
            c = _deepspeed(args, shared, nbytes)
            if c is not None:
                contenders.append(c)

        total = args.repeats * len(contenders) * 2
        done = 0
        for r in range(args.repeats):
            # Interleaved (A, B, C, A, B, C, ...), and rotated by one each repeat (B, C, A, ...) so
            # that no contender always runs first after the direction changes.
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            for direction in ("write", "read"):
                for c in order:
                    v = (c.write if direction == "write" else c.read)()
                    c.results[direction].append(v)
                    done += 1
                    _log(
                        f"[{done:>3}/{total}] repeat {r + 1}: {c.name:<30} {direction:<5} {v / GB:6.2f} GB/s"
                    )
        for c in contenders:
            if c.verify is not None:
                buf.view(torch.int64).copy_(torch.arange(nbytes // 8))
                c.verify()
        _log("offloadpp data verified: every byte read back equals what was written")
    finally:
        for c in contenders:
            c.close()
        if not args.keep_files:
            shutil.rmtree(work, ignore_errors=True)

    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "offloadpp bench io "
        + f"--dir {args.dir} --size-mb {args.size_mb} --block-kb {args.block_kb} "
        + f"--queue-depth {args.queue_depth} --repeats {args.repeats} --backend {args.backend}",
        "machine": _machine(args.dir),
        "config": {
            "bytes": nbytes,
            "block_bytes": args.block_kb << 10,
            "queue_depth": args.queue_depth,
            "repeats": args.repeats,
            "o_direct": True,
        },
        "results": {c.name: {d: _summary(c.results[d]) for d in ("write", "read")} for c in contenders},
        "ratios": {},
    }
    _print_table(report, contenders)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        _log(f"wrote {args.json}")
    return 0


def _print_table(report: dict, contenders: list[Contender]) -> None:
    res = report["results"]
    m = report["machine"]
    print()
    print(f"{report['date']}  {m['cpu']} x{m['cpus']}, kernel {m['kernel']}, {m['fs']}")
    print(f"{'contender':<38} {'write GB/s  median [min-max]':<30} {'read GB/s  median [min-max]':<30}")
    for c in contenders:
        cells = []
        for d in ("write", "read"):
            s = res[c.name][d]
            cells.append(f"{s['median_gbps']:6.2f} [{s['min_gbps']:.2f}-{s['max_gbps']:.2f}]")
        print(f"{c.name:<38} {cells[0]:<30} {cells[1]:<30}")
    ours = [c.name for c in contenders if c.name.startswith("offloadpp (")]
    peers = [
        (c.name, 0.9 if c.name.startswith("fio") else 1.0)
        for c in contenders
        if not c.name.startswith("offload")
    ]
    for o in ours:
        for peer, target in peers:
            w = res[o]["write"]["median_gbps"] / res[peer]["write"]["median_gbps"]
            r = res[o]["read"]["median_gbps"] / res[peer]["read"]["median_gbps"]
            ok = w >= target and r >= target
            # Paired: the median over repeats of (ours / peer) within the same repeat, which cancels
            # drift that is slower than one repeat.
            paired = {
                d: statistics.median(a / b for a, b in zip(res[o][d]["all_gbps"], res[peer][d]["all_gbps"]))
                for d in ("write", "read")
            }
            report["ratios"][f"{o} / {peer}"] = {
                "write": w,
                "read": r,
                "paired_write": paired["write"],
                "paired_read": paired["read"],
                "target": target,
                "met": ok,
            }
            label = f"{o} / {peer.split(' ')[0]}"
            print(f"{label:<38} {w:6.2f} (paired {paired['write']:.2f}){'':<11} {r:6.2f} (paired "
                  f"{paired['read']:.2f}){'':<11} target >= {target} {'met' if ok else 'NOT MET'}")  # fmt: skip
