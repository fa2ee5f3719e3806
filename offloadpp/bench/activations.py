"""`offloadpp bench activations`: the step time of one GPT-2-style model under each activation
policy (keep, host, ssd, recompute; "none" is plain torch without the hooks), in one process.

The model and its AdamW live in device memory (CUDA when present, else the CPU acts as the
device; --device picks); only the activation policy
changes between contenders, each with its own ActivationManager whose hooks are installed for
its steps only. Contenders take one step each, in an order rotated every round (interleaved), after
untimed warm-up steps; the table shows medians. Per step: forward, backward, optimizer, the waits
for swap-outs (budget) and swap-ins (backward), recompute time, bytes moved, SSD busy time, the
accounted activation peak. Bar: ssd <= 1.3x keep at some batch size (where compute is long
enough to hide the I/O); each batch size in --batch is a separate measurement.
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
from types import SimpleNamespace

BAR = 1.3
CONTENDERS = ("none", "keep", "host", "ssd", "recompute")
# selectable too: the checkpoint swapped to SSD, partial (selective) recompute with its kept
# outputs on SSD, the nested recompute from a checkpoint on SSD, and the planner's choice for the budget
EXTRA = ("recompute_ssd", "partial_ssd", "recompute_nested_ssd", "plan")
PLAN_BAR = 1.15  # the planner's choice against keeping everything (no budget)
BYTES_BAR = 0.10  # its measured activation bytes against the cost model's


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (logits and loss stay on the device)")
    p.add_argument("--seq", type=int, default=256, help="sequence length")
    p.add_argument("--batch", default="2,8", help="micro-batch sizes, comma-separated: one measurement each")
    p.add_argument(
        "--policies",
        default=",".join(CONTENDERS),
        help=f"contenders, from {','.join(CONTENDERS + EXTRA)} (plan: the planner's policies for --budget-frac, "
        "scored by the cost model with --hardware)",
    )
    p.add_argument("--hardware", default=None, help="hardware profile JSON for `plan` (offloadpp profile)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender and batch size")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender first")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument(
        "--budget-frac", type=float, default=None, help="activation budget as a fraction of keep's peak"
    )
    p.add_argument("--prefetch-units", type=int, default=2, help="backward fetches this many units ahead")
    p.add_argument("--min-swap-kib", type=int, default=64, help="storages below this many KiB are kept")
    p.add_argument("--dir", default=os.path.join("runs", "bench-act"), help="swap directory (removed after)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from offloadpp.bench.step import _machine
    from offloadpp.io import TensorStore
    from offloadpp.planner import ActivationSettings
    from offloadpp.runtime.activations.manager import ActivationManager
    from offloadpp.runtime.partition import find_units

    torch.set_num_threads(args.threads)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    bad = [s for s in policies if s not in CONTENDERS + EXTRA]
    if bad or "keep" not in policies:
        raise SystemExit(
            f"--policies must name contenders from {CONTENDERS + EXTRA} and include keep, got {policies}"
        )
    if "plan" in policies and (args.budget_frac is None or args.hardware is None):
        raise SystemExit(
            "--policies plan needs --budget-frac and --hardware (the planner's budget and profile)"
        )
    from offloadpp.runtime.accel.cuda import available as cuda_available

    batches = [int(b) for b in args.batch.split(",")]
    cfg = GPT2Config(
        n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, n_positions=max(1024, args.seq),
        vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    device = torch.device(args.device or ("cuda" if cuda_available() else "cpu"))
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    modules = dict(model.named_modules())
    units = [(d.name, [modules[q] for q in d.modules]) for d in find_units(model)]
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    results = []
    store = TensorStore([args.dir])
    env = SimpleNamespace(
        torch=torch, model=model, opt=opt, units=units, store=store, policies=policies, device=device,
        Manager=ActivationManager, Config=ActivationSettings, gpt2=cfg.to_dict(),
    )  # fmt: skip
    try:
        for batch in batches:
            results.append(_measure(args, env, batch))
    finally:
        store.close()
        shutil.rmtree(args.dir, ignore_errors=True)
    report = {
        "bench": "activations",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "offloadpp bench activations "
        + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "activations"] else sys.argv[1:]),
        "machine": _machine(),
        "torch_threads": args.threads,
        "device": str(device),
        "model": {
            "n_layer": args.n_layer,
            "n_embd": args.n_embd,
            "vocab": args.vocab,
            "params": n_params,
            "seq": args.seq,
        },
        "bar_ssd_vs_keep": BAR,
        "results": results,
    }
    ok = [r["batch"] for r in results if "ssd" in r["median"] and r["ssd_vs_keep"] <= BAR]
    report["pass_batches"] = ok
    report["pass"] = bool(ok) or "ssd" not in policies
    planned = [r for r in results if "plan" in r]
    if planned:
        report["bar_plan_vs_keep"], report["bar_plan_bytes_error"] = PLAN_BAR, BYTES_BAR
        report["pass_plan"] = all(
            r["plan_vs_keep"] <= PLAN_BAR and r["plan"]["bytes_error"] <= BYTES_BAR for r in planned
        )
        report["pass"] = report["pass"] and report["pass_plan"]
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["pass"] else 1


def _measure(args, env: SimpleNamespace, batch: int) -> dict:
    torch, model, opt, units, store = env.torch, env.model, env.opt, env.units, env.store
    policies, device, ActivationManager, ActivationSettings = (
        env.policies,
        env.device,
        env.Manager,
        env.Config,
    )
    g = torch.Generator().manual_seed(args.seed + batch)
    data = [torch.randint(0, args.vocab, (batch, args.seq), generator=g).to(device) for _ in range(2)]
    cuda = device.type == "cuda"
    rows: dict[str, list[dict]] = {p: [] for p in policies}
    state = {"i": 0}

    def make(policy: str, budget, planned=None):
        if policy == "none":
            return None
        cfg = ActivationSettings(
            policy="keep" if policy == "plan" else policy,
            budget_bytes=budget,
            prefetch_units=args.prefetch_units,
            min_swap_bytes=args.min_swap_kib << 10,
        )
        return ActivationManager(units, cfg, store=store, device=device, model=model, policies=planned)

    def step(policy: str, mgr, timed: bool) -> None:
        x = data[state["i"] % len(data)]
        state["i"] += 1
        io0 = store.stats
        if mgr is not None:
            mgr.install()
            mgr.reset_stats()
        if cuda:
            torch.accelerator.synchronize(device)
            base = torch.accelerator.memory_allocated(device)
            torch.accelerator.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        with mgr.forward() if mgr is not None else _null():
            loss = model(input_ids=x, labels=x).loss
        if cuda:
            torch.accelerator.synchronize(device)
        t1 = time.perf_counter()
        if mgr is not None:
            mgr.backward(loss)
        else:
            loss.backward()
        if cuda:
            torch.accelerator.synchronize(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.accelerator.synchronize(device)
        t3 = time.perf_counter()
        io = store.stats - io0
        row = {"step_s": t3 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2}
        if cuda:  # the allocator's peak above what was allocated before the step (includes grads)
            row["cuda_peak_bytes"] = torch.accelerator.max_memory_allocated(device) - base
        if mgr is not None:
            mgr.remove()
            s = mgr.stats()
            row.update(
                swap_out_wait_s=s.swap_out_wait_s, swap_in_wait_s=s.swap_in_wait_s, recompute_s=s.recompute_s,
                saved_bytes=s.saved_bytes, d2h_bytes=s.d2h_bytes, h2d_bytes=s.h2d_bytes,
                ssd_write_bytes=s.ssd_write_bytes, ssd_read_bytes=s.ssd_read_bytes,
                ssd_write_busy_s=io.write_seconds, ssd_read_busy_s=io.read_seconds,
                peak_act_bytes=s.peak_device_bytes, fetch_misses=s.fetch_misses,
            )  # fmt: skip
        if timed:
            rows[policy].append(row)

    # keep's peak sizes the budget (when asked for one); then every contender warms up.
    keep = make("keep", None)
    step("keep", keep, False)
    keep_peak = keep.stats().peak_device_bytes
    budget = int(keep_peak * args.budget_frac) if args.budget_frac else None
    planned = _plan(args, env, batch, budget) if "plan" in policies else None
    # keep cannot honour a budget: it is the unbounded reference the others are held to
    mgrs = {p: (keep if p == "keep" else make(p, budget, planned["policies"] if p == "plan" else None))
            for p in policies}  # fmt: skip
    for p in policies:
        for _ in range(args.warmup):
            step(p, mgrs[p], False)
    for r in range(args.steps):
        order = policies[r % len(policies) :] + policies[: r % len(policies)]
        for p in order:
            step(p, mgrs[p], True)
        _log(
            f"batch {batch}: round {r + 1}/{args.steps} "
            + " ".join(f"{p}={rows[p][-1]['step_s']:.2f}s" for p in policies)
        )
    for m in mgrs.values():
        if m is not None:
            m.close()
    if keep is not mgrs.get("keep"):
        keep.close()
    med = {p: {k: statistics.median(row[k] for row in rows[p]) for k in rows[p][0]} for p in policies}
    out = {
        "batch": batch,
        "tokens": batch * args.seq,
        "keep_peak_bytes": keep_peak,
        "budget_bytes": budget,
        "median": med,
        "samples": rows,
    }
    if args.hardware:  # the cost model's terms beside each fixed contender's measured ones
        out["modelled"] = {
            p: {**_modelled(args, env, batch, budget, p), "measured_ssd_bytes": med[p]["ssd_write_bytes"]
                + med[p]["ssd_read_bytes"], "measured_recompute_s": med[p]["recompute_s"]}
            for p in policies if p in ("host", "ssd", "recompute", "recompute_ssd", "partial_ssd", "recompute_nested_ssd")
        }  # fmt: skip
    if planned is not None:
        got = med["plan"]
        moved = got["ssd_write_bytes"] + got["ssd_read_bytes"]
        want = planned["ssd_write_bytes"] + planned["ssd_read_bytes"]
        planned["measured_ssd_bytes"] = moved
        planned["bytes_error"] = abs(moved - want) / want if want else float(moved > 0)
        planned["measured_recompute_s"] = got["recompute_s"]
        planned["measured_peak_bytes"] = got["peak_act_bytes"]
        out["plan"] = planned
    for p in policies:
        out[f"{p}_vs_keep"] = med[p]["step_s"] / med["keep"]["step_s"]
        out[f"{p}_fb_vs_keep"] = (med[p]["forward_s"] + med[p]["backward_s"]) / (
            med["keep"]["forward_s"] + med["keep"]["backward_s"]
        )
    return out


def _modelled(args, env: SimpleNamespace, batch: int, budget, policy: str) -> dict:
    """The cost model's activation terms for every unit under `policy` (units that cannot
    recompute keep), for the fixed contenders: what it moves to and from SSD and recomputes."""
    from offloadpp.planner import HardwareProfile, analytic_profile
    from offloadpp.planner.activations import act_units, recompute_fraction, recomputes
    from offloadpp.planner.cost import compute_times, estimate

    hw = HardwareProfile.from_json(args.hardware)
    prof = analytic_profile(env.gpt2, micro_batch=batch, seq_len=args.seq, compute_dtype="fp32")
    plan = _memory_plan(prof, budget)
    pol = {u.name: ("keep" if recomputes(policy) and not u.backward_needs_weights else policy)
           for u in prof.units}  # fmt: skip
    est = estimate(plan, hw, prof, activations=pol, act_prefetch_units=args.prefetch_units)
    fwd_s, _ = compute_times(plan, hw, prof)
    again = [n for n, p in pol.items() if recomputes(p)]
    acts = {a.name: a for a in act_units(prof)}
    # as the replay charges it (simulate_act.py recompute_s): partial runs no matmul again, nested
    # its pieces but the last once more
    return {"ssd_write_bytes": est.ssd_write_bytes, "ssd_read_bytes": est.ssd_read_bytes,
            "recompute_s": sum(fwd_s[n] * recompute_fraction(pol[n], acts[n]) + hw.runtime_forward_visit_s
                               for n in again),
            "peak_activation_bytes": est.peak_activation_bytes}  # fmt: skip


def _memory_plan(prof, budget):
    """A plan with the model and its optimizer in memory, so that the cost model's SSD bytes are
    the activations' alone."""
    from offloadpp.planner import Budgets
    from offloadpp.planner.plan import Placement, Plan, Tier

    big = 1 << 50
    return Plan(prof.unit_specs(), tuple(Placement(u.name, Tier.DEVICE, Tier.HOST, Tier.HOST) for u in prof.units),
                "cpu", "fp32", 0, 0, budgets=Budgets(big, big, activation_bytes=budget))  # fmt: skip


def _plan(args, env: SimpleNamespace, batch: int, budget: int) -> dict:
    """The planner's activation policies for `budget` (planner/activations.py candidates, each
    replayed by the cost model on --hardware with the model and its optimizer in memory, the
    fastest kept), with what the cost model says they move and recompute."""
    from offloadpp.planner import HardwareProfile, analytic_profile
    from offloadpp.planner.act_candidates import ActPlanner
    from offloadpp.planner.activations import act_units, recomputes
    from offloadpp.planner.cost import compute_times, estimate

    hw = HardwareProfile.from_json(args.hardware)
    prof = analytic_profile(env.gpt2, micro_batch=batch, seq_len=args.seq, compute_dtype="fp32")
    names = [n for n, _ in env.units]
    if [u.name for u in prof.units] != names:
        raise SystemExit(
            f"the analytic profile's units {[u.name for u in prof.units]} are not the model's {names}"
        )
    plan = _memory_plan(prof, budget)
    choices = ActPlanner(act_units(prof), {}, device="cpu").candidates(budget)
    if not choices:
        raise SystemExit(f"batch {batch}: no activation policy fits the budget of {budget} bytes")
    scored = [(estimate(plan, hw, prof, activations=c.as_dict(), act_prefetch_units=args.prefetch_units), c)
              for c in choices]  # fmt: skip
    est, best = min(scored, key=lambda x: x[0].step_s)
    flops = {u.name: u.forward_flops for u in prof.units}
    fwd_s, _ = compute_times(plan, hw, prof)
    again = [n for n, p in best.policies if recomputes(p)]
    recompute_flops = sum(flops[n] for n in again)
    return {
        "label": best.label,
        "policies": [p for _, p in best.policies],
        "need_bytes": best.need_bytes,
        "candidates": len(choices),
        "estimate_step_s": est.step_s,
        "ssd_write_bytes": est.ssd_write_bytes,
        "ssd_read_bytes": est.ssd_read_bytes,
        "peak_activation_bytes": est.peak_activation_bytes,
        "recompute_flops": recompute_flops,
        # the replay's recompute time: each unit's forward again (FLOPs / FLOP/s) and its visit
        "recompute_s": sum(fwd_s[n] + hw.runtime_forward_visit_s for n in again),
    }


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _print(report: dict) -> None:
    mb = 1 / (1 << 20)
    m = report["model"]
    print(
        f"activation swapping, GPT-2 {m['n_layer']} layers x {m['n_embd']}, vocab {m['vocab']}, {m['params'] / 1e6:.1f}M params, "
        f"seq {m['seq']}, fp32, device {report['device']}, {report['torch_threads']} threads ({report['date']})"
    )
    cols = (
        "step",
        "x keep",
        "fwd",
        "bwd",
        "opt",
        "out-wait",
        "in-wait",
        "recomp",
        "d2h MB",
        "ssd w MB",
        "ssd r MB",
        "ssd busy",
        "peak MB",
    )
    for r in report["results"]:
        budget = f", budget {r['budget_bytes'] * mb:.0f} MB" if r["budget_bytes"] else ""
        print(
            f"\nbatch {r['batch']} ({r['tokens']} tokens), keep-all activation peak {r['keep_peak_bytes'] * mb:.0f} MB{budget}"
        )
        print(f"{'policy':<10}" + "".join(f"{c:>10}" for c in cols))
        for p, d in r["median"].items():
            vals = [
                f"{d['step_s']:.3f}",
                f"{r[f'{p}_vs_keep']:.3f}",
                f"{d['forward_s']:.3f}",
                f"{d['backward_s']:.3f}",
                f"{d['optimizer_s']:.3f}",
            ]
            if "saved_bytes" in d:
                busy = d["ssd_write_busy_s"] + d["ssd_read_busy_s"]
                vals += [
                    f"{d['swap_out_wait_s']:.3f}", f"{d['swap_in_wait_s']:.3f}", f"{d['recompute_s']:.3f}",
                    f"{d['d2h_bytes'] * mb:.0f}", f"{d['ssd_write_bytes'] * mb:.0f}", f"{d['ssd_read_bytes'] * mb:.0f}",
                    f"{busy:.3f}", f"{d['peak_act_bytes'] * mb:.0f}",
                ]  # fmt: skip
            else:
                vals += ["-"] * 8
            print(f"{p:<10}" + "".join(f"{v:>10}" for v in vals))
    if any("ssd" in r["median"] for r in report["results"]):
        print(
            f"\nbar: ssd <= {report['bar_ssd_vs_keep']}x keep: "
            + (f"met at batch {report['pass_batches']}" if report["pass_batches"] else "NOT met")
        )
    for r in report["results"]:
        for p, d in r.get("modelled", {}).items():
            print(
                f"batch {r['batch']} {p}: SSD bytes measured {d['measured_ssd_bytes'] * mb:.1f} MB vs cost model "
                f"{(d['ssd_write_bytes'] + d['ssd_read_bytes']) * mb:.1f} MB; recompute measured "
                f"{d['measured_recompute_s']:.3f} s vs cost model {d['recompute_s']:.3f} s"
            )
        pl = r.get("plan")
        if pl is None:
            continue
        print(
            f"\nbatch {r['batch']}: plan = {pl['label']} ({pl['candidates']} candidates), budget "
            f"{r['budget_bytes'] * mb:.0f} MB = 1/{r['keep_peak_bytes'] / r['budget_bytes']:.2f} of keep-all's "
            f"{r['keep_peak_bytes'] * mb:.0f} MB; policies {pl['policies']}"
        )
        print(
            f"  step {r['plan_vs_keep']:.3f}x keep (bar <= {PLAN_BAR}); activation SSD bytes measured "
            f"{pl['measured_ssd_bytes'] * mb:.1f} MB vs cost model {(pl['ssd_write_bytes'] + pl['ssd_read_bytes']) * mb:.1f} MB "
            f"({pl['bytes_error']:.1%}, bar <= {BYTES_BAR:.0%}); accounted peak {pl['measured_peak_bytes'] * mb:.1f} MB vs "
            f"replay {pl['peak_activation_bytes'] * mb:.1f} MB; recompute {pl['measured_recompute_s']:.3f} s measured vs "
            f"{pl['recompute_s']:.3f} s by the cost model ({pl['recompute_flops'] / 1e9:.1f} GFLOP)"
        )
