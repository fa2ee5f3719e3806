"""`offloadpp bench capacity`: peak RSS training a model whose state far exceeds the memory allowed.

The model's fp32 training state (weights, grads, Adam moments: 16 B/param) is far larger than
the RSS allowed.

The model (default: GPT-2 with 24 layers of width 2048, 1.31B parameters, 21 GB of training
state in fp32) is built on the meta device and initialised unit by unit straight into the
store, so it never exists whole in RAM. Training runs in a child process; the parent reads the
child's peak resident set size from the kernel (wait4's ru_maxrss), so the number covers every
allocation of the run: Python, torch, the runtime's buffers, the I/O engine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument(
        "--prefetch-depth", type=int, default=2, help="weights prefetch depth the budgets are sized for"
    )
    p.add_argument(
        "--optim-prefetch-depth", type=int, default=1, help="optimizer read-ahead the budgets are sized for"
    )
    p.add_argument("--max-rss-gib", type=float, default=8.0, help="the bar: peak RSS at most this")
    p.add_argument("--device-budget", type=float, default=None, help="bytes (default: the streaming minimum)")
    p.add_argument("--host-budget", type=float, default=None, help="bytes (default: the streaming minimum)")
    p.add_argument(
        "--dir", default=os.path.join("runs", "bench-capacity"), help="swap directory (removed after)"
    )
    p.add_argument("--keep", action="store_true", help="keep the swap directory")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH")
    p.add_argument("--child", metavar="RESULT_JSON", help=argparse.SUPPRESS)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    fd, result_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    argv = [sys.executable, "-m", "offloadpp.bench.capacity", "--child", result_path]
    for k in (
        "layers",
        "width",
        "heads",
        "batch",
        "seq",
        "steps",
        "threads",
        "dir",
        "device_budget",
        "host_budget",
        "prefetch_depth",
        "optim_prefetch_depth",
    ):
        v = getattr(args, k)
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(argv)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        with open(result_path) as f:
            text = f.read()
        child = json.loads(text) if text else {}
    finally:
        os.unlink(result_path)
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    if proc.returncode != 0 or not child:
        _log(f"the training process failed (exit {proc.returncode})")
        return 1
    peak = usage.ru_maxrss * 1024  # kilobytes on Linux
    report = {
        "bench": "capacity",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["offloadpp", "bench", "capacity", *sys.argv[3:]]),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "mem_bytes": _mem_total()},
        **child,
        "peak_rss_bytes": peak,
        "wall_s": wall,
        "max_rss_bytes": int(args.max_rss_gib * GIB),
        "pass": peak <= args.max_rss_gib * GIB,
    }
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["pass"] else 1


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        return 0


def _print(r: dict) -> None:
    print(
        f"# bench capacity: GPT-2 {r['layers']} layers x {r['width']} ({r['params'] / 1e9:.2f}B params), "
        f"batch {r['batch']}x{r['seq']}, fp32, {r['date']}"
    )
    print(
        f"# fp32 training state {r['training_state_bytes'] / 1e9:.1f} GB (16 B/param); "
        f"machine memory {r['machine']['mem_bytes'] / GIB:.1f} GiB"
    )
    print(
        "| peak RSS | bar | init s | step s (each) | SSD on disk | SSD read/step | SSD written/step | loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    steps = ", ".join(f"{s:.1f}" for s in r["step_s"])
    print(
        f"| {r['peak_rss_bytes'] / GIB:.2f} GiB | <= {r['max_rss_bytes'] / GIB:.0f} GiB | {r['init_s']:.1f} | {steps} | "
        f"{r['disk_bytes'] / 1e9:.1f} GB | {r['ssd_read_bytes'] / 1e9:.1f} GB | {r['ssd_write_bytes'] / 1e9:.1f} GB | "
        f"{' -> '.join(f'{x:.2f}' for x in r['losses'])} |"
    )
    print(f"bar: peak RSS <= {r['max_rss_bytes'] / GIB:.0f} GiB: {'PASS' if r['pass'] else 'FAIL'}")


def _child(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm
    from transformers import GPT2Config, GPT2LMHeadModel

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=args.layers,
        n_embd=args.width,
        n_head=args.heads,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    n = sum(p.numel() for p in model.parameters())
    _log(f"model built on the meta device: {n:,} parameters")
    settings = Settings(
        prefetch_depth=args.prefetch_depth,
        optim_prefetch_depth=args.optim_prefetch_depth,
        device_budget_bytes=int(args.device_budget) if args.device_budget else None,  # None: "auto"
        host_budget_bytes=int(args.host_budget) if args.host_budget else None,
    )
    rc = RuntimeConfig(nvme_paths=[args.dir], settings=settings, device="cpu", log_every=0)
    t0 = time.perf_counter()
    engine = assemble_engine(model, rc, hyper=AdamHyper(lr=1e-4), init_fn=model._init_weights, progress=True)
    dev, host = engine.plan.budgets.device_bytes, engine.plan.budgets.host_bytes
    init_s = time.perf_counter() - t0
    _log(engine.plan.describe())
    g = torch.Generator().manual_seed(1)
    losses, step_s, reports = [], [], []
    for _ in tqdm(range(args.steps), desc="capacity: steps", file=sys.stderr):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        t = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        r = engine.step()
        step_s.append(time.perf_counter() - t)
        losses.append(loss.item())
        reports.append(r)
        _log(r.summary())
    disk = engine.disk_bytes()
    engine.close()
    last = reports[-1]
    result = {
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "seq": args.seq,
        "params": n,
        "training_state_bytes": 16 * n,
        "device_budget_bytes": dev,
        "host_budget_bytes": host,
        "plan": engine.plan.describe(),
        "init_s": init_s,
        "step_s": step_s,
        "losses": losses,
        "disk_bytes": disk,
        "ssd_read_bytes": last.ssd_read_bytes,
        "ssd_write_bytes": last.ssd_write_bytes,
        "reports": [r.as_dict() for r in reports],
    }
    with open(args.child, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="offloadpp bench capacity", description=__doc__.splitlines()[0])
    add_arguments(_p)
    sys.exit(run(_p.parse_args()))
