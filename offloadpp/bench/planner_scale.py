"""The planner at the paper's scale: estimates and planning time for GPT-3 13B and 175B on a
hand-written profile of the Fuyou paper's machine (docs/planner.md, "At the paper's scale").

    offloadpp bench planner-scale [--hardware docs/paper/rtx4090-12ssd.hardware.json]
        [--config docs/paper/ds_config.json] [--dtype fp16,bf16] [--repeats 3] [--json out.json]
        [--only 13b] [--batches 32,48,64,128]

For each model and micro-batch (sequence 1024) the resolve stage plans as `offloadpp plan
--machine-from-hardware` does (the DeepSpeed config's settings, the profile's memory, cores and
SSD space), with the units of the model's analytic profile (the runtime's units:
tests/test_profiling.py); a configuration that cannot fit is shown refused with the largest
micro-batch that would. Planning time is the resolve stage's CPU time (process time: on a shared
machine the wall clock measures the neighbours), median of --repeats runs, on this machine (its
wall time too, in the JSON); model TFLOPS count the forward and backward FLOPs of the profile (not the recompute)
over every micro-batch of the step (a config with gradient_accumulation_steps G: G of them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

from offloadpp.planner.activations import POLICIES

PAPER = os.path.join("docs", "paper")
RUNS = (("13b", (8, 16, 32, 64, 128)), ("175b", (8, 16, 32, 64)))
SEQ_LEN = 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default=os.path.join(PAPER, "rtx4090-12ssd.hardware.json"))
    p.add_argument("--config", default=os.path.join(PAPER, "ds_config.json"), help="DeepSpeed config")
    p.add_argument(
        "--models", default=PAPER, help="directory with gpt3-13b.config.json, gpt3-175b.config.json"
    )
    p.add_argument("--dtype", default="fp16,bf16", help="compute dtypes to plan for, comma-separated")
    p.add_argument("--only", default=None, help="13b or 175b")
    p.add_argument(
        "--batches", default=None, help="micro-batches to plan, comma-separated (default: each model's own)"
    )
    p.add_argument("--repeats", type=int, default=1, help="planning runs per configuration (median)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def _settings(config: str, dtype: str, batch: int):
    from deepspeed.runtime.config import DeepSpeedConfig

    from offloadpp.integrations.deepspeed.build import settings_from
    from offloadpp.integrations.deepspeed.config import load_ds_config, parse_block

    ds = load_ds_config(config)
    ds = {k: v for k, v in ds.items() if k not in ("fp16", "bf16")}
    if dtype != "fp32":
        ds[dtype] = {"enabled": True}
    ds["train_micro_batch_size_per_gpu"] = batch
    s = settings_from(DeepSpeedConfig(ds), parse_block(ds))
    return s.model_copy(update={"seq_len": SEQ_LEN})


def plan_row(model_cfg: dict, name: str, batch: int, dtype: str, hw, config: str, repeats: int) -> dict:
    from offloadpp.planner import InfeasibleError, analytic_profile, resolve
    from offloadpp.planner.peaks import clear_cache
    from offloadpp.planner.resolve import machine_for

    prof = analytic_profile(model_cfg, micro_batch=batch, seq_len=SEQ_LEN, compute_dtype=dtype, name=name)
    settings = _settings(config, dtype, batch)
    machine = machine_for(hw)
    row = {"model": name, "micro_batch": batch, "seq_len": SEQ_LEN, "dtype": dtype, "params": prof.numel}
    times, walls = [], []
    for _ in range(repeats):
        clear_cache()  # each run plans from nothing, as `offloadpp plan` does
        t0, w0 = time.process_time(), time.perf_counter()
        try:
            r = resolve(settings, prof.unit_specs(), machine, hardware=hw, model=prof)
        except InfeasibleError as e:
            row.update(refused=str(e), largest_micro_batch=e.largest_micro_batch)
        times.append(time.process_time() - t0)
        walls.append(time.perf_counter() - w0)
    row["plan_s"] = statistics.median(times)  # CPU
    row["plan_wall_s"] = statistics.median(walls)
    if "refused" in row:
        return row
    e, plan = r.estimate, r.plan
    # step_s is the optimizer step: a window of G micro-batches where the config accumulates
    window = settings.gradient_accumulation_steps
    flops = window * sum(u.forward_flops + u.backward_flops for u in prof.units)
    acts = {p: plan.activations.count(p) for p in POLICIES if p in plan.activations}
    row.update(
        step_s=e.step_s, bound=e.bound, floor_s=e.floor_s, tflops=flops / e.step_s / 1e12,
        compute_s=e.compute_s, ssd_s=e.ssd_s, link_s=e.link_s, adam_s=e.adam_s,
        ssd_read_bytes=e.ssd_read_bytes, ssd_write_bytes=e.ssd_write_bytes,
        prefetch_depth=plan.prefetch_depth, optim_prefetch_depth=plan.optim_prefetch_depth,
        budgets={"device": plan.budgets.device_bytes, "activations": plan.budgets.activation_bytes,
                 "host": plan.budgets.host_bytes},
        resident_device_bytes=plan.resident_device_bytes(), resident_host_bytes=plan.resident_host_bytes(),
        activations=acts, candidates=len(r.candidates), micro_batches_per_step=window,
    )  # fmt: skip
    return row


def _fmt(row: dict) -> str:
    head = f"| {row['model']} | {row['micro_batch']} | {row['dtype']} |"
    if "refused" in row:
        lb = row.get("largest_micro_batch")
        why = f"refused: largest micro-batch {lb}" if lb else "refused"
        return f"{head} {why} | | | | | {row['plan_s']:.2f} |"
    acts = ", ".join(f"{k} {v}" for k, v in row["activations"].items())
    gb = (row["ssd_read_bytes"] + row["ssd_write_bytes"]) / 1e9
    return (f"{head} {row['step_s']:.1f} | {row['tflops']:.1f} | {row['bound']} (floor {row['floor_s']:.1f}) | "
            f"{gb:,.0f} | {acts} | {row['plan_s']:.2f} |")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from offloadpp.planner import HardwareProfile

    hw = HardwareProfile.from_json(args.hardware)
    rows = []
    t_start = time.perf_counter()
    print(
        "| model | micro-batch | dtype | step s (estimate) | model TFLOPS | bound | SSD GB/step | activations | planned in s (CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, batches in RUNS:
        if args.only and args.only != name:
            continue
        with open(os.path.join(args.models, f"gpt3-{name}.config.json")) as f:
            model_cfg = json.load(f)
        if args.batches:
            batches = tuple(int(x) for x in args.batches.split(","))
        for dtype in args.dtype.split(","):
            for b in batches:
                row = plan_row(model_cfg, f"GPT-3 {name.upper()}", b, dtype, hw, args.config, args.repeats)
                rows.append(row)
                print(_fmt(row), flush=True)
    took = time.perf_counter() - t_start
    print(f"({took:.1f} s; planning times on {platform.node()}, {os.cpu_count()} CPUs)", file=sys.stderr)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "hardware": args.hardware, "config": args.config, "rows": rows}, f, indent=2)  # fmt: skip
    return 0
