"""`offloadpp bench capacity`: a model whose training state exceeds what the run may hold in RAM,
trained the way a DeepSpeed user trains it, peak RSS measured.

The user's path: a ZeRO-Infinity config (parameters and optimizer state on NVMe, gradient
clipping 1.0, nothing else tuned) plus `"offloadpp": {"enabled": true}`, the model built under
offloadpp.Init (each unit initialised by the model's own init straight into the store) and
trained through offloadpp.initialize with default budgets. `--checkpoint` adds the checkpoint's
life cycle: save, one step, load, the same step again (its loss must be bit-identical), and a
Hugging Face export, each timed against the disk-bandwidth floor. `--export` adds the two ways
users export a model: save_16bit_model(dir) with DeepSpeed's default name and a Trainer's
save_model of the same engine, each timed against the disk floor with its own peak, both then
loaded with from_pretrained in a process of their own and compared with the engine's logits
(capacity_export.py). `--export-checkpoint` saves a checkpoint after the steps and, once the
training process has ended, runs `offloadpp export` on it as a user does after the job (a
process of its own, its peak RSS from the kernel), the folder then checked the same way.
`--zero` then trains the same
model under ZeRO-Infinity in the same session (deepspeed.zero.Init, with the two settings it
needs for a model this size: an offload buffer larger than the largest parameter and a 1e8
sub-group), for the step-time ratio.

Each run is a child process; the parent reads the child's peak resident set from the kernel
(wait4's ru_maxrss), so the number covers every allocation of the run. The child also reads its
peak of each phase (VmHWM, reset between phases) and the engine's own accounting (the run peaks
of its budgets, activations included), so a peak can be told apart: the process before the
engine, what the engine accounts for, and the rest (allocator slack, the model code's own
temporaries).
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
import sys
import tempfile
import time

from offloadpp.bench.capacity_export import EXPORTS
from offloadpp.bench.capacity_export import table as export_table

GIB = 1 << 30
BAR_RSS_GIB = 8.0
BAR_VS_ZERO = 0.40  # issue 21's bar at clipping 1.0 and default budgets (0.30 with a 16 GiB host budget)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="training steps (the first is not counted as steady)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping of the DeepSpeed config")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--checkpoint", action="store_true", help="save, step, load, the same step again, export")
    p.add_argument(
        "--export",
        action="store_true",
        help="save_16bit_model(dir) and a Trainer's save_model, each loaded with from_pretrained and compared",
    )
    p.add_argument(
        "--export-checkpoint",
        action="store_true",
        help="save_checkpoint, then `offloadpp export` on it in a process of its own after the run, its peak RSS "
        "measured, the folder loaded with from_pretrained and compared",
    )
    p.add_argument(
        "--zero", action="store_true", help="also train the model under ZeRO-Infinity, same session"
    )
    p.add_argument("--zero-steps", type=int, default=3)
    p.add_argument(
        "--offloadpp-block",
        metavar="JSON",
        default="{}",
        help="more keys of the config's \"offloadpp\" block (offloadpp's side only; the rest of the JSON is "
        'both sides\'), e.g. \'{"host_budget_bytes": "16GiB"}\'',
    )
    p.add_argument("--max-rss-gib", type=float, default=BAR_RSS_GIB, help="the bar: peak RSS at most this")
    p.add_argument(
        "--max-vs-zero", type=float, default=BAR_VS_ZERO, help="the bar: steady step at most this x ZeRO's"
    )
    p.add_argument(
        "--dir", default=os.path.join("runs", "bench-capacity"), help="work directory (removed after)"
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH")
    p.add_argument("--child", metavar="SIDE", choices=("offloadpp", "zero", "verify"), help=argparse.SUPPRESS)
    p.add_argument("--result", metavar="PATH", help=argparse.SUPPRESS)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# DeepSpeed's recommended aio block, which every ZeRO-Infinity config carries: both sides get it
# (offloadpp reports it as not applied, planner/io_settings.py).
AIO = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}  # fmt: skip


def ds_config(args, nvme: str, side: str) -> dict:
    """The one DeepSpeed JSON both sides run; ours adds only `"offloadpp": {"enabled": true}`.
    It carries what ZeRO-Infinity needs to run this model at all on this machine (DESIGN.md),
    which offloadpp ignores (docs/deepspeed.md's key table), and the aio block."""
    nvme_dev = {"device": "nvme", "nvme_path": nvme}
    largest = 50257 * args.width
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {**nvme_dev, "buffer_size": int(largest * 1.05), "buffer_count": 5},
            "offload_optimizer": dict(nvme_dev),
            "stage3_max_reuse_distance": 0,
            "sub_group_size": int(1e8),
        },
        "aio": dict(AIO),
    }
    if side == "offloadpp":
        cfg["offloadpp"] = {"enabled": True, **offloadpp_block(args)}
    return cfg


def offloadpp_block(args) -> dict:
    """--offloadpp-block: a JSON object of offloadpp block keys (docs/deepspeed.md)."""
    block = json.loads(getattr(args, "offloadpp_block", None) or "{}")
    if not isinstance(block, dict):
        raise SystemExit(f"--offloadpp-block: expected a JSON object, got {block!r}")
    return block


def _gpt2_config(args):
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_positions=1024,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip


def _batches(args, n: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50257, (args.batch, args.seq), generator=g) for _ in range(n)]


def phase_peak() -> int:
    """This process's peak RSS since the last call (VmHWM), then the peak is reset to the current
    RSS (Linux's clear_refs 5), so each phase of a run gets its own peak; 0 where unreadable."""
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return hwm
    except (OSError, StopIteration):
        return 0


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0


def _train_step(engine, x) -> float:
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def model_bytes(rt, args) -> dict:
    """The cost model's SSD bytes per step for the plan the engine runs (its deferred step where the
    plan speculates: every step of this benchmark clips), replayed at the engine's measured SSD rates;
    the bytes hardly depend on the other rates, set here to round values."""
    from offloadpp.planner.cost import estimate
    from offloadpp.planner.hardware import HardwareProfile
    from offloadpp.planner.model_profile import analytic_profile

    mem = _mem_total()
    hw = HardwareProfile(device="cpu", device_name="this machine", cpu_cores=os.cpu_count() or 1,
                         ssd_read_gbps=rt.ssd_read_gbps, ssd_write_gbps=rt.ssd_write_gbps, h2d_gbps=10.0, d2h_gbps=10.0,
                         memcpy_gbps=10.0, device_flops_per_s={"fp32": 100e9}, adam_params_per_s={1: 1e9},
                         host_memory_bytes=mem, device_memory_bytes=mem)  # fmt: skip
    m = analytic_profile(_gpt2_config(args).to_dict(), micro_batch=args.batch, seq_len=args.seq)
    e = estimate(rt.plan, hw, m, deferred=True)
    return {"ssd_read_bytes": e.ssd_read_bytes, "ssd_write_bytes": e.ssd_write_bytes}


def _offloadpp_child(args, work: str) -> dict:
    import torch
    from tqdm import tqdm
    from transformers import GPT2LMHeadModel

    # offloadpp.Init and offloadpp.initialize, as a user script calls them (the package face re-exports these)
    from offloadpp.bench.harness import modelled_ssd_by_kind, steady_reports, steps_updates
    from offloadpp.integrations.deepspeed import Init, initialize
    from offloadpp.planner import traffic

    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = ds_config(args, nvme, "offloadpp")
    t0 = time.perf_counter()
    with Init(config=cfg):
        model = GPT2LMHeadModel(_gpt2_config(args))
    n = sum(p.numel() for p in model.parameters())
    peaks = {"build under Init": phase_peak()}
    before_engine = _rss()
    engine, *_ = initialize(model=model, config=cfg)
    init_s = time.perf_counter() - t0
    peaks["initialize"] = phase_peak()
    rt = engine.runtime
    _log(rt.plan.describe())
    data = _batches(args, args.steps + 1)
    out: dict = {
        "params": n,
        "init_s": init_s,
        "plan": rt.plan.describe(),
        "budgets": rt.plan.describe_budgets(),
        "model_bytes": model_bytes(rt, args),
    }
    _log(f"cost model, bytes per step: {out['model_bytes']}")
    steps, losses, reports = [], [], []
    for i in tqdm(range(args.steps), desc="offloadpp: steps", file=sys.stderr):
        t = time.perf_counter()
        losses.append(_train_step(engine, data[i]))
        steps.append(time.perf_counter() - t)
        reports.append(engine.last_report)
        _log(engine.last_report.summary())
    peaks["steps"] = phase_peak()
    accounted = {b.name: b.run_peak_bytes for b in rt.budget_report()}
    out.update(
        step_s=steps, losses=losses, reports=[r.as_dict() for r in reports], disk_bytes=rt.disk_bytes(),
        rss_before_engine=before_engine, accounted_peaks=accounted,
        ssd_by_kind=traffic.median(r.ssd_by_kind for r in steady_reports(reports)),
    )  # fmt: skip
    out["modelled_ssd_by_kind"], out["modelled_from"] = modelled_ssd_by_kind(
        rt, model.config.to_dict(), steps_updates(steady_reports(reports))
    )
    if args.checkpoint:
        state_bytes = 12 * sum(u.padded_numel for u in rt.units)  # fp32 master + two moments
        rd, wr = rt.ssd_read_gbps * 1e9, rt.ssd_write_gbps * 1e9
        ckpt = os.path.join(work, "ckpt")
        t = time.perf_counter()
        engine.save_checkpoint(ckpt, tag="a")
        save_s = time.perf_counter() - t
        peaks["save"] = phase_peak()
        x = data[args.steps]
        loss_a = _train_step(engine, x)
        peaks["step after save"] = phase_peak()
        t = time.perf_counter()
        engine.load_checkpoint(ckpt, tag="a")
        load_s = time.perf_counter() - t
        peaks["load"] = phase_peak()
        loss_b = _train_step(engine, x)
        peaks["step after load"] = phase_peak()
        t = time.perf_counter()
        engine.save_pretrained(os.path.join(work, "export"))
        export_s = time.perf_counter() - t
        peaks["export"] = phase_peak()
        export_bytes = sum(
            os.path.getsize(os.path.join(work, "export", f)) for f in os.listdir(os.path.join(work, "export"))
        )
        ckpt_bytes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ckpt) for f in fs)
        out["checkpoint"] = {
            "state_bytes": state_bytes, "checkpoint_bytes": ckpt_bytes, "export_bytes": export_bytes,
            "save_s": save_s, "save_floor_s": state_bytes / rd + state_bytes / wr,
            "load_s": load_s, "load_floor_s": state_bytes / rd + state_bytes / wr,
            "export_s": export_s, "export_floor_s": state_bytes / 3 / rd + export_bytes / wr,
            "loss_before_save": loss_a, "loss_after_load": loss_b, "bit_identical": loss_a == loss_b,
            "ssd_read_gbps": rt.ssd_read_gbps, "ssd_write_gbps": rt.ssd_write_gbps,
        }  # fmt: skip
        _log(
            f"checkpoint: save {save_s:.1f}s, load {load_s:.1f}s, export {export_s:.1f}s; loss {loss_a} / {loss_b}"
        )
    if args.export or args.export_checkpoint:
        import offloadpp.bench.capacity_export as cx

        cx.reference(engine, work, data[0])
        peaks["reference logits"] = phase_peak()
        if args.export:
            out["export"] = cx.export_phase(engine, args, work, data[0], phase_peak)
            peaks.update(out["export"].pop("peaks"))
        if args.export_checkpoint:
            out["checkpoint_export"] = cx.checkpoint_phase(engine, work, phase_peak)
    engine.close()
    out["phase_peak_rss"] = peaks
    del torch
    return out


def _zero_child(args, work: str) -> dict:
    import deepspeed
    import torch
    from tqdm import tqdm
    from transformers import GPT2LMHeadModel

    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = ds_config(args, nvme, "zero")
    from offloadpp.integrations.deepspeed.op_locks import clear_stale_build_locks

    clear_stale_build_locks(report=_log)  # DeepSpeed JIT-builds its ops: an interrupted build's lock hangs it
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        model = GPT2LMHeadModel(_gpt2_config(args))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t0
    data = _batches(args, args.zero_steps)
    steps, losses = [], []
    for i in tqdm(range(args.zero_steps), desc="zero-infinity: steps", file=sys.stderr):
        t = time.perf_counter()
        losses.append(_train_step(engine, data[i]))
        steps.append(time.perf_counter() - t)
        _log(f"zero step {i}: {steps[-1]:.1f}s loss {losses[-1]:.3f}")
    del torch
    return {"init_s": init_s, "step_s": steps, "losses": losses}


def _run_child(args, side: str, work: str) -> tuple[dict, int, int]:
    """(the child's result, its peak RSS in bytes, its exit status)."""
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    argv = [sys.executable, "-m", "offloadpp.bench.capacity", "--child", side, "--result", result]
    for k in ("layers", "width", "heads", "batch", "seq", "steps", "clip", "threads", "dir", "zero_steps"):
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    argv += ["--offloadpp-block", args.offloadpp_block]
    for flag in ("checkpoint", "export", "export_checkpoint"):
        if getattr(args, flag):
            argv.append(f"--{flag.replace('_', '-')}")
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000))  # fmt: skip
    try:
        proc = subprocess.Popen(argv, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        with open(result) as f:
            text = f.read()
    finally:
        os.unlink(result)
    return (json.loads(text) if text else {}), usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def run(args: argparse.Namespace) -> int:
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        work = os.path.join(args.dir, args.child)
        if args.child == "verify":
            from offloadpp.bench.capacity_export import verify_child

            res = verify_child(os.path.join(args.dir, "offloadpp"))
        else:
            res = _offloadpp_child(args, work) if args.child == "offloadpp" else _zero_child(args, work)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    report: dict = {
        "bench": "capacity",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["offloadpp", "bench", "capacity", *sys.argv[3:]]),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "mem_bytes": _mem_total()},
        "model": {
            "layers": args.layers,
            "width": args.width,
            "batch": args.batch,
            "seq": args.seq,
            "clip": args.clip,
        },
    }
    try:
        t0 = time.perf_counter()
        ours, rss, rc = _run_child(args, "offloadpp", args.dir)
        if rc != 0 or not ours:
            _log(f"the offloadpp run failed (exit {rc})")
            return 1
        # resetting VmHWM between phases also resets what ru_maxrss reports at exit (the kernel
        # keeps one high-water mark): the run's peak is the largest of the phases' and the last's
        rss = max(rss, *ours.get("phase_peak_rss", {}).values())
        report["offloadpp"] = {**ours, "peak_rss_bytes": rss, "wall_s": time.perf_counter() - t0}
        if args.export or args.export_checkpoint:
            shutil.rmtree(
                os.path.join(args.dir, "offloadpp", "nvme"), ignore_errors=True
            )  # (disk for the check)
            if args.export_checkpoint:
                from offloadpp.bench.capacity_export import cli_export

                _log("offloadpp export on the checkpoint, a process of its own:")
                report["cli_export"] = cli_export(
                    os.path.join(args.dir, "offloadpp"), ours["checkpoint_export"]
                )
            verify, vrss, vrc = _run_child(args, "verify", args.dir)
            report["verify"] = {**verify, "peak_rss_bytes": vrss, "exit_status": vrc}
        if not args.keep:
            shutil.rmtree(os.path.join(args.dir, "offloadpp"), ignore_errors=True)
        if args.zero:
            t0 = time.perf_counter()
            zero, zrss, zrc = _run_child(args, "zero", args.dir)
            report["zero"] = {
                **zero,
                "peak_rss_bytes": zrss,
                "exit_status": zrc,
                "wall_s": time.perf_counter() - t0,
            }
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    o = report["offloadpp"]
    steady = statistics.median(o["step_s"][1:]) if len(o["step_s"]) > 1 else o["step_s"][0]
    o["steady_step_s"] = steady
    report["pass_rss"] = o["peak_rss_bytes"] <= args.max_rss_gib * GIB
    checks = [report["pass_rss"]]
    if "zero" in report and report["zero"].get("step_s"):
        z = report["zero"]
        z["steady_step_s"] = statistics.median(z["step_s"][1:]) if len(z["step_s"]) > 1 else z["step_s"][0]
        report["vs_zero"], report["max_vs_zero"] = steady / z["steady_step_s"], args.max_vs_zero
        checks.append(report["vs_zero"] <= args.max_vs_zero)
    if "checkpoint" in o:
        checks.append(o["checkpoint"]["bit_identical"])
    if "export" in o:
        v = report["verify"]
        checks.append(all(v.get(name, {}).get("close", False) for name in EXPORTS))
    if "cli_export" in report:
        from offloadpp.bench.capacity_export import CLI_EXPORT, cli_ok

        checks.append(cli_ok(report["cli_export"], args.max_rss_gib))
        checks.append(report["verify"].get(CLI_EXPORT, {}).get("close", False))
    report["pass"] = all(checks)
    report["max_rss_bytes"] = int(args.max_rss_gib * GIB)
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
    m, o = r["model"], r["offloadpp"]
    print(f"# bench capacity: GPT-2 {m['layers']} layers x {m['width']} ({o['params'] / 1e9:.2f}B params), batch "
          f"{m['batch']}x{m['seq']}, fp32, clipping {m['clip']}, {r['date']}")  # fmt: skip
    print(f"# fp32 training state {16 * o['params'] / 1e9:.1f} GB (16 B/param); machine memory "
          f"{r['machine']['mem_bytes'] / GIB:.1f} GiB; offloadpp budgets: {o['budgets']}")  # fmt: skip
    print("| run | peak RSS | init s | step s (each) | steady step s | on disk |")
    print("|---|---|---|---|---|---|")
    steps = ", ".join(f"{s:.1f}" for s in o["step_s"])
    print(f"| offloadpp (offloadpp.Init + initialize) | {o['peak_rss_bytes'] / GIB:.2f} GiB | {o['init_s']:.0f} | "
          f"{steps} | {o['steady_step_s']:.1f} | {o['disk_bytes'] / 1e9:.1f} GB |")  # fmt: skip
    if "zero" in r:
        z = r["zero"]
        if z.get("step_s"):
            zs = ", ".join(f"{s:.1f}" for s in z["step_s"])
            print(f"| ZeRO-Infinity (zero.Init + initialize) | {z['peak_rss_bytes'] / GIB:.2f} GiB | {z['init_s']:.0f} | "
                  f"{zs} | {z['steady_step_s']:.1f} | |")  # fmt: skip
        else:
            print(
                f"| ZeRO-Infinity | {z['peak_rss_bytes'] / GIB:.2f} GiB | failed (exit {z['exit_status']}) | | | |"
            )
    if o.get("phase_peak_rss"):
        print(
            "\npeak RSS by phase: "
            + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in o["phase_peak_rss"].items())
        )
        acc = o["accounted_peaks"]
        print(f"of the steps' peak: {o['rss_before_engine'] / GIB:.2f} GiB the process before the engine, "
              f"{sum(acc.values()) / GIB:.2f} GiB the engine's accounted peaks ("
              + ", ".join(f"{k} {v / GIB:.2f}" for k, v in acc.items())
              + f"), {(o['phase_peak_rss']['steps'] - o['rss_before_engine'] - sum(acc.values())) / GIB:+.2f} GiB "
              "the rest (allocator slack, the model code's temporaries)")  # fmt: skip
    if o.get("ssd_by_kind"):
        from offloadpp.planner import traffic

        print(f"\nSSD bytes of a steady step by kind, the cost model's from {o['modelled_from']}:")
        print(traffic.table(o["ssd_by_kind"], o["modelled_ssd_by_kind"]))
    if "export" in o or "cli_export" in r:
        v = r["verify"]
        print(
            "\n".join(export_table(o, v, v["peak_rss_bytes"], r.get("cli_export"), r["max_rss_bytes"] / GIB))
        )
    if "checkpoint" in o:
        c = o["checkpoint"]
        print(f"\ncheckpoint of {c['state_bytes'] / 1e9:.1f} GB of state ({c['checkpoint_bytes'] / 1e9:.1f} GB on disk), "
              f"SSD {c['ssd_read_gbps']:.2f} GB/s read, {c['ssd_write_gbps']:.2f} GB/s write:")  # fmt: skip
        for what in ("save", "load", "export"):
            print(f"  {what}: {c[what + '_s']:.1f} s (disk-bandwidth floor {c[what + '_floor_s']:.1f} s)")
        print(f"  the same step before save and after load: loss {c['loss_before_save']!r} / {c['loss_after_load']!r} "
              f"({'bit-identical' if c['bit_identical'] else 'DIFFERENT'})")  # fmt: skip
    print(f"\nbar: peak RSS <= {r['max_rss_bytes'] / GIB:.0f} GiB: {'PASS' if r['pass_rss'] else 'FAIL'}")
    if "vs_zero" in r:
        bar = r.get("max_vs_zero", BAR_VS_ZERO)
        print(f"bar: steady step <= {bar}x ZeRO-Infinity's: {r['vs_zero']:.3f} "
              f"({'PASS' if r['vs_zero'] <= bar else 'FAIL'})")  # fmt: skip


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="offloadpp bench capacity", description=__doc__.splitlines()[0])
    add_arguments(_p)
    sys.exit(run(_p.parse_args()))
