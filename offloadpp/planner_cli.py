"""`offloadpp plan`: the plan the planner picks for a DeepSpeed config and a model, and its estimate.

    offloadpp plan --config ds_config.json --model gpt2-45m [--seq-len 128] [--json plan.json]
    offloadpp plan --config ds_config.json --model-profile model.json --hardware hardware.json

--model takes a preset name (offloadpp/bench/models.py), a Hugging Face model directory or a
config.json: the model profile is then analytic (FLOPs / the profiled FLOP/s). --model-profile
takes a measured one (`offloadpp profile --model ... --model-json`). The hardware profile is
--hardware, else the cache `offloadpp profile` writes. Budgets, batch size, accumulation,
clipping and precision come from the config, as the runtime will use them. --json saves the
plan (with its estimate) for `"plan": "PATH"` in the config's offloadpp block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Optional

DEFAULT_SEQ_LEN = 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="DeepSpeed JSON config (with an offloadpp block)")
    p.add_argument("--model", help="preset name, Hugging Face model directory, or config.json")
    p.add_argument("--model-profile", help="a measured model profile JSON instead of --model")
    p.add_argument("--hardware", help="hardware profile JSON (default: the `offloadpp profile` cache)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help=f"tokens per sequence (default: preset's, else {DEFAULT_SEQ_LEN})",
    )
    p.add_argument(
        "--device-budget", default=None, help="override the config's device budget (bytes or e.g. 8GiB)"
    )
    p.add_argument("--host-budget", default=None, help="override the config's host budget")
    p.add_argument("--adam-threads", type=int, default=1, help="the runtime's Adam threads (default 1)")
    p.add_argument("--top", type=int, default=5, help="also list this many runner-up candidates")
    p.add_argument("--json", metavar="PATH", help="save the plan and its estimate here")


def resolve_model(
    spec: str, micro_batch: Optional[int], seq_len: Optional[int]
) -> tuple[dict, int, int, str]:
    """(HF config dict, micro batch, seq len, label) for a preset, a model directory or a config file."""
    from offloadpp.bench.models import PRESETS

    if spec in PRESETS:
        p = PRESETS[spec]
        cfg = {"model_type": "gpt2", "n_layer": p.n_layer, "n_embd": p.n_embd, "n_head": p.n_head,
               "n_positions": p.n_positions, "vocab_size": p.vocab_size}  # fmt: skip
        return cfg, micro_batch or p.micro_batch, seq_len or p.seq_len, spec
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise SystemExit(
            f"--model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}), a model directory with config.json, "
            "or a config file"
        )
    with open(path) as f:
        cfg = json.load(f)
    return cfg, micro_batch or 1, seq_len or DEFAULT_SEQ_LEN, spec


def _budgets(block: dict, hw, args) -> tuple[int, int]:
    from offloadpp.integrations.deepspeed.config import parse_bytes

    def pick(override, key: str, auto: int) -> int:
        v = override if override is not None else block.get(key, "auto")
        return auto if str(v).strip().lower() == "auto" else parse_bytes(v)

    # "auto" as the DeepSpeed integration resolves it, from the memory the profile saw
    host = pick(args.host_budget, "host_budget", hw.host_memory_bytes // 2)
    dev_auto = int(hw.device_memory_bytes * 0.8) if hw.device == "cuda" else hw.host_memory_bytes // 4
    return pick(args.device_budget, "device_budget", dev_auto), host


def _free_ssd(paths) -> Optional[int]:
    free = 0
    seen = set()
    for p in paths or ():
        if not os.path.isdir(p):
            return None
        dev = os.stat(p).st_dev
        if dev not in seen:
            seen.add(dev)
            free += shutil.disk_usage(p).free
    return free if seen else None


def _estimate_table(e) -> str:
    rows = [
        ("step (estimate)", f"{e.step_s:.3f} s"),
        ("  forward", f"{e.forward_s:.3f} s"),
        ("  backward", f"{e.backward_s:.3f} s"),
        ("  optimizer wait", f"{e.optimizer_wait_s:.3f} s"),
        ("floor", f"{e.floor_s:.3f} s, bound by {e.bound}"),
        ("  device compute", f"{e.compute_s:.3f} s"),
        (
            "  SSD",
            f"{e.ssd_s:.3f} s ({e.ssd_read_bytes / 1e9:.3f} GB read, {e.ssd_write_bytes / 1e9:.3f} GB written)",
        ),
        ("  CPU Adam", f"{e.adam_s:.3f} s"),
        (
            "  host<->device",
            f"{e.link_s:.3f} s ({e.h2d_bytes / 1e9:.3f} GB h2d, {e.d2h_bytes / 1e9:.3f} GB d2h)",
        ),
        (
            "peak buffers",
            f"device {e.peak_device_bytes / 2**20:.1f} MiB, host {e.peak_host_bytes / 2**20:.1f} MiB",
        ),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"  {a:<{w}}  {b}" for a, b in rows)


def run(args: argparse.Namespace) -> int:
    from offloadpp.planner import PlanError
    from offloadpp.planner.hardware import HardwareProfile, ProfileError
    from offloadpp.planner.model_profile import ModelProfile, ModelProfileError, analytic_profile
    from offloadpp.planner.planfile import save_plan
    from offloadpp.planner.search import Budget, describe_buffers, io_choice, search
    from offloadpp.profiling import default_profile_path

    with open(args.config) as f:
        ds = json.load(f)
    block = dict(ds.get("offloadpp") or {})
    hw_path = args.hardware or default_profile_path()
    try:
        hw = HardwareProfile.from_json(hw_path)
    except ProfileError as e:
        print(f"offloadpp plan: {e}", file=sys.stderr)
        return 2
    mb = int(ds.get("train_micro_batch_size_per_gpu") or 1)
    fp16 = bool((ds.get("fp16") or {}).get("enabled"))
    bf16 = bool((ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled"))
    dtype = "fp16" if fp16 else ("bf16" if bf16 else "fp32")
    try:
        if args.model_profile:
            model = ModelProfile.from_json(args.model_profile)
        elif args.model:
            cfg, mb, seq, label = resolve_model(args.model, mb, args.seq_len)
            model = analytic_profile(cfg, micro_batch=mb, seq_len=seq, compute_dtype=dtype, name=label)
        else:
            print("offloadpp plan: give --model or --model-profile", file=sys.stderr)
            return 2
    except ModelProfileError as e:
        print(f"offloadpp plan: {e}", file=sys.stderr)
        return 2
    dev_b, host_b = _budgets(block, hw, args)
    budget = Budget(
        device_bytes=dev_b,
        host_bytes=host_b,
        ssd_bytes=_free_ssd(block.get("nvme_paths")),
        compute_dtype=dtype,
        micro_batches=int(ds.get("gradient_accumulation_steps") or 1),
        deferred_update=float(ds.get("gradient_clipping") or 0) > 0 or dtype == "fp16",
        adam_threads=args.adam_threads,
        prefetch_depth=block.get("prefetch_depth"),
    )
    print(hw.describe())
    print(model.describe())
    try:
        result = search(hw, model, budget)
    except PlanError as e:
        print(f"offloadpp plan: infeasible: {e}", file=sys.stderr)
        return 1
    print(result.plan.describe())
    for line in describe_buffers(result.plan):
        print(f"  {line}")
    io = io_choice(hw)
    if io is None:
        print(
            f"  I/O: block {hw.io_block_size_bytes >> 10} KiB, queue depth {hw.io_queue_depth} (the default)"
        )
    else:
        print(f"  I/O: block {io.block_size_bytes >> 10} KiB, queue depth {io.queue_depth} "
              f"(measured {io.read_gbps:.2f} GB/s read, {io.write_gbps:.2f} GB/s write)")  # fmt: skip
    print(_estimate_table(result.best.estimate))
    if args.top > 0:
        print(f"runner-up candidates (of {len(result.candidates)}):")
        for c in result.candidates[: args.top]:
            print(f"  {c.label:<28} {c.estimate.step_s:.3f} s  bound by {c.estimate.bound}, SSD "
                  f"{(c.estimate.ssd_read_bytes + c.estimate.ssd_write_bytes) / 1e9:.3f} GB")  # fmt: skip
    if args.json:
        save_plan(args.json, result.plan, result.best.estimate)
        print(f"plan written to {args.json}", file=sys.stderr)
    return 0
