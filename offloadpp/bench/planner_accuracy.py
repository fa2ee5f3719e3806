"""The cost model against real steps: predicted vs measured step time on several configurations.

    offloadpp bench planner-accuracy [--dir runs/planner-acc] [--json out.json] [--only NAME ...]

Each configuration (model size x budget x plan x activation policy) is trained for a few rounds
with the OffloadEngine on the CPU as the device; the prediction is the cost model's estimate of
the same plan from a hardware profile and a model profile measured in the same run. Bar: every
|predicted - measured| / measured <= 15%.

Note: how the two numbers are paired on a shared machine. The hardware profile (SSD alone and
mixed, FLOP/s, Adam, contention, the runtime's per-visit cost) is measured once at the start; its
mixed-while-busy SSD rate is probed again after every round of a configuration and the median of
those probes is used for it (the disk and the cores are shared with whatever else runs). The
model profile's per-unit times come from a plain copy of the model run once right before each
block of training steps (offloadpp/bench/harness.py), so a prediction and its measurement see
the same load. Per round: predicted = estimate(plan, hardware, the round's model profile),
measured = the median of the block's steps (its first step is not counted). The table shows
medians over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, replace

from offloadpp.planner.decide import PREDICTION_ERROR

BAR = PREDICTION_ERROR  # (the planner holds the updates' overlap to it: decide.overlap_pays)
MEASURE_S = 12.0


@dataclass(frozen=True)
class Config:
    name: str
    n_layer: int
    n_embd: int
    micro_batch: int
    seq_len: int
    budget: str  # "stream": every array on SSD (k=2, q=2); "tight"/"half"/"ample": the planner's plan
    clip: float = 0.0
    activations: str = "keep"


CONFIGS = (
    Config("s-stream", 2, 256, 2, 64, "stream"),
    Config("s-ample", 2, 256, 2, 64, "ample"),
    Config("m-stream", 4, 512, 1, 64, "stream"),
    Config("m-tight", 4, 512, 1, 64, "tight"),
    Config("m-half", 4, 512, 2, 128, "half"),
    Config("m-clip", 4, 512, 1, 64, "tight", clip=1.0),
    Config("l-tight", 6, 768, 1, 64, "tight"),
    Config("l-ample", 6, 768, 2, 128, "ample"),
    Config("m-act-ssd", 4, 512, 2, 128, "tight", activations="ssd"),
    Config("m-recompute", 4, 512, 2, 128, "half", activations="recompute"),
    Config("m-act-host", 4, 512, 2, 128, "half", activations="host"),
)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _machine() -> dict:
    from offloadpp.profiling.hardware import _cpu_name

    return {"host": platform.node(), "cpu": _cpu_name(), "cpus": os.cpu_count(), "kernel": platform.release()}


def budgets_for(kind: str, specs, deferred: bool) -> tuple[int, int]:
    from offloadpp.planner import build_schedule, streaming_plan

    s = build_schedule(streaming_plan(specs, device="cpu", compute_dtype="fp32", prefetch_depth=2,
                                      optim_prefetch_depth=2, deferred_update=deferred))  # fmt: skip
    state = sum(u.padded_numel for u in specs) * 16  # master + moments + grads, fp32
    extra = {"stream": 0, "tight": 0, "half": state // 2, "ample": 2 * state}[kind]
    return s.peak_device_bytes + extra // 4, s.peak_host_bytes + extra


def make_plan(cfg: Config, hw, profile, specs):
    """The plan the resolve stage makes for the configuration: "stream" is the default plan at
    the streaming minimum (every array on SSD, k = q = 2), the others the cost-model planner's."""
    from offloadpp.planner import ActivationSettings, Machine, Settings, resolve
    from offloadpp.planner.activations import act_units, need_bytes

    dev, host = budgets_for(cfg.budget, specs, cfg.clip > 0)
    # the activations count in the device budget: room for keeping them all on top of the
    # configuration's buffers, so each policy runs without waiting for its copies
    room = need_bytes(act_units(profile), {})
    dev += room
    overrides = {}
    if cfg.activations != "keep":  # the blocks' activations (the embeddings and the head keep theirs)
        overrides = {u.name: cfg.activations for u in specs if ".h." in u.name}
    acts = ActivationSettings(policy="keep", overrides=overrides, budget_bytes=room)
    stream = cfg.budget == "stream"
    settings = Settings(
        device_budget_bytes=dev, host_budget_bytes=host, gradient_clipping=cfg.clip, adam_threads=1,
        activations=acts, plan="default" if stream else "auto",
        prefetch_depth=2 if stream else None, optim_prefetch_depth=2 if stream else None,
    )  # fmt: skip
    machine = Machine("cpu", host_available_bytes=hw.host_memory_bytes, cores=1)
    return resolve(settings, specs, machine, hardware=hw, model=profile).plan


def plan_summary(plan) -> str:
    from offloadpp.planner import Tier

    n = len(plan.placements)
    kept_master = sum(p.master is Tier.HOST for p in plan.placements)
    kept_moments = sum(p.moments is Tier.HOST for p in plan.placements)
    return f"k={plan.prefetch_depth} q={plan.optim_prefetch_depth} master {kept_master}/{n} moments {kept_moments}/{n} in RAM"


def run_config(cfg: Config, hw, root: str, rounds: int) -> dict:
    import torch  # noqa: F401

    from offloadpp.bench.harness import (
        Contender,
        GPT2Shape,
        close_all,
        make_engines,
        run_interleaved,
        with_ssd,
    )
    from offloadpp.planner.cost import estimate
    from offloadpp.profiling.hardware import measure_contention, measure_io_contention
    from offloadpp.profiling.model import profile_model

    shape = GPT2Shape(cfg.n_layer, cfg.n_embd, micro_batch=cfg.micro_batch, seq_len=cfg.seq_len)
    model, batch = shape.build(), shape.batch()
    first = profile_model(model, batch, repeats=2, name=shape.label)
    specs = first.unit_specs()
    # how much Adam and the SSD's traffic slow this model's own GEMMs (small shapes suffer more
    # than the profile's default ones), as `offloadpp profile --model` measures them
    slow_c, slow_a = measure_contention(first.gemms, adam_threads=1)
    io_slow = measure_io_contention([root], first.gemms)
    hw = replace(hw, compute_slowdown_under_adam=slow_c, adam_slowdown_under_compute=slow_a,
                 compute_slowdown_under_io=io_slow)  # fmt: skip
    plan = make_plan(cfg, hw, first, specs)
    # Short steps are the most exposed to the machine's load: give every configuration about
    # MEASURE_S seconds of timed steps (3 per round), within the rounds asked for and 3x that.
    step_s = estimate(plan, hw, first).step_s
    rounds = max(rounds, min(3 * rounds, math.ceil(MEASURE_S / (3 * step_s))))
    c = Contender(cfg.name, plan)
    d = os.path.join(root, cfg.name)
    try:
        make_engines(
            model, [c], d, ssd_gbps=(hw.ssd_read_gbps, hw.ssd_write_gbps), gradient_clipping=cfg.clip
        )
        res = run_interleaved([c], model, batch, rounds=rounds, block=3, probe_dirs=[d], name=shape.label)
    finally:
        close_all([c])
        shutil.rmtree(d, ignore_errors=True)
    hw_cfg = with_ssd(hw, statistics.median(res.ssd_gbps))
    preds, ests = [], []
    for prof in res.profiles:
        e = estimate(plan, hw_cfg, prof)
        preds.append(e.step_s)
        ests.append(e)
    med = statistics.median
    measured = med(c.times)
    predicted = med(preds)
    e = ests[preds.index(sorted(preds)[len(preds) // 2])]
    reps = c.reports
    return {
        "config": cfg.name, "model": shape.label, "params": first.numel, "budget": cfg.budget, "n_rounds": rounds,
        "activations": cfg.activations, "clip": cfg.clip, "plan": plan_summary(plan), "bound": e.bound,
        "predicted_s": predicted, "measured_s": measured, "error": abs(predicted - measured) / measured,
        "rounds": [{"predicted_s": p, "measured_s": med(t)} for p, t in zip(preds, c.round_times)],
        "ssd_mixed_busy_gbps": res.ssd_gbps, "compute_slowdown_under_io": io_slow,
        "compute_slowdown_under_adam": slow_c, "adam_slowdown_under_compute": slow_a,
        "predicted": {"forward_s": e.forward_s, "backward_s": e.backward_s, "optimizer_wait_s": e.optimizer_wait_s,
                      "ssd_read_bytes": e.ssd_read_bytes, "ssd_write_bytes": e.ssd_write_bytes},
        "measured": {"forward_s": med(x.forward_s for x in reps), "backward_s": med(x.backward_s for x in reps),
                     "optimizer_wait_s": med(x.optimizer_wait_s for x in reps),
                     "fetch_wait_s": med(x.fetch_wait_s for x in reps), "compute_s": med(x.compute_s for x in reps),
                     "ssd_read_bytes": med(x.ssd_read_bytes for x in reps),
                     "ssd_write_bytes": med(x.ssd_write_bytes for x in reps)},
    }  # fmt: skip


def print_table(report: dict) -> None:
    print(f"# planner accuracy: {report['machine']['cpu']} x{report['machine']['cpus']}, {report['date']}")
    print(f"# command: {report['command']}")
    print(
        "| config | model | params | budget | activations | plan | bound | predicted s | measured s | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        clip = " clip" if r["clip"] else ""
        print(f"| {r['config']} | {r['model']} | {r['params'] / 1e6:.1f}M | {r['budget']}{clip} | {r['activations']} | "
              f"{r['plan']} | {r['bound']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['error']:.1%} |")  # fmt: skip
    worst = max(r["error"] for r in report["rows"])
    print(f"\nworst error {worst:.1%}; bar <= {BAR:.0%} each: {'PASS' if report['pass'] else 'FAIL'}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir", default=os.path.join("runs", "planner-acc"), help="swap directory (removed after)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--rounds", type=int, default=8, help="rounds per configuration (3 steps each)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: compute, Adam and I/O threads fit the 2 cores here)",
    )
    p.add_argument("--only", nargs="*", help="configuration names to run (default: all)")


def run(args: argparse.Namespace) -> int:
    import torch

    from offloadpp.bench.harness import quick_hardware

    torch.set_num_threads(args.threads)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    t0 = time.perf_counter()
    try:
        hw = quick_hardware([args.dir], log=_log)
        rows = []
        for cfg in CONFIGS:
            if args.only and cfg.name not in args.only:
                continue
            _log(f"config {cfg.name} ...")
            row = run_config(cfg, hw, args.dir, args.rounds)
            _log(
                f"  predicted {row['predicted_s']:.3f} s, measured {row['measured_s']:.3f} s, error {row['error']:.1%}"
            )
            rows.append(row)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    report = {
        "bench": "planner_accuracy",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "offloadpp bench planner-accuracy " + " ".join(sys.argv[3:]),
        "machine": _machine(),
        "hardware": hw.to_dict(),
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
        "pass": all(r["error"] <= BAR for r in rows),
    }
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="offloadpp bench planner-accuracy", description=__doc__.splitlines()[0])
    add_arguments(_p)
    sys.exit(run(_p.parse_args()))
