"""The automatic plan against a grid of hand-written plans for the same model and budgets.

    offloadpp bench planner-grid [--dir runs/planner-grid] [--json out.json]

Hand-written plans: what a user tuning ZeRO-Infinity-style knobs by hand would try (every array on
SSD at several prefetch depths; the default policy; keep the moments first, or the masters, or
the last units first; deeper read-ahead), each made to fit the same device and host budgets.
The automatic plan is the resolve stage's (plan "auto"), as offloadpp.initialize would run it.
All plans and the automatic one train the same model from the same weights in one process,
interleaved in blocks (offloadpp/bench/harness.py), so they see the same machine; the table
shows median step times. Bar: auto <= 1.05 x the best hand-written plan.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import replace

BAR = 1.05


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fill(base, order, arrays, budget):
    """Keeps `arrays` ("master", "moments") of units in `order` in memory while the budgets allow."""
    from offloadpp.planner import Tier, build_schedule

    plan = base
    cpu = base.device == "cpu" and base.compute_dtype == "fp32"  # (the master is the weights)
    for what in arrays:
        for name in order:
            i = [u.name for u in plan.units].index(name)
            p = plan.placements[i]
            if what == "master" and p.master is Tier.SSD:
                new = replace(p, master=Tier.HOST, weights=Tier.DEVICE if cpu else Tier.HOST)
            elif what == "moments" and p.moments is Tier.SSD:
                new = replace(p, moments=Tier.HOST)
            else:
                continue
            cand = replace(plan, placements=plan.placements[:i] + (new,) + plan.placements[i + 1 :])
            s = build_schedule(cand)
            if s.peak_device_bytes <= budget.device_bytes and s.peak_host_bytes <= budget.host_bytes:
                plan = cand
    return plan


def hand_plans(
    specs, budget, *, settings=None, device: str = "cpu", fit: bool = True
) -> list[tuple[str, object]]:
    """budget: planner.Budgets, which every hand plan must fit (fit=False: the plans as made,
    whether they fit or not). settings: the run's (its compute dtype, deferral, speculation),
    else fp32 compute on the CPU as the device, as this benchmark runs."""
    from offloadpp.planner import PlanError, Settings, build_schedule, default_plan, streaming_plan
    from offloadpp.planner.default import plan_shape

    if settings is None:
        common = dict(device="cpu", compute_dtype="fp32", budgets=budget)
        settings = Settings()
    else:
        common = dict(device=device, budgets=budget, **plan_shape(settings))

    def dflt(**kw):
        try:
            return default_plan(specs, device=device, settings=settings.model_copy(update=kw), budgets=budget)
        except PlanError:
            if fit:
                raise
            return None  # (nothing of the default rule fits these budgets: no such plan to try)

    fwd = [u.name for u in specs]
    bwd = list(reversed(fwd))
    out = []

    def stream(k, q):
        return streaming_plan(specs, prefetch_depth=k, optim_prefetch_depth=q, **common)

    out.append(("all on SSD, k=2 q=2", stream(2, 2)))
    out.append(("all on SSD, k=0 q=0", stream(0, 0)))
    out.append(("default policy", dflt()))
    out.append(("default policy, k=1 q=1", dflt(prefetch_depth=1, optim_prefetch_depth=1)))
    out.append(("moments first, k=2 q=2", _fill(stream(2, 2), fwd, ("moments", "master"), budget)))
    out.append(("masters only, k=2 q=1", _fill(stream(2, 1), fwd, ("master",), budget)))
    out.append(("last units first, k=1 q=1", _fill(stream(1, 1), bwd, ("master", "moments"), budget)))
    out.append(("forward fill, k=1 q=2", _fill(stream(1, 2), fwd, ("master", "moments"), budget)))
    out.append(("moments only, k=0 q=0", _fill(stream(0, 0), fwd, ("moments",), budget)))
    out = [(label, p) for label, p in out if p is not None]
    for label, p in out if fit else ():
        s = build_schedule(p)
        if s.peak_device_bytes > budget.device_bytes or s.peak_host_bytes > budget.host_bytes:
            raise RuntimeError(f"hand plan {label!r} does not fit the budgets")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir", default=os.path.join("runs", "planner-grid"), help="swap directory (removed after)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--budget-frac",
        type=float,
        default=0.2,
        help="budget beyond the streaming working set, as a fraction of the model's fp32 master+moments",
    )
    p.add_argument("--rounds", type=int, default=16, help="rounds (--block steps per plan each)")
    p.add_argument("--block", type=int, default=4, help="steps per plan per round (the first not counted)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")


def run(args: argparse.Namespace) -> int:
    import torch

    from offloadpp.bench.harness import (
        Contender,
        GPT2Shape,
        close_all,
        make_engines,
        merge_profiles,
        quick_hardware,
        run_interleaved,
        with_ssd,
    )  # fmt: skip
    from offloadpp.planner import Budgets, Machine, Settings, build_schedule, resolve, streaming_plan
    from offloadpp.planner.activations import act_units, need_bytes
    from offloadpp.planner.cost import estimate
    from offloadpp.profiling.model import profile_model

    torch.set_num_threads(args.threads)
    shape = GPT2Shape(args.layers, args.width, micro_batch=args.batch, seq_len=args.seq_len)
    model, batch = shape.build(), shape.batch()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    t0 = time.perf_counter()
    contenders = []
    try:
        prof = profile_model(model, batch, repeats=3, name=shape.label)
        # contention measured with this model's GEMMs, as `offloadpp profile --model` does
        hw = quick_hardware([args.dir], log=_log, gemms=prof.gemms)
        specs = prof.unit_specs()
        # the budgets start where every hand-written plan's streaming working set fits (k = q = 2)
        need = build_schedule(streaming_plan(specs, device="cpu", compute_dtype="fp32", prefetch_depth=2,
                                             optim_prefetch_depth=2))  # fmt: skip
        state = sum(u.padded_numel for u in specs) * 12
        extra = int(args.budget_frac * state)
        budget = Budgets(need.peak_device_bytes + extra // 3, need.peak_host_bytes + extra)
        # the activations count in the device budget: the hand-written plans keep them all on
        # top of their buffers, and so does the automatic one here
        room = need_bytes(act_units(prof), {})
        settings = Settings(device_budget_bytes=budget.device_bytes + room, host_budget_bytes=budget.host_bytes,
                            adam_threads=1, plan="auto",
                            activations={"policy": "keep", "budget_bytes": room})  # fmt: skip
        auto = resolve(
            settings, specs, Machine("cpu", hw.host_memory_bytes, cores=1), hardware=hw, model=prof
        )
        _log(f"auto plan: {'; '.join(auto.plan.notes)}")
        contenders = [Contender("auto", auto.plan)] + [
            Contender(lbl, pl) for lbl, pl in hand_plans(specs, budget)
        ]
        make_engines(model, contenders, args.dir, ssd_gbps=(hw.ssd_read_gbps, hw.ssd_write_gbps))
        res = run_interleaved(contenders, model, batch, rounds=args.rounds, block=args.block, probe_dirs=[args.dir],
                              name=shape.label, log=_log)  # fmt: skip
    finally:
        close_all(contenders)
        shutil.rmtree(args.dir, ignore_errors=True)
    med = statistics.median
    prof_med = merge_profiles(res.profiles)
    hw_run = with_ssd(hw, med(res.ssd_gbps))  # for the table: the SSD as it was during the run
    rows = []
    for c in contenders:
        e0 = estimate(c.plan, hw, prof)
        e = estimate(c.plan, hw_run, prof_med)
        rows.append({"plan": c.name, "k": c.plan.prefetch_depth, "q": c.plan.optim_prefetch_depth,
                     "ssd_bytes": c.plan.ssd_bytes(), "estimate_at_plan_time_s": e0.step_s,
                     "estimate_s": e.step_s, "measured_s": med(c.times), "steps": c.times})  # fmt: skip
    best_hand = min(r["measured_s"] for r in rows[1:])
    auto_s = rows[0]["measured_s"]
    report = {
        "bench": "planner_grid",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "offloadpp bench planner-grid " + " ".join(sys.argv[3:]),
        "model": shape.label, "params": prof.numel,
        "budget": {"device_bytes": budget.device_bytes, "host_bytes": budget.host_bytes},
        "hardware": hw.to_dict(), "rows": rows, "auto_over_best_hand": auto_s / best_hand,
        "wall_s": time.perf_counter() - t0, "pass": auto_s <= BAR * best_hand,
    }  # fmt: skip
    print(f"# planner grid: {shape.label} ({prof.numel / 1e6:.1f}M params), budgets device "
          f"{budget.device_bytes / 2**20:.0f} MiB, host {budget.host_bytes / 2**20:.0f} MiB; {report['date']}")  # fmt: skip
    print(
        f"# command: {report['command']}; {args.rounds} rounds x {args.block - 1} timed steps per plan, medians"
    )
    print(
        "# estimated: at plan time (the profiles the planner saw) / with the run's SSD probes and unit times"
    )
    print("| plan | k | q | state on SSD | estimated s | measured s | vs best hand |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['plan']} | {r['k']} | {r['q']} | {r['ssd_bytes'] / 2**20:.0f} MiB | "
              f"{r['estimate_at_plan_time_s']:.3f} / {r['estimate_s']:.3f} | {r['measured_s']:.3f} | "
              f"{r['measured_s'] / best_hand:.2f} |")  # fmt: skip
    print(f"\nauto / best hand-written = {report['auto_over_best_hand']:.3f}; bar <= {BAR}: "
          f"{'PASS' if report['pass'] else 'FAIL'}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="offloadpp bench planner-grid", description=__doc__.splitlines()[0])
    add_arguments(_p)
    sys.exit(run(_p.parse_args()))
