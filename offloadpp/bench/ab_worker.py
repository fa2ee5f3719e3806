"""One side of `offloadpp bench ab`, run in its own process so peak RSS and disk counters are its own.

    python -m offloadpp.bench.ab_worker --side zero|offloadpp|window --config CFG --model PRESET \
        --init INIT.safetensors --steps N --out RESULT.json

zero and offloadpp run DeepSpeed's per-micro-batch loop (forward, backward, step); window is
offloadpp driving each step's window whole with train_batch, vertically (accumulation
"vertical": runtime/accumulate.py), after its first window, which records the RNG tape.

Both sides load the same initial weights (ZeRO's zero.Init would skip transformers' init and
start from other weights) and see the same byte-token batches.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import sys
import time


def _proc_io() -> dict:
    """Bytes this process made the storage layer read and write (O_DIRECT included)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return {"read_bytes": out.get("read_bytes", 0), "write_bytes": out.get("write_bytes", 0)}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _load_config(path: str, side: str) -> dict:
    with open(path) as f:
        cfg = json.load(f)
    cfg = copy.deepcopy(cfg)
    if side == "zero":
        cfg.pop("offloadpp", None)
    else:
        cfg.setdefault("offloadpp", {})["enabled"] = True
    if side == "window":
        cfg["offloadpp"]["accumulation"] = "vertical"
    return cfg


def _build_model(preset_name: str, init_path: str):
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from offloadpp.presets import get_preset

    preset = get_preset(preset_name)
    model = GPT2LMHeadModel(preset.gpt2_config())
    state = load_file(init_path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head.weight is tied to wte and not stored separately.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(
            f"initial weights do not match the model: missing={missing} unexpected={unexpected}"
        )
    model.train()
    torch.manual_seed(0)
    return preset, model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["zero", "offloadpp", "window"], required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--model", default="gpt2-45m")
    p.add_argument("--init", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nvme-dir", required=True, help="fresh directory for this side's swap files")
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--device-memory-gib", type=float, default=None, help="cap on this process's CUDA memory")
    p.add_argument(
        "--turns",
        action="store_true",
        help="take turns with the other side: after start-up print 'ready', then run K steps on each "
        "'run K' line read from stdin, answering 'done' (the harness interleaves the two sides)",
    )
    args = p.parse_args(argv)

    import torch

    from offloadpp.bench.data import byte_batches, stdlib_docstrings

    torch.manual_seed(args.seed)
    cap = _cap_device_memory(args.device_memory_gib)
    cfg = _load_config(args.config, args.side)
    zero = cfg.setdefault("zero_optimization", {})
    for key in ("offload_param", "offload_optimizer"):
        if key in zero and zero[key].get("device") == "nvme":
            zero[key]["nvme_path"] = args.nvme_dir
    if args.side != "zero":
        cfg["offloadpp"]["nvme_paths"] = [args.nvme_dir]
    from offloadpp.bench.capacity import phase_peak

    preset, model = _build_model(args.model, args.init)
    # Peak RSS by phase: building the whole model and loading its weights (the harness's doing,
    # before the engine sees it) can be the run's peak at 1.31B, and would hide the engine's own.
    peaks = {"build": phase_peak()}
    if args.side == "zero":  # DeepSpeed JIT-builds its ops: an interrupted build's lock would hang it
        from offloadpp.integrations.deepspeed.op_locks import clear_stale_build_locks

        clear_stale_build_locks(report=lambda msg: print(msg, file=sys.stderr))

    t_init = time.perf_counter()
    if args.side == "zero":
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        # offloadpp.initialize is this function (the package face re-exports it)
        from offloadpp.integrations.deepspeed import initialize

        engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t_init
    peaks["initialize"] = phase_peak()

    micro = cfg.get("train_micro_batch_size_per_gpu", preset.micro_batch)
    gas = cfg.get("gradient_accumulation_steps", 1)
    seq_len = args.seq_len or preset.seq_len
    batches = byte_batches(stdlib_docstrings(), micro, seq_len, seed=args.seed)
    io0 = _proc_io()
    steps = []
    reports = []  # offloadpp: each step's StepReport (its SSD bytes by kind among them)
    vertical = []  # window: whether each step's window ran vertically
    for step in _step_turns(args.steps, args.turns):
        t0 = time.perf_counter()
        losses = []
        if args.side == "window":  # the window whole: DeepSpeed's PipelineEngine API
            mbs = [
                dict(zip(("input_ids", "labels"), (t.to(engine.device) for t in next(batches))))
                for _ in range(gas)
            ]
            engine.train_batch(iter(mbs))
            losses = [float(x) for x in engine.last_window.losses]
            vertical.append(engine.last_window.vertical)
        for _ in range(gas if args.side != "window" else 0):
            ids, labels = next(batches)
            ids, labels = ids.to(engine.device), labels.to(engine.device)  # both engines: LOCAL_RANK's device
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        dt = time.perf_counter() - t0
        steps.append({"step": step, "seconds": dt, "loss": sum(losses) / len(losses)})
        if args.side != "zero" and engine.last_report is not None:
            reports.append(engine.last_report)
        print(
            f"[{args.side}] step {step} {dt:.3f}s loss {steps[-1]['loss']:.5f}", file=sys.stderr, flush=True
        )
    io1 = _proc_io()
    peaks["steps"] = phase_peak()

    tokens_per_step = micro * gas * seq_len
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    result = {
        "side": args.side,
        "model": args.model,
        "params": n_params,
        "tokens_per_step": tokens_per_step,
        "init_seconds": init_s,
        "steps": steps,
        # resetting VmHWM between phases also resets ru_maxrss (one high-water mark in the kernel)
        "peak_rss_bytes": max(_peak_rss_bytes(), *peaks.values()),
        "phase_peak_rss_bytes": peaks,
        "ssd_read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "ssd_write_bytes": io1["write_bytes"] - io0["write_bytes"],
        "peak_device_bytes": _peak_device_bytes(engine),
        "device": str(engine.device),
        "device_memory_cap_bytes": cap,
        "config": cfg,  # the JSON this side ran: the harness checks both ran the same (ab.same_json)
    }
    if args.side == "window":
        result["vertical"] = vertical
    if args.side != "zero":
        result["updates"] = [r.updates for r in reports]  # how each step ran its updates
        result["grad_norms"] = [r.grad_norm for r in reports]
        result["reports"] = [r.as_dict() for r in reports]  # each step's terms (compute, waits, Adam, bytes)
        from offloadpp.bench.harness import modelled_ssd_by_kind, steady_reports, steps_updates
        from offloadpp.planner import traffic

        result["ssd_by_kind"] = traffic.median(r.ssd_by_kind for r in steady_reports(reports))
        result["modelled_ssd_by_kind"], result["modelled_from"] = modelled_ssd_by_kind(
            engine.runtime,
            model.config.to_dict(),
            steps_updates(steady_reports(reports)),
            window=args.side == "window",
        )
        if args.side == "window":  # issue 33's bar: a window's bytes against one step of G = 1's
            result["modelled_g1_ssd_by_kind"], result["modelled_g1_from"] = modelled_ssd_by_kind(
                engine.runtime, model.config.to_dict(), steps_updates(steady_reports(reports)), one_step=True
            )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def _cap_device_memory(gib) -> int | None:
    """Caps this process's CUDA memory to `gib` GiB (a smaller card's, on a larger GPU); the bytes,
    or None when there is no cap (or no CUDA)."""

    from offloadpp.runtime.accel.cuda import available, limit_memory

    if not gib or not available():
        return None
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return limit_memory(gib, local)


def _step_turns(total: int, turns: bool):
    """Step indices; with turns, only as many at a time as the harness grants on stdin."""
    if not turns:
        yield from range(total)
        return
    print("ready", flush=True)
    step = 0
    while step < total:
        line = sys.stdin.readline()
        if not line:
            raise RuntimeError("the A/B harness went away")
        k = int(line.split()[1])
        for _ in range(min(k, total - step)):
            yield step
            step += 1
        print("done", flush=True)
    # Note: hold here until the harness says "finish". Left to exit on its own, this side would
    # write its results and tear down (DeepSpeed frees GBs of pinned buffers and its swap files)
    # while the other side runs its last turn, and slow those timed steps down.
    if sys.stdin.readline().split()[:1] != ["finish"]:
        raise RuntimeError("the A/B harness went away")


def _peak_device_bytes(engine) -> int | None:
    import torch

    from offloadpp.runtime.accel.cuda import available

    if available():
        return int(torch.accelerator.max_memory_allocated())
    # On the CPU-as-device, offloadpp accounts the bytes it holds; ZeRO has no such notion here.
    peak = getattr(engine, "peak_device_bytes", None)
    return int(peak()) if callable(peak) else None


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
