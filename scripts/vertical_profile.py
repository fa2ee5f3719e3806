"""Where a vertical window's time goes beside a horizontal one's, in one process (issue 33).

    python scripts/vertical_profile.py [--layers 12] [--width 1024] [--g 8] [--seq 64]
        [--rounds 3] [--cprofile N] [--torch-profile]

A GPT-2 of --layers x --width (bf16, micro-batch 1, sequence --seq, G micro-batches, clipping
1.0: ds_configs/gpt2_1.3b.window.json's shape, its state on SSD under runs/) through
offloadpp.initialize with accumulation "vertical". After a first window (which records the RNG
tape), rounds alternate a horizontal window (forward/backward/step per micro-batch on the same
plan: `train_window(vertical=False)`) and a vertical one, so both see the same load; prints each
kind's median window, forward, backward, compute (the device's share) and fetch-wait seconds.
--cprofile N: cProfile one more vertical window and print its N most expensive functions
(cumulative); --torch-profile: torch.profiler over one more window of each kind, the ops by CPU
time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

import torch

CONFIG = os.path.join(os.path.dirname(__file__), "..", "ds_configs", "gpt2_1.3b.window.json")


def _engine(args, nvme: str):
    import transformers

    import offloadpp

    with open(CONFIG) as f:
        cfg = json.load(f)
    cfg["offloadpp"] = {"enabled": True, "accumulation": "vertical", "nvme_paths": [nvme]}
    cfg["gradient_accumulation_steps"] = args.g
    for key in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][key]["nvme_path"] = nvme
    torch.manual_seed(0)
    gcfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                   n_positions=max(64, args.seq), resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(gcfg)
    engine, *_ = offloadpp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _window(engine, gen, args, vertical: bool):
    batches = []
    for _ in range(args.g):
        x = torch.randint(0, 50257, (1, args.seq), generator=gen)
        batches.append({"input_ids": x, "labels": x})
    t = time.perf_counter()
    r = engine.runtime.train_window(batches, vertical=vertical)
    dt = time.perf_counter() - t
    if r.vertical != vertical:
        raise RuntimeError(f"asked for a {'vertical' if vertical else 'horizontal'} window, got the other")
    rep = r.report
    return {"window_s": dt, "forward_s": rep.forward_s, "backward_s": rep.backward_s,
            "compute_s": rep.compute_s, "fetch_wait_s": rep.fetch_wait_s,
            "recompute_s": rep.recompute_s, "optimizer_wait_s": rep.optimizer_wait_s}  # fmt: skip


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--g", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    ap.add_argument("--torch-profile", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs("runs", exist_ok=True)
    nvme = tempfile.mkdtemp(prefix="vertical-profile-", dir="runs")
    engine = None
    try:
        engine = _engine(args, nvme)
        plan = engine.runtime.plan
        print(
            f"plan: vertical={plan.vertical}, window activations {plan.vertical_activations}, loop {plan.activations}"
        )
        gen = torch.Generator().manual_seed(1)
        _window(engine, gen, args, vertical=False)  # (records the RNG tape)
        rows: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            for v in (False, True):
                rows[v].append(_window(engine, gen, args, v))
        med = {v: {k: statistics.median(r[k] for r in rows[v]) for k in rows[v][0]} for v in rows}
        print(
            f"{args.layers} layers x {args.width}, G={args.g}, seq {args.seq}, bf16; medians of {args.rounds}"
        )
        for k in med[True]:
            h, v = med[False][k], med[True][k]
            print(f"  {k:18s} horizontal {h:8.3f}  vertical {v:8.3f}  ({v / h if h else float('nan'):.3f}x)")
        if args.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            _window(engine, gen, args, True)
            prof.disable()
            pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(args.cprofile)
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            for v in (False, True):
                with profile(activities=[ProfilerActivity.CPU]) as p:
                    _window(engine, gen, args, v)
                print(f"== {'vertical' if v else 'horizontal'} window, ops by self CPU time")
                print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    finally:
        if engine is not None:
            engine.close()
        shutil.rmtree(nvme, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
