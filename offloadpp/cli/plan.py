"""`offloadpp plan`: the budgets and the plan `offloadpp.initialize` would run for a DeepSpeed
config and a model on this machine, and its step-time estimate.

    offloadpp plan --config ds_config.json --model gpt2-45m [--json plan.json]
    offloadpp plan --config ds_config.json --model path/to/hf_model_dir --hardware hardware.json

--model takes a preset name (offloadpp/presets.py), a Hugging Face model directory or a
config.json; the model is built on the meta device (no memory) so its units are exactly the
ones the runtime will find. --model-profile takes a measured profile instead (its units). The
settings come from the config as `offloadpp.initialize` reads them, through the same resolve
stage (offloadpp/assemble.py), so the plan printed is the plan that runs. The estimate needs a
hardware profile: --hardware, else the cache `offloadpp profile` writes when there is one.
--json saves the plan (budgets inside) for `"plan": "PATH"` in the config's offloadpp block.
--lora R plans peft's LoRA of rank R over the frozen model (each unit's trainable and frozen
parameters; docs/frozen.md).
--machine-from-hardware plans for the machine the hardware profile describes (its memory, cores
and SSD space) instead of this one: what a hand-written profile of another machine is for.
--ranks N plans one of N data-parallel ranks (--ranks-per-node of them share each node's memory,
SSDs and cores; default all on one), its collectives at --collective-gbps (and --network-gbps
between nodes), else the block's or the hardware profile's (docs/distributed.md).
A configuration that cannot fit is refused (exit 1) with the largest micro-batch that would, or
the budget it needs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from offloadpp.planner.spec import ACTIVATION_POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="DeepSpeed JSON config (with an offloadpp block)")
    p.add_argument("--model", help="preset name, Hugging Face model directory, or config.json")
    p.add_argument("--model-profile", help="a measured model profile JSON instead of --model")
    p.add_argument(
        "--hardware", help="hardware profile JSON (default: the `offloadpp profile` cache, if any)"
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)"
    )
    p.add_argument(
        "--micro-batch", type=int, default=None, help="sequences per micro-batch (default: the config's)"
    )
    p.add_argument(
        "--activations",
        choices=ACTIVATION_POLICIES,
        default=None,
        help="the activation policy of every unit (default: the block's, else auto)",
    )
    p.add_argument(
        "--activation-budget", default=None, help="device bytes the saved activations may take (e.g. 8GiB)"
    )
    p.add_argument(
        "--machine-from-hardware",
        action="store_true",
        help="plan for the machine the hardware profile describes, not this one",
    )
    p.add_argument(
        "--device-budget", default=None, help="override the block's device_budget_bytes (e.g. 8GiB)"
    )
    p.add_argument("--host-budget", default=None, help="override the block's host_budget_bytes")
    p.add_argument(
        "--adam-threads", type=int, default=None, help="the runtime's Adam threads (default: every core)"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: as initialize picks)")
    p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks in all (default 1)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="of them, on each node (default: all)")
    p.add_argument("--collective-gbps", type=float, default=None, help="the ranks' all-gather bus GB/s")
    p.add_argument("--network-gbps", type=float, default=None, help="each node's network GB/s between nodes")
    p.add_argument(
        "--top", type=int, default=5, help="with plan 'auto', also list this many runner-up candidates"
    )
    p.add_argument(
        "--speculate",
        choices=("auto", "on", "off"),
        default=None,
        help="override the block's speculate (clipping, fp16: updates during backward, validated after it)",
    )
    p.add_argument(
        "--accumulation",
        choices=("auto", "vertical", "horizontal"),
        default=None,
        help="override the block's accumulation: how a window driven whole (train_batch) runs",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        metavar="G",
        help="override the config's gradient_accumulation_steps (micro-batches per step)",
    )
    p.add_argument("--json", metavar="PATH", help="save the plan and its estimate here")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="plan peft's LoRA of rank R on the attention and MLP projections over the frozen model "
                        "(docs/frozen.md)")  # fmt: skip


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
            "  collectives",
            f"{e.comm_s:.3f} s ({e.comm_bytes / 1e9:.3f} GB through each rank's link)",
        ),
        (
            "peak buffers",
            f"device {e.peak_device_bytes / 2**20:.1f} MiB, host {e.peak_host_bytes / 2**20:.1f} MiB",
        ),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"  {a:<{w}}  {b}" for a, b in rows)


def window_lines(r) -> list[str]:
    """With accumulation: a window of G micro-batches run horizontally against vertically (time,
    throughput, SSD bytes by kind, bound; planner/vertical.py), and which way train_batch and a
    per-micro-batch loop run it. [] without accumulation or estimates."""
    plan, g = r.plan, r.settings.gradient_accumulation_steps
    if g == 1 or r.estimate is None:
        return []
    rows = [(r, plan.vertical, r.estimate, r.deferred_estimate)]
    if r.other is not None and r.other.estimate is not None:
        rows.append((r.other, not plan.vertical, r.other.estimate, r.other.deferred_estimate))
    if r.loop_estimate is not None:
        rows.append((None, False, r.loop_estimate, None))
    rows.sort(key=lambda x: (x[1], x[0] is not None))  # horizontal first, the loop's first
    seqs = g * (r.settings.micro_batch or 1)
    seq_len = r.settings.seq_len
    unit = "tokens/s" if seq_len else "sequences/s"
    per = seqs * seq_len if seq_len else seqs
    out = [f"a window of {g} micro-batches ({seqs} sequences{f', {per:,} tokens' if seq_len else ''}), each way "
           f"(SSD GiB read / written):",  # fmt: skip
           f"| schedule | s per window | {unit} | weights | gradients | optimizer state | activations | bound |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    times = {}
    for rr, vertical, e, d in rows:
        name = "vertical" if vertical else "horizontal"
        times.setdefault(name, e.step_s)
        kinds = {k: f"{rd / 2**30:,.0f} / {w / 2**30:,.0f}" for k, rd, w in e.ssd_by_kind}
        deferred = f" ({d.step_s:.1f} deferred)" if d is not None else ""
        chosen = (" (the plan's)" if rr is r else " (a per-micro-batch loop with the plan)" if rr is None else
                  " (its least-bound plan: its search stopped where none could beat the vertical window)"
                  if rr.beaten_by is not None else
                  " (its own plan: accumulation \"horizontal\")" if plan.vertical else "")  # fmt: skip
        out.append(f"| {name}{chosen} | {e.step_s:.1f}{deferred} | {per / e.step_s:,.1f} | {kinds.get('weights', '-')} | "
                   f"{kinds.get('gradients', '-')} | {kinds.get('optimizer_state', '-')} | "
                   f"{kinds.get('activations', '-')} | {e.bound} ({e.floor_s:.1f} s) |")  # fmt: skip
    if plan.vertical and "horizontal" in times:
        out.append(f"train_batch (and the Trainer's window) runs it vertically, {times['horizontal'] / times['vertical']:.2f}x "
                   "faster than a per-micro-batch loop (forward/backward/step), which runs it horizontally")  # fmt: skip
    elif plan.vertical:
        out.append(
            "train_batch (and the Trainer's window) runs it vertically; a per-micro-batch loop runs it horizontally"
        )
    elif r.vertical_why_not is not None:
        out.append(f"both run it horizontally: vertical is impossible: {r.vertical_why_not}")
    elif (
        r.settings.accumulation == "auto" and "vertical" in times and times["vertical"] < times["horizontal"]
    ):
        out.append(f"both train_batch and a per-micro-batch loop run it horizontally: train_batch (and the Trainer's "
                   f"window) would run it vertically {times['horizontal'] / times['vertical']:.2f}x faster, but with the "
                   "vertical plan a per-micro-batch loop would be slower (the plan's note), which \"auto\" never "
                   "chooses; \"accumulation\": \"vertical\" runs it so")  # fmt: skip
    else:
        out.append("both train_batch and a per-micro-batch loop run it horizontally"
                   + (" (accumulation \"horizontal\")" if r.settings.accumulation == "horizontal" else ""))  # fmt: skip
    return out


def plan_for_config(ds: dict, args: argparse.Namespace):
    """(Resolved, hardware profile or None, model profile or None) for the config and model of
    `args`, through the resolve stage `offloadpp.initialize` uses."""
    from offloadpp.assemble import probe_machine, resolve_for_model
    from offloadpp.integrations.deepspeed.build import parse_ds_config, settings_from, swap_dirs
    from offloadpp.integrations.deepspeed.config import parse_block, parse_bytes
    from offloadpp.planner import ModelProfile, PlanError, Settings, default_profile_path, resolve
    from offloadpp.planner.io_settings import io_set_of
    from offloadpp.planner.resolve import load_hardware, load_saved_plan, machine_for

    block = parse_block(ds)
    settings = settings_from(parse_ds_config(ds), block)
    update = {}
    if args.device_budget is not None:
        update["device_budget_bytes"] = parse_bytes(args.device_budget)
    if args.host_budget is not None:
        update["host_budget_bytes"] = parse_bytes(args.host_budget)
    if args.seq_len is not None:
        update["seq_len"] = args.seq_len
    if args.micro_batch is not None:
        update["micro_batch"] = args.micro_batch
    if args.activations is not None or args.activation_budget is not None:
        act = {}
        if args.activations is not None:
            act["policy"] = args.activations
        if args.activation_budget is not None:
            act["budget_bytes"] = parse_bytes(args.activation_budget)
        update["activations"] = settings.activations.model_copy(update=act)
    if args.adam_threads is not None:
        update["adam_threads"] = args.adam_threads
    for k in ("collective_gbps", "network_gbps"):
        if getattr(args, k) is not None:
            update[k] = getattr(args, k)
    if args.speculate is not None:
        update["speculate"] = args.speculate
    if getattr(args, "accumulation", None) is not None:
        update["accumulation"] = args.accumulation
    if getattr(args, "grad_accum", None) is not None:
        update["gradient_accumulation_steps"] = args.grad_accum
    hw_path = args.hardware or settings.hardware_profile
    if hw_path is None and os.path.isfile(default_profile_path()):
        hw_path = default_profile_path()
    if hw_path is not None:
        update["hardware_profile"] = hw_path
    if args.model_profile:
        update["model_profile"] = args.model_profile
    settings = Settings.model_validate({**settings.model_dump(), **update})  # validated, as the block is
    hw = load_hardware(hw_path) if hw_path else None
    machine = None
    if args.machine_from_hardware:
        if hw is None:
            raise PlanError("--machine-from-hardware needs a hardware profile (--hardware)")
        machine = machine_for(hw)
        paths: tuple = ()
    else:
        paths = swap_dirs(block.nvme_paths, create=False) if block.nvme_paths else ()
    if args.ranks > 1:
        from dataclasses import replace

        machine = machine or probe_machine(args.device, paths)
        machine = replace(machine, ranks=args.ranks, local_ranks=args.ranks_per_node or args.ranks)
    if args.model:
        from offloadpp.presets import hf_config_dict, meta_model

        cfg, _preset = hf_config_dict(args.model)
        model = meta_model(cfg)
        if args.lora:
            model = with_lora(model, args.lora)
        t0 = time.perf_counter()
        r = resolve_for_model(model, settings, device=args.device, nvme_paths=paths, machine=machine,
                              io_set=io_set_of(block.io))  # fmt: skip
        return r, hw, time.perf_counter() - t0
    profile = ModelProfile.from_json(args.model_profile)
    machine = machine or probe_machine(args.device, paths)
    t0 = time.perf_counter()
    r = resolve(settings, profile.unit_specs(), machine, hardware=hw, model=profile if hw else None,
                saved=load_saved_plan(settings), io_set=io_set_of(block.io))  # fmt: skip
    return r, hw, time.perf_counter() - t0


# the attention and MLP projections LoRA adapts, by the names the supported model types give them
LORA_TARGETS = ["c_attn", "c_proj", "c_fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "fc1", "fc2", "out_proj"]  # fmt: skip


def with_lora(model, r: int):
    """`model` (on the meta device) under peft's LoRA of rank r: its base frozen, the adapters
    trainable, as a user's get_peft_model makes it."""
    import peft

    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = [t for t in LORA_TARGETS if t in present]
    fan_in_fan_out = getattr(getattr(model, "config", None), "model_type", None) == "gpt2"  # Conv1D
    return peft.get_peft_model(
        model, peft.LoraConfig(r=r, target_modules=targets, fan_in_fan_out=fan_in_fan_out)
    )


def run(args: argparse.Namespace) -> int:
    from offloadpp.integrations.deepspeed.config import (
        OffloadppConfigError,
        aio_not_applied,
        load_ds_config,
        parse_block,
    )
    from offloadpp.planner import InfeasibleError, ModelProfileError, PlanError, ProfileError
    from offloadpp.planner.io_settings import applied
    from offloadpp.planner.planfile import save_plan
    from offloadpp.planner.search import describe_buffers, io_choice

    if not args.model and not args.model_profile:
        print("offloadpp plan: give --model or --model-profile", file=sys.stderr)
        return 2
    try:
        ds = load_ds_config(args.config)
        r, hw, took = plan_for_config(ds, args)
    except InfeasibleError as e:
        print(f"offloadpp plan: infeasible: {e}", file=sys.stderr)
        return 1
    except (OffloadppConfigError, ModelProfileError, ProfileError, PlanError, ValueError) as e:
        print(f"offloadpp plan: {e}", file=sys.stderr)
        return 2
    if hw is not None:
        print(hw.describe())
    print(r.plan.describe())
    for line in describe_buffers(r.plan):
        print(f"  {line}")
    io = io_choice(hw) if hw is not None else None
    if io is not None and (io.block_size_bytes, io.queue_depth) == (
        r.plan.io_block_size_bytes,
        r.plan.io_queue_depth,
    ):
        print(
            f"  I/O (the note above): measured {io.read_gbps:.2f} GB/s read, {io.write_gbps:.2f} GB/s write there"
        )
    not_applied = aio_not_applied(ds, applied(parse_block(ds).io, r.plan))
    if not_applied is not None:
        print(f"  note: {not_applied}")
    if r.estimate is not None:
        print(_estimate_table(r.estimate))
        if r.estimate.ssd_by_kind:
            from offloadpp.planner import traffic

            print("  the estimate's SSD bytes per step by kind:")
            print("\n".join("  " + line for line in traffic.table(r.estimate.ssd_by_kind).splitlines()))
        if r.deferred_estimate is not None:
            d = r.deferred_estimate
            print(f"  (a step whose updates validate; one that clips, or with speculate off, runs them deferred: "
                  f"{d.step_s:.3f} s, optimizer wait {d.optimizer_wait_s:.3f} s)")  # fmt: skip
        for line in window_lines(r):
            print(f"  {line}")
    else:
        print("  (no hardware profile: run `offloadpp profile` for a step-time estimate)")
    print(f"  planned in {took:.2f} s (the resolve stage)")
    if r.candidates and args.top > 0:
        print(f"runner-up candidates (of {len(r.candidates)}):")
        for c in r.candidates[: args.top]:
            print(f"  {c.label:<28} {c.estimate.step_s:.3f} s  bound by {c.estimate.bound}, SSD "
                  f"{(c.estimate.ssd_read_bytes + c.estimate.ssd_write_bytes) / 1e9:.3f} GB")  # fmt: skip
    if args.json:
        save_plan(args.json, r.plan, r.estimate)
        print(f"plan written to {args.json}", file=sys.stderr)
    return 0
