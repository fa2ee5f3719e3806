"""`offloadpp bench adam`: one CPU Adam step on N fp32 params, offloadpp next to DeepSpeedCPUAdam
and torch.optim.AdamW(fused=True), against the memory-bandwidth floor measured in the same run.

Two tasks. "fp32 step": params, grads and both moments in fp32 (28 B moved per param: p, g, m, v
read; p, m, v written). "step + bf16 copy": the same step and then the bf16 copy of the params
the GPU needs next; offloadpp writes it in the same pass (30 B/param), a peer runs its step and
then `out.copy_(p)` into a preallocated bf16 tensor (28 + 6 B/param). The floor rows run
offloadpp's bandwidth-floor kernel: the same loads and stores with no arithmetic.

All contenders step the same buffers (their moments are the same tensors), so they see the same
pages; each repeat runs every contender once, in an order rotated per repeat, so machine noise
hits them alike; the table shows medians (and the ratios also per repeat, paired). Ratios are the bar the kernel is held to: fp32 step
<= 1.0x the faster peer, step + bf16 copy <= 0.8x the faster peer's step followed by its copy.

--crc adds a third task: offloadpp's step alone, followed and preceded by separate CRC-32C
passes over the moments as read and the params and moments as written (what the store's
checksums cost when they are a pass of their own, docs/io.md), and with the same CRCs taken in
the Adam pass (csrc/adam/adam_kernel.h, the CRC Note). The CRC passes run on the calling thread,
as the I/O engine's verifier thread runs them; the Adam calls on the bench's threads.

DeepSpeed's cpu_adam op is JIT-compiled on first use (about a minute on a 2-core machine, then
cached under ~/.cache/torch_extensions); the bench builds it once and says so, and carries on
without it if it cannot be built.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import time
from typing import Callable, Optional

BYTES_STEP = 28  # fp32 p, g, m, v read; p, m, v written
BYTES_FUSED = 30  # + bf16 copy written
BYTES_COPY = 6  # a separate fp32 -> bf16 pass: 4 read + 2 written
BAR_FP32 = 1.0
BAR_FUSED = 0.8


def _count(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a count like 100M, 1e8 or 2500000, got {text!r}")
    n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    if n < 1:
        raise argparse.ArgumentTypeError(f"need at least one param, got {text!r}")
    return int(n)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params", type=_count, default=_count("100M"), help="params per step, e.g. 100M (default)"
    )
    p.add_argument("--repeats", type=int, default=15, help="timed steps per contender (>= 3; medians)")
    p.add_argument(
        "--threads", type=int, default=None, help="threads for every contender (default: all cores)"
    )
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    p.add_argument("--no-torch", action="store_true", help="skip torch.optim.AdamW(fused=True)")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH")
    p.add_argument(
        "--crc", action="store_true", help="also time CRC-32C in the Adam pass against separate passes"
    )


def _log(msg: str) -> None:
    print(msg, flush=True)


class Contender:
    def __init__(self, name: str, task: str, bytes_per_param: int, fn: Callable[[], None], kind: str):
        self.name, self.task, self.bytes_per_param, self.fn, self.kind = name, task, bytes_per_param, fn, kind
        self.seconds: list[float] = []

    def time_once(self) -> float:
        t0 = time.perf_counter()
        self.fn()
        dt = time.perf_counter() - t0
        self.seconds.append(dt)
        return dt


def _deepspeed_optimizer(p, m, v, lr, wd):
    """DeepSpeedCPUAdam over the shared buffers, or (None, why)."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as e:  # not installed, or its import fails on this machine
        return None, f"cannot import deepspeed: {type(e).__name__}: {e}"
    from offloadpp.integrations.deepspeed.op_locks import clear_stale_build_locks

    clear_stale_build_locks(report=_log)  # an interrupted build's lock would be waited on forever
    _log("loading DeepSpeed's cpu_adam op (JIT-compiled on first use, about 1 min; cached afterwards) ...")
    t0 = time.perf_counter()
    try:
        CPUAdamBuilder().load()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([p], lr=lr, weight_decay=wd, adamw_mode=True)
    except BaseException as e:  # a failed build can raise SystemExit from the extension loader
        if isinstance(e, KeyboardInterrupt):
            raise
        return None, f"cannot build/load DeepSpeed's cpu_adam op: {type(e).__name__}: {str(e)[-400:]}"
    _log(f"  ready in {time.perf_counter() - t0:.1f} s")
    opt.state[p] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
    return opt, None


def _machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "kernel": platform.release(), "cpu": cpu, "cpus": os.cpu_count()}


def run(args: argparse.Namespace) -> int:
    import torch

    from offloadpp.optim import (
        AdamHyper,
        AdamStep,
        adam_step_flat,
        bandwidth_floor,
        default_num_threads,
        kernel_isa,
    )

    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (the table reports medians)")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("--threads must be >= 1")
    threads = args.threads or default_num_threads()
    torch.set_num_threads(threads)  # torch's kernels and DeepSpeed's OpenMP loop (same libgomp)
    n = args.params
    lr, wd = 1e-3, 0.01
    hyper = AdamHyper(lr=lr, weight_decay=wd)

    _log(
        f"offloadpp bench adam: {n:,} params, {threads} threads, {args.repeats} repeats, kernel {kernel_isa()}, "
        f"torch {torch.__version__}"
    )
    _log(
        f"allocating {(n * 4 * 4 + n * 2) / 2**30:.2f} GiB (fp32 params, grads, exp_avg, exp_avg_sq; bf16 copy) ..."
    )
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).mul_(1e-2)
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.zeros(n, dtype=torch.bfloat16)
    p.grad = g

    contenders: list[Contender] = []
    skipped: dict[str, str] = {}
    step = [0]

    def ours() -> None:
        step[0] += 1
        adam_step_flat(p, g, m, v, AdamStep(step=step[0], hyper=hyper, num_threads=threads))

    def ours_fused() -> None:
        step[0] += 1
        adam_step_flat(p, g, m, v, AdamStep(step=step[0], hyper=hyper, num_threads=threads), half_out=out)

    contenders += [
        Contender("memory floor (same traffic)", "fp32", BYTES_STEP,
                  lambda: bandwidth_floor(p, g, m, v, num_threads=threads), "floor"),
        Contender("offloadpp CPUAdam", "fp32", BYTES_STEP, ours, "ours"),
        Contender("memory floor (same traffic)", "bf16", BYTES_FUSED,
                  lambda: bandwidth_floor(p, g, m, v, half_out=out, num_threads=threads), "floor"),
        Contender("offloadpp fused step+copy", "bf16", BYTES_FUSED, ours_fused, "ours"),
    ]  # fmt: skip

    if args.crc:
        contenders += _crc_contenders(p, g, m, v, lambda: AdamStep(step=step[0], hyper=hyper, num_threads=threads),
                                      step)  # fmt: skip
    if not args.no_deepspeed:
        ds, why = _deepspeed_optimizer(p, m, v, lr, wd)
        if ds is None:
            skipped["DeepSpeedCPUAdam"] = why
            _log(f"  skipping DeepSpeedCPUAdam: {why}")
        else:
            import deepspeed

            name = f"DeepSpeedCPUAdam {deepspeed.__version__}"
            contenders += [
                Contender(name, "fp32", BYTES_STEP, ds.step, "peer"),
                Contender(f"{name} + copy_", "bf16", BYTES_STEP + BYTES_COPY, lambda: (ds.step(), out.copy_(p)),
                          "peer"),
            ]  # fmt: skip
    if not args.no_torch:
        try:
            tf = torch.optim.AdamW([p], lr=lr, weight_decay=wd, fused=True)
            tf.state[p] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": m, "exp_avg_sq": v}
            tf.step()  # fails here if this torch has no fused CPU AdamW
            contenders += [
                Contender("torch AdamW(fused=True)", "fp32", BYTES_STEP, tf.step, "peer"),
                Contender("torch AdamW(fused=True) + copy_", "bf16", BYTES_STEP + BYTES_COPY,
                          lambda: (tf.step(), out.copy_(p)), "peer"),
            ]  # fmt: skip
        except Exception as e:
            skipped["torch AdamW(fused=True)"] = f"{type(e).__name__}: {e}"
            _log(f"  skipping torch AdamW(fused=True): {e}")

    _log("warming up (one untimed run each) ...")
    for c in contenders:
        c.fn()
    total = args.repeats * len(contenders)
    done = 0
    for r in range(args.repeats):
        k = r % len(contenders)  # rotate who goes first
        for c in contenders[k:] + contenders[:k]:
            dt = c.time_once()
            done += 1
            if done % len(contenders) == 0 or args.repeats <= 5:
                _log(f"[{done:>4}/{total}] repeat {r + 1}: {c.name:<34} {c.task:<4} {dt * 1e3:8.1f} ms")
    if not torch.isfinite(p[:1000]).all():
        raise RuntimeError("params became non-finite during the bench")

    report = _report(args, n, threads, kernel_isa(), torch.__version__, contenders, skipped)
    _print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        _log(f"wrote {args.json}")
    return 0


BYTES_CRC = 20  # CRC-32C of the moments as read (8 B) and of params and moments as written (12 B)


def _crc_contenders(p, g, m, v, how, step) -> list:
    from offloadpp.io.engine import crc32c
    from offloadpp.optim.kernels import CRC_STREAMS, StateCrcs, adam_step_flat

    def crc(t) -> int:
        return crc32c(t.data_ptr(), t.numel() * t.element_size())

    def plain() -> None:
        step[0] += 1
        adam_step_flat(p, g, m, v, how())

    def separate() -> None:
        step[0] += 1
        crc(m), crc(v)
        adam_step_flat(p, g, m, v, how())
        crc(p), crc(m), crc(v)

    def fused() -> None:
        step[0] += 1
        adam_step_flat(p, g, m, v, how(), crcs=StateCrcs(p, m, v, CRC_STREAMS))

    return [
        Contender("offloadpp CPUAdam, no CRC", "crc", BYTES_STEP, plain, "crc-base"),
        Contender("+ separate CRC-32C passes", "crc", BYTES_STEP + BYTES_CRC, separate, "crc-separate"),
        Contender("CRC-32C in the Adam pass", "crc", BYTES_STEP, fused, "crc-fused"),
    ]


def _report(args, n, threads, isa, torch_version, contenders, skipped) -> dict:
    rows = []
    for c in contenders:
        med = statistics.median(c.seconds)
        rows.append({
            "name": c.name, "task": c.task, "kind": c.kind, "bytes_per_param": c.bytes_per_param,
            "median_ms": med * 1e3, "min_ms": min(c.seconds) * 1e3, "max_ms": max(c.seconds) * 1e3,
            "gparams_per_s": n / med / 1e9, "gb_per_s": n * c.bytes_per_param / med / 1e9,
            "all_ms": [s * 1e3 for s in c.seconds],
        })  # fmt: skip
    ratios = {}
    for task, bar in (("fp32", BAR_FP32), ("bf16", BAR_FUSED)):
        floor = next((r for r in rows if r["task"] == task and r["kind"] == "floor"), None)
        for r in rows:
            if r["task"] == task and floor is not None:
                r["x_floor"] = r["median_ms"] / floor["median_ms"]
        ours = next(r for r in rows if r["task"] == task and r["kind"] == "ours")
        peers = [r for r in rows if r["task"] == task and r["kind"] == "peer"]
        if peers:
            best = min(peers, key=lambda r: r["median_ms"])
            x = ours["median_ms"] / best["median_ms"]
            # Also per repeat (every contender ran once in each repeat): ours over the faster peer
            # of that repeat, median over repeats. Cancels noise slower than a repeat.
            paired = statistics.median(
                o / min(p["all_ms"][i] for p in peers) for i, o in enumerate(ours["all_ms"])
            )
            ratios[task] = {"ours": ours["name"], "best_peer": best["name"], "ratio": x, "paired_ratio": paired,
                            "bar": bar, "met": x <= bar}  # fmt: skip
    by_kind = {r["kind"]: r for r in rows if r["task"] == "crc"}
    crc = {}
    if by_kind:
        base = by_kind["crc-base"]["median_ms"]
        sep, fus = by_kind["crc-separate"]["median_ms"] - base, by_kind["crc-fused"]["median_ms"] - base
        crc = {"adam_ms": base, "separate_extra_ms": sep, "fused_extra_ms": fus,
               "saved_frac": 1 - fus / sep if sep > 0 else None}  # fmt: skip
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": f"offloadpp bench adam --params {n} --repeats {args.repeats}"
        + (f" --threads {args.threads}" if args.threads else "")
        + (" --crc" if getattr(args, "crc", False) else ""),
        "crc": crc,
        "machine": _machine(),
        "config": {"params": n, "threads": threads, "repeats": args.repeats, "kernel": isa, "torch": torch_version,
                   "dtype": "fp32 params/grads/moments", "lr": 1e-3, "weight_decay": 0.01, "adamw": True},
        "results": rows,
        "ratios": ratios,
        "skipped": skipped,
    }  # fmt: skip


def _print_table(report: dict) -> None:
    m, cfg = report["machine"], report["config"]
    titles = {
        "fp32": "fp32 step",
        "bf16": "step + bf16 param copy",
        "crc": "CRC-32C of the state read and written",
    }
    print()
    print(f"{report['date']}  {m['cpu']} x{m['cpus']}, kernel {m['kernel']}")
    print(
        f"{cfg['params']:,} params, {cfg['threads']} threads, medians of {cfg['repeats']}, kernel {cfg['kernel']}"
    )
    head = f"{'':<36} {'B/param':>7} {'median ms':>10} {'Gparam/s':>9} {'GB/s':>7} {'x floor':>8}"
    for task in ("fp32", "bf16", "crc") if report["crc"] else ("fp32", "bf16"):
        print(f"\n{titles[task]:<36}" + head[36:])
        for r in report["results"]:
            if r["task"] != task:
                continue
            xf = f"{r['x_floor']:8.2f}" if "x_floor" in r else f"{'':8}"
            print(f"  {r['name']:<34} {r['bytes_per_param']:>7} {r['median_ms']:>10.1f} {r['gparams_per_s']:>9.2f} "
                  f"{r['gb_per_s']:>7.1f} {xf}")  # fmt: skip
    print()
    for task, x in report["ratios"].items():
        verdict = "met" if x["met"] else "NOT MET"
        print(f"{titles[task]}: {x['ours']} / {x['best_peer']} = {x['ratio']:.2f} (paired per repeat "
              f"{x['paired_ratio']:.2f}); bar <= {x['bar']:.1f}: {verdict}")  # fmt: skip
    if report["crc"]:
        c = report["crc"]
        print(f"CRC-32C over Adam's {c['adam_ms']:.1f} ms: separate passes +{c['separate_extra_ms']:.1f} ms, "
              f"in the Adam pass +{c['fused_extra_ms']:.1f} ms ({c['saved_frac']:.0%} of the separate passes' "
              "time saved)")  # fmt: skip
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")


def _main(argv: Optional[list] = None) -> int:  # python -m offloadpp.bench.adam
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(_main())
