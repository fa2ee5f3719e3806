"""`offloadpp bench step`: step time of the out-of-core runtime against in-memory torch.

Same model, same initial weights, same batches, in one process, alternating blocks of steps.

Contenders. "torch": the model in memory, torch.optim.AdamW (fused, or foreach: the faster,
measured in the warm-up). "offloadpp": OffloadEngine with the default settings, planned by the
resolve stage as offloadpp.initialize plans it: "auto" budgets with the state on SSD are the
streaming minimum, so every unit's weights, master and Adam moments live on SSD and are read and
written every step; `--budget default` instead gives it the budgets named by
--device-budget/--host-budget and lets the default plan keep what fits.

The floor of an offloadpp step is max(compute, SSD, Adam): compute is torch's forward+backward
time measured in the same run (the work any schedule must do), SSD is the step's bytes read and
written (from the store's counters) over the store's read and write bandwidth (measured here
on 256 MiB before training), Adam is one fused CPU Adam call over all parameters at the
runtime's Adam thread count (measured here, without contention). Warm-up steps are excluded;
the table shows medians. Bars: offloadpp <= 1.25x torch, <= 1.15x its floor.

Clipping (--clip): both contenders clip. offloadpp's updates run speculatively during backward
and are validated after it (docs/runtime.md); the model's gradient norms here start near 30 and
fall, so --clip 1.0 clips every step and the updates stay deferred, while a limit above the
norms (--clip 1000) never clips: every step after the first two (the warm-up) speculates and
validates. --vs-unclipped
adds offloadpp without clipping to the same run, for what clipping costs a step and the
optimizer's time after backward.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import time

from offloadpp.bench.harness import modelled_ssd_by_kind, steps_updates
from offloadpp.planner import traffic

BAR_VS_TORCH = 1.25
BAR_VS_FLOOR = 1.15


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-45m", help="model preset (offloadpp/presets.py)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per contender (after warm-up)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per contender first")
    p.add_argument("--block", type=int, default=3, help="steps per contender before switching")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both contenders)")
    p.add_argument(
        "--adam-threads",
        type=int,
        default=None,
        help="threads of offloadpp's CPU Adam (default: the runtime's)",
    )
    p.add_argument(
        "--prefetch-depth", type=int, default=None, help="weights prefetch depth k (default: plan's)"
    )
    p.add_argument(
        "--optim-prefetch-depth", type=int, default=None, help="optimizer read-ahead (default: plan's)"
    )
    p.add_argument(
        "--budget",
        choices=("stream", "default"),
        default="stream",
        help="stream: the default ('auto') budgets, all state on SSD (default); default: the given budgets",
    )
    p.add_argument("--device-budget", type=float, default=2e9, help="bytes, with --budget default")
    p.add_argument("--host-budget", type=float, default=4e9, help="bytes, with --budget default")
    p.add_argument("--dir", default=os.path.join("runs", "bench-step"), help="swap directory (removed after)")
    p.add_argument(
        "--strict",
        action="store_true",
        help="strict streaming: drop each unit's weights after every use even where the budget could keep them",
    )
    p.add_argument("--io-threads", type=int, default=1, help="I/O engine threads per swap directory")
    p.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="gradient clipping by global norm (both contenders); the model's norms here start near 30 and fall: "
        "a value above them (e.g. 1000) never clips, so offloadpp's updates run speculatively and validate",
    )
    p.add_argument(
        "--speculate",
        choices=("auto", "on", "off"),
        default="auto",
        help="offloadpp's speculative updates with --clip (Settings.speculate)",
    )
    p.add_argument(
        "--vs-unclipped",
        action="store_true",
        help="with --clip: also run offloadpp without clipping, alternating with the others: the step and the "
        "optimizer time after backward that clipping costs, in one run",
    )
    p.add_argument(
        "--checksum-cost",
        action="store_true",
        help="also run offloadpp with payload checksums off, alternating with the others: the cost of CRC-32C",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"host": platform.node(), "kernel": platform.release(), "cpu": cpu, "cpus": os.cpu_count()}


def _measure_ssd(store, nbytes: int = 256 << 20) -> tuple[float, float]:
    from offloadpp.io import measure_ssd

    best_r = best_w = 0.0
    for _ in range(2):
        r, w = measure_ssd(store, total_bytes=nbytes)
        best_r, best_w = max(best_r, r), max(best_w, w)
    return best_r, best_w


def _adam_seconds(numel: int, threads: int) -> float:
    import torch

    from offloadpp.optim import AdamHyper, AdamStep, adam_step_flat

    bufs = [torch.full((numel,), 0.01) for _ in range(4)]
    times = []
    for step in range(1, 4):
        t0 = time.perf_counter()
        adam_step_flat(*bufs, AdamStep(step=step, hyper=AdamHyper(lr=1e-4), num_threads=threads))
        times.append(time.perf_counter() - t0)
    return min(times)


def run(args: argparse.Namespace) -> int:
    import copy

    import torch
    from tqdm import tqdm
    from transformers import GPT2LMHeadModel

    from offloadpp.assemble import assemble_engine
    from offloadpp.io import IOConfig, TensorStore
    from offloadpp.optim import AdamHyper, default_num_threads
    from offloadpp.planner import Settings
    from offloadpp.presets import get_preset
    from offloadpp.runtime import RuntimeConfig

    torch.set_num_threads(args.threads)
    preset = get_preset(args.model)
    torch.manual_seed(args.seed)
    ref = GPT2LMHeadModel(preset.gpt2_config())
    n_params = sum(p.numel() for p in ref.parameters())
    model = copy.deepcopy(ref)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    try:
        with TensorStore([args.dir]) as probe:
            read_gbps, write_gbps = _measure_ssd(probe)
        if args.adam_threads is None:
            args.adam_threads = default_num_threads()  # the runtime's default
        adam_s = _adam_seconds(n_params, args.adam_threads)
        _log(
            f"SSD read {read_gbps:.2f} GB/s, write {write_gbps:.2f} GB/s; Adam over {n_params:,} params "
            f"{adam_s * 1e3:.1f} ms ({args.adam_threads} thread(s))"
        )
        lr = 1e-4
        budgets = {}
        if args.budget == "default":
            budgets = dict(
                device_budget_bytes=int(args.device_budget), host_budget_bytes=int(args.host_budget)
            )
        settings = Settings(
            prefetch_depth=args.prefetch_depth,
            optim_prefetch_depth=args.optim_prefetch_depth,
            adam_threads=args.adam_threads,
            gradient_clipping=args.clip,
            speculate=args.speculate,
            fill_gaps=not args.strict,  # strict: drop every unit's weights after each use
            **budgets,
        )
        cfg = RuntimeConfig(
            nvme_paths=[args.dir],
            settings=settings,
            device="cpu",
            io=IOConfig(num_threads=args.io_threads),
            ssd_read_gbps=read_gbps,
            ssd_write_gbps=write_gbps,
            log_every=0,
        )
        nocrc_model = copy.deepcopy(model) if args.checksum_cost else None
        unclipped_model = copy.deepcopy(model) if args.vs_unclipped and args.clip else None
        engine = assemble_engine(model, cfg, hyper=AdamHyper(lr=lr))
        _log(engine.plan.describe())
        engines = {"offloadpp": engine}
        if args.checksum_cost:  # the same run, payload checksums off: what CRC-32C costs a step
            d2 = os.path.join(args.dir, "nocrc")
            os.makedirs(d2)
            cfg2 = cfg.model_copy(
                update={"nvme_paths": (d2,), "io": cfg.io.model_copy(update={"checksum": False})}
            )
            engines["offloadpp, no checksum"] = assemble_engine(nocrc_model, cfg2, hyper=AdamHyper(lr=lr))
        if unclipped_model is not None:  # the same run without clipping: what clipping costs a step
            d3 = os.path.join(args.dir, "noclip")
            os.makedirs(d3)
            cfg3 = cfg.model_copy(
                update={
                    "nvme_paths": (d3,),
                    "settings": settings.model_copy(update={"gradient_clipping": 0.0}),
                }
            )
            engines["offloadpp, no clipping"] = assemble_engine(unclipped_model, cfg3, hyper=AdamHyper(lr=lr))
        g = torch.Generator().manual_seed(args.seed + 1)
        data = [
            torch.randint(0, preset.vocab_size, (preset.micro_batch, preset.seq_len), generator=g)
            for _ in range(8)
        ]
        opts = {
            "fused": torch.optim.AdamW(ref.parameters(), lr=lr, fused=True),
            "foreach": torch.optim.AdamW(ref.parameters(), lr=lr, foreach=True),
        }
        rows = {"torch": [], **{name: [] for name in engines}}
        state = {"i": 0, "opt": "fused", "torch_fb": [], "reports": [], "opt_times": {k: [] for k in opts},
                 "unclipped": []}  # fmt: skip

        def torch_step(timed: bool) -> None:
            x = data[state["i"] % len(data)]
            state["i"] += 1
            t0 = time.perf_counter()
            ref(input_ids=x, labels=x).loss.backward()
            t1 = time.perf_counter()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), args.clip)
            o = opts[state["opt"]]
            o.step()
            o.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if timed:
                rows["torch"].append(t2 - t0)
                state["torch_fb"].append(t1 - t0)
            else:
                state["opt_times"][state["opt"]].append(t2 - t1)

        def engine_step(timed: bool, name: str = "offloadpp") -> None:
            e = engines[name]
            x = data[state["i"] % len(data)]
            state["i"] += 1
            t0 = time.perf_counter()
            e.backward(e(input_ids=x, labels=x).loss)
            r = e.step()
            t1 = time.perf_counter()
            if timed:
                rows[name].append(t1 - t0)
                if name == "offloadpp":
                    state["reports"].append(r)
                elif name == "offloadpp, no clipping":
                    state["unclipped"].append(r)

        for name in ("fused", "foreach"):  # warm-up: both torch optimizers, keep the faster
            state["opt"] = name
            for _ in range(args.warmup):
                torch_step(False)
        x = data[0]
        ref(input_ids=x, labels=x).loss.backward()  # grads for a few optimizer-only steps
        for _ in range(5):
            for name, o in opts.items():
                t0 = time.perf_counter()
                o.step()
                state["opt_times"][name].append(time.perf_counter() - t0)
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        state["opt"] = min(opts, key=lambda k: min(state["opt_times"][k]))
        for name in engines:
            for _ in range(args.warmup):
                engine_step(False, name)
        contenders = [("torch", torch_step)] + [(n, functools.partial(engine_step, name=n)) for n in engines]
        with tqdm(total=len(contenders) * args.steps, desc="bench step", file=sys.stderr) as bar:
            while any(len(rows[n]) < args.steps for n, _ in contenders):
                for name, fn in contenders:
                    for _ in range(min(args.block, args.steps - len(rows[name]))):
                        fn(True)
                        bar.update(1)
        for e in engines.values():
            e.close()
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    report = _summarise(args, preset, n_params, rows, state, (read_gbps, write_gbps), adam_s, engine)
    _print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["pass"] else 1


def _summarise(args, preset, n_params, rows, state, ssd_gbps: tuple[float, float], adam_s, engine) -> dict:
    """The report of a run; ssd_gbps: the SSD's (read, write) GB/s measured at the start."""
    read_gbps, write_gbps = ssd_gbps
    med = statistics.median
    reps = state["reports"]
    torch_step = med(rows["torch"])
    ours = med(rows["offloadpp"])
    compute = med(state["torch_fb"])
    ssd_read = med(r.ssd_read_bytes for r in reps)
    ssd_write = med(r.ssd_write_bytes for r in reps)
    ssd_s = ssd_read / (read_gbps * 1e9) + ssd_write / (write_gbps * 1e9)
    floor = max(compute, ssd_s, adam_s)
    modelled = modelled_ssd_by_kind(engine, preset.gpt2_config().to_dict(), steps_updates(reps))
    report = {
        "bench": "step",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "offloadpp bench step "
        + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "step"] else sys.argv[1:]),
        "machine": _machine(),
        "config": {
            "model": preset.name,
            "params": n_params,
            "batch": [preset.micro_batch, preset.seq_len],
            "threads": args.threads,
            "adam_threads": args.adam_threads,
            "steps": args.steps,
            "warmup": args.warmup,
            "block": args.block,
            "budget": args.budget,
            "clip": args.clip,
            "speculate": args.speculate,
            "io_threads": args.io_threads,
            "strict": args.strict,
            "plan": engine.plan.describe(),
            "torch_optimizer": f"AdamW({state['opt']}=True)",
        },
        "torch": {
            "step_s": torch_step,
            "fwd_bwd_s": compute,
            "optimizer_step_s": {k: min(v) for k, v in state["opt_times"].items()},
            "steps": rows["torch"],
        },
        "offloadpp": {
            "step_s": ours,
            "forward_s": med(r.forward_s for r in reps),
            "backward_s": med(r.backward_s for r in reps),
            "optimizer_wait_s": med(r.optimizer_wait_s for r in reps),
            "fetch_wait_s": med(r.fetch_wait_s for r in reps),
            "adam_s_in_run": med(r.adam_s for r in reps),
            "optimizer_exposed_s": med(r.optimizer_exposed_s for r in reps),
            "updates": {m: sum(r.updates == m for r in reps) for m in sorted({r.updates for r in reps})},
            "redone_steps": sum(r.redone_units > 0 for r in reps),
            "grad_norm_max": max((r.grad_norm for r in reps if r.grad_norm is not None), default=None),
            "ssd_read_bytes": ssd_read,
            "ssd_write_bytes": ssd_write,
            # by kind, counted at the I/O calls; beside it the cost model's for the same plan
            "ssd_by_kind": traffic.median(r.ssd_by_kind for r in reps),
            "modelled_ssd_by_kind": modelled[0],
            "modelled_from": modelled[1],
            "steps": rows["offloadpp"],
        },
        "floor": {
            "compute_s": compute,
            "ssd_s": ssd_s,
            "adam_s": adam_s,
            "floor_s": floor,
            "ssd_read_gbps": read_gbps,
            "ssd_write_gbps": write_gbps,
        },
        "ratio_vs_torch": ours / torch_step,
        # the same ratio step by step (each offloadpp step over the torch step of the same index,
        # which ran within a block or two of it): less sensitive to load that drifts over the run
        "paired_ratio_vs_torch": med(o / t for o, t in zip(rows["offloadpp"], rows["torch"])),
        "ratio_vs_floor": ours / floor,
    }
    if "offloadpp, no checksum" in rows:
        nocrc = med(rows["offloadpp, no checksum"])
        report["no_checksum_step_s"] = nocrc
        report["no_checksum_steps"] = rows["offloadpp, no checksum"]
        report["checksum_cost"] = ours / nocrc - 1.0
        # step by step, as paired_ratio_vs_torch: the load drifts less between neighbours
        report["checksum_cost_paired"] = (
            med(o / n for o, n in zip(rows["offloadpp"], rows["offloadpp, no checksum"])) - 1.0
        )
    if state["unclipped"]:
        un = state["unclipped"]
        exposed = med(r.optimizer_exposed_s for r in un)
        report["unclipped"] = {
            "step_s": med(rows["offloadpp, no clipping"]),
            "optimizer_exposed_s": exposed,
            "steps": rows["offloadpp, no clipping"],
            "step_ratio": ours / med(rows["offloadpp, no clipping"]),
            "exposed_ratio": report["offloadpp"]["optimizer_exposed_s"] / exposed,
        }
    report["pass"] = report["ratio_vs_torch"] <= BAR_VS_TORCH and report["ratio_vs_floor"] <= BAR_VS_FLOOR
    return report


def _print_table(r: dict) -> None:
    c, o, f = r["config"], r["offloadpp"], r["floor"]
    gb = 1e9
    print(
        f"# bench step: {c['model']} ({c['params'] / 1e6:.1f}M params, batch {c['batch'][0]}x{c['batch'][1]}, fp32), "
        f"{r['machine']['cpu']} x{r['machine']['cpus']}, {r['date']}"
    )
    print(
        f"# {c['steps']} timed steps each after {c['warmup']} warm-up, alternating blocks of {c['block']}; "
        f"torch threads {c['threads']}, Adam threads {c['adam_threads']}; medians"
    )
    print(
        "| contender | step s | vs torch | vs floor | fwd s | bwd s | opt wait s | fetch wait s | SSD read | SSD write |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| torch {c['torch_optimizer']} (in memory) | {r['torch']['step_s']:.3f} | 1.00 | "
        f"{r['torch']['step_s'] / f['floor_s']:.2f} | | | | | | |"
    )
    print(
        f"| offloadpp (all state on SSD) | {o['step_s']:.3f} | {r['ratio_vs_torch']:.2f} | {r['ratio_vs_floor']:.2f} | "
        f"{o['forward_s']:.3f} | {o['backward_s']:.3f} | {o['optimizer_wait_s']:.3f} | {o['fetch_wait_s']:.3f} | "
        f"{o['ssd_read_bytes'] / gb:.2f} GB | {o['ssd_write_bytes'] / gb:.2f} GB |"
    )
    print(
        f"\nfloor {f['floor_s']:.3f} s = max(compute {f['compute_s']:.3f} s [torch fwd+bwd], "
        f"SSD {f['ssd_s']:.3f} s [{f['ssd_read_gbps']:.2f} GB/s read, {f['ssd_write_gbps']:.2f} GB/s write], "
        f"Adam {f['adam_s']:.3f} s)"
    )
    print(f"paired (step by step) ratio vs torch: {r['paired_ratio_vs_torch']:.2f}")
    if c["clip"]:
        ups = ", ".join(f"{n} {m}" for m, n in o["updates"].items())
        print(
            f"clip {c['clip']:g} (speculate {c['speculate']}): timed steps' updates {ups}, {o['redone_steps']} redone; "
            f"largest grad norm {o['grad_norm_max']:.4g}; optimizer exposed after backward {o['optimizer_exposed_s']:.4f} s"
        )
    else:
        print(f"optimizer exposed after backward {o['optimizer_exposed_s']:.4f} s")
    if "unclipped" in r:
        u = r["unclipped"]
        print(f"the same run without clipping: step {u['step_s']:.3f} s, optimizer exposed after backward "
              f"{u['optimizer_exposed_s']:.4f} s; with clip {c['clip']:g}: step x{u['step_ratio']:.3f}, "
              f"optimizer exposed x{u['exposed_ratio']:.2f}")  # fmt: skip
    if o.get("ssd_by_kind"):
        print(f"SSD bytes of a step by kind (medians), the cost model's from {o['modelled_from']}:")
        print(traffic.table(o["ssd_by_kind"], o["modelled_ssd_by_kind"]))
    if "checksum_cost" in r:
        print(f"payload CRC-32C (io.checksum, the default): {r['checksum_cost']:+.1%} on the step "
              f"({o['step_s']:.3f} s with, {r['no_checksum_step_s']:.3f} s without, alternating blocks; "
              f"paired step by step {r['checksum_cost_paired']:+.1%})")  # fmt: skip
    print(f"bars: <= {BAR_VS_TORCH}x torch, <= {BAR_VS_FLOOR}x floor: {'PASS' if r['pass'] else 'FAIL'}")


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="offloadpp bench step", description=__doc__.splitlines()[0])
    add_arguments(_p)
    sys.exit(run(_p.parse_args()))
