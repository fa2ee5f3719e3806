"""`offloadpp bench ab`: the same model, data, seed and initial weights under stock ZeRO-Infinity and
under offloadpp, each in its own process, side by side in one invocation.

Prints a table (step time, tokens/s, achieved FLOP/s, peak RSS, peak device memory, SSD bytes read
and written, final loss), writes the JSON of both runs and a PNG with the loss curves and the
step-time bars.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

# window: offloadpp with each step's window driven whole by train_batch, vertically (ab_worker)
SIDES = ("zero", "offloadpp", "window")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        required=True,
        help="DeepSpeed JSON with ZeRO-Infinity settings (offloadpp block optional)",
    )
    p.add_argument("--model", default="gpt2-45m", help="model preset (offloadpp/presets.py)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nvme-dir", default=os.path.join("runs", "ab"), help="parent of each side's swap dir")
    p.add_argument("--out", default=os.path.join("runs", "ab"), help="where the JSON and PNG go")
    p.add_argument(
        "--sides",
        default="zero,offloadpp",
        help="comma-separated subset of zero,offloadpp,window (window: train_batch, vertical windows)",
    )
    p.add_argument(
        "--no-interleave",
        dest="interleave",
        action="store_false",
        help="run the sides one after the other instead of taking turns (both processes are alive "
        "at once when interleaving: use this when the two together do not fit in memory)",
    )
    p.add_argument(
        "--turn-steps", type=int, default=2, help="steps each side runs per turn when interleaving"
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument(
        "--init", default=None, help="initial weights (safetensors) both sides load (default: fresh)"
    )
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=0,
        help="start from a trained model: the preset trained in memory this many steps on the same text "
        "(torch AdamW, clipping 1.0; bench/pretrain.py), saved under --out, then the A/B fine-tunes it",
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="cap each side's CUDA memory (the per-process memory fraction), e.g. 24 for a 24 GiB card "
        "on a larger GPU; no effect without CUDA",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_init(model: str, seed: int, path: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel

    from offloadpp.presets import get_preset

    torch.manual_seed(seed)
    m = GPT2LMHeadModel(get_preset(model).gpt2_config())
    state = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    save_file(state, path)


class _Side:
    """One side's worker process, started and driven by the harness."""

    def __init__(self, side: str, args, init_path: str, out_dir: str, turns: bool):
        self.side = side
        self.nvme = os.path.join(args.nvme_dir, f"swap-{side}")
        shutil.rmtree(self.nvme, ignore_errors=True)
        os.makedirs(self.nvme)
        self.result_path = os.path.join(out_dir, f"{side}.json")
        env = dict(os.environ)
        # A single-process "distributed" world, as the deepspeed launcher would set up for one GPU.
        env.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
        cmd = [
            sys.executable, "-m", "offloadpp.bench.ab_worker", "--side", side, "--config", args.config,
            "--model", args.model, "--init", init_path, "--steps", str(args.steps), "--seed", str(args.seed),
            "--nvme-dir", self.nvme, "--out", self.result_path,
        ] + (["--turns"] if turns else [])  # fmt: skip
        if args.seq_len:
            cmd += ["--seq-len", str(args.seq_len)]
        if args.device_memory_gib:
            cmd += ["--device-memory-gib", str(args.device_memory_gib)]
        print(f"== {side}: {' '.join(cmd)}", flush=True)
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) if turns else {}
        self.proc = subprocess.Popen(cmd, env=env, **pipes)

    def expect(self, word: str) -> None:
        """Waits for `word` alone on a line; whatever else the worker prints (libraries log to
        stdout) is passed through."""
        for line in self.proc.stdout:
            if line.strip() == word:
                return
            sys.stdout.write(line)
        self.proc.kill()
        raise RuntimeError(f"the {self.side} side exited before saying {word!r}; its output is above")

    def run(self, k: int) -> None:
        self.proc.stdin.write(f"run {k}\n")
        self.proc.stdin.flush()
        self.expect("done")

    def finish(self) -> dict:
        if self.proc.stdin is not None:  # taking turns: the worker waits for leave to wrap up
            self.proc.stdin.write("finish\n")
            self.proc.stdin.flush()
            self.proc.stdin.close()
        rc = self.proc.wait()
        shutil.rmtree(self.nvme, ignore_errors=True)
        if rc != 0:
            raise RuntimeError(f"the {self.side} side failed with exit status {rc} (its output is above)")
        with open(self.result_path) as f:
            return json.load(f)


def run_sides(sides: list[str], args, init_path: str, out_dir: str) -> dict[str, dict]:
    """Both sides start up (one after the other), then take turns of --turn-steps steps each, so a
    change in machine load hits both alike; with --no-interleave each runs alone, in sequence."""
    if not args.interleave or len(sides) == 1:
        out = {}
        for side in sides:
            out[side] = _Side(side, args, init_path, out_dir, turns=False).finish()
        return out
    procs = []
    try:
        for side in sides:
            procs.append(_Side(side, args, init_path, out_dir, turns=True))
            procs[-1].expect("ready")  # start-ups never overlap another side's steps
        done = 0
        while done < args.steps:
            k = min(args.turn_steps, args.steps - done)
            for p in procs:
                p.run(k)
            done += k
        return {p.side: p.finish() for p in procs}
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()


def same_json(results: dict[str, dict]) -> dict:
    """The DeepSpeed JSON every side ran, `aio` block included, less what differs by design (the
    offloadpp block and each side's swap directory); raises when anything else differs."""

    def shared(cfg: dict) -> dict:
        cfg = json.loads(json.dumps(cfg))
        cfg.pop("offloadpp", None)
        for sub in (cfg.get("zero_optimization") or {}).values():
            if isinstance(sub, dict):
                sub.pop("nvme_path", None)
        return cfg

    configs = {side: shared(r["config"]) for side, r in results.items()}
    first = next(iter(configs.values()))
    for side, cfg in configs.items():
        if cfg != first:
            raise RuntimeError(f"the {side} side ran another DeepSpeed JSON: {cfg} vs {first}")
    return first


def summarize(r: dict) -> dict:
    times = [s["seconds"] for s in r["steps"]]
    timed = times[1:] if len(times) > 2 else times  # the first step includes warm-up
    step_s = statistics.median(timed)
    return {
        "step_s": step_s,
        "tokens_per_s": r["tokens_per_step"] / step_s,
        "tflops": 6 * r["params"] * r["tokens_per_step"] / step_s / 1e12,
        "peak_rss_gib": r["peak_rss_bytes"] / 2**30,
        # the steps alone (VmHWM reset after initialize): the engine's, without the model's build
        "steps_peak_rss_gib": r["phase_peak_rss_bytes"]["steps"] / 2**30
        if r.get("phase_peak_rss_bytes", {}).get("steps")
        else None,
        "peak_device_gib": None if r["peak_device_bytes"] is None else r["peak_device_bytes"] / 2**30,
        "ssd_read_gib": r["ssd_read_bytes"] / 2**30,
        "ssd_write_gib": r["ssd_write_bytes"] / 2**30,
        "final_loss": r["steps"][-1]["loss"],
        "device": r.get("device"),
        "device_memory_cap_gib": None
        if not r.get("device_memory_cap_bytes")
        else r["device_memory_cap_bytes"] / 2**30,
    }


def updates_share(ours: dict) -> dict:
    """How offloadpp's steps ran their updates (StepReport.updates per step): the share that
    speculated, and the gradient norms against the clipping limit."""
    ways = ours["updates"]
    norms = [n for n in ours.get("grad_norms", []) if n is not None]
    spec = sum(w == "speculative" for w in ways)
    counts = {w: ways.count(w) for w in sorted(set(ways))}
    line = (f"offloadpp updates: {spec} of {len(ways)} steps speculative ({spec / len(ways):.0%}); "
            + ", ".join(f"{w} {n}" for w, n in counts.items())
            + (f"; gradient norms {min(norms):.3f}-{max(norms):.3f}" if norms else ""))  # fmt: skip
    return {
        "speculative": spec,
        "steps": len(ways),
        "share": spec / len(ways),
        "counts": counts,
        "line": line,
    }


def format_table(summ: dict[str, dict]) -> str:
    rows = [
        ("step time (s, median)", "step_s", "{:.3f}"),
        ("tokens/s", "tokens_per_s", "{:.0f}"),
        ("achieved TFLOP/s (6NT)", "tflops", "{:.4f}"),
        ("peak RSS (GiB)", "peak_rss_gib", "{:.2f}"),
        ("peak RSS of the steps (GiB)", "steps_peak_rss_gib", "{:.2f}"),
        ("peak device mem (GiB)", "peak_device_gib", "{:.2f}"),
        ("SSD read (GiB)", "ssd_read_gib", "{:.2f}"),
        ("SSD written (GiB)", "ssd_write_gib", "{:.2f}"),
        ("final loss", "final_loss", "{:.5f}"),
    ]
    sides = list(summ)
    # ratio columns: each offloadpp side against zero, and the vertical window against offloadpp's
    pairs = [(s, "zero") for s in sides if s != "zero" and "zero" in sides]
    pairs += [("window", "offloadpp")] if {"window", "offloadpp"} <= set(sides) else []
    heads = "".join(f" {a} / {b} |" for a, b in pairs)
    lines = [f"| metric | {' | '.join(sides)} |" + heads]
    lines.append("|---" * (len(sides) + 1 + len(pairs)) + "|")
    for label, key, fmt in rows:
        vals = [summ[s][key] for s in sides]
        cells = ["n/a" if v is None else fmt.format(v) for v in vals]
        ratio = ""
        for a, b in pairs:
            num, den = summ[a][key], summ[b][key]
            ratio += f" {num / den:.3f} |" if den and num is not None else " n/a |"
        lines.append(f"| {label} | {' | '.join(cells)} |{ratio}")
    return "\n".join(lines)


def _plot(results: dict[str, dict], summ: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for side, r in results.items():
        ax1.plot([s["step"] for s in r["steps"]], [s["loss"] for s in r["steps"]], marker="o", label=side)
    ax1.set(xlabel="step", ylabel="loss", title="loss from the same initial weights")
    ax1.legend()
    sides = list(summ)
    ax2.bar(sides, [summ[s]["step_s"] for s in sides], color=["tab:gray", "tab:blue"][: len(sides)])
    ax2.set(ylabel="seconds", title="median step time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        raise SystemExit(f"--sides: unknown side(s) {bad}; choose from {list(SIDES)}")
    if not os.path.isfile(args.config):
        raise SystemExit(f"--config: {args.config!r} does not exist")
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pretrained = None
        if args.init:
            init_path = args.init
        elif args.pretrain_steps:
            from offloadpp.bench.pretrain import pretrain

            init_path = os.path.join(args.out, "pretrained.safetensors")
            pretrained = pretrain(args.model, args.pretrain_steps, args.seed, init_path)
        else:
            init_path = os.path.join(tmp, "init.safetensors")
            _write_init(args.model, args.seed, init_path)
        results = run_sides(sides, args, init_path, args.out)
    shared = same_json(results)
    summ = {s: summarize(r) for s, r in results.items()}
    table = format_table(summ)
    aio = shared.get("aio")
    print(
        f"the same DeepSpeed JSON on {' and '.join(sides)}, aio block {json.dumps(aio) if aio else 'absent'}"
    )
    for s in sides:
        cap = summ[s]["device_memory_cap_gib"]
        print(f"{s}: device {summ[s]['device']}" + (f", memory capped to {cap:.1f} GiB" if cap else ""))
    print(table)
    for s in sides:
        phases = results[s].get("phase_peak_rss_bytes") or {}
        if phases:
            print(
                f"{s}: peak RSS by phase " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in phases.items())
            )
    for other in sides[1:]:
        diffs = [
            abs(a["loss"] - b["loss"]) for a, b in zip(results[sides[0]]["steps"], results[other]["steps"])
        ]
        print(f"max |loss difference| {other} vs {sides[0]} over {len(diffs)} steps: {max(diffs):.2e}")
        summ["max_loss_diff" if len(sides) == 2 else f"max_loss_diff_{other}"] = max(diffs)
    for side in ("offloadpp", "window"):
        ours = results.get(side, {})
        if ours.get("ssd_by_kind"):
            from offloadpp.planner import traffic

            print(
                f"{side}: SSD bytes of a step by kind (medians), the cost model's from {ours['modelled_from']}:"
            )
            print(traffic.table(ours["ssd_by_kind"], ours["modelled_ssd_by_kind"]))
        if ours.get("vertical"):
            print(f"{side}: windows run vertically: {ours['vertical']} (the first records the RNG tape)")
        g1 = ours.get("modelled_g1_ssd_by_kind")
        if g1 and ours.get("ssd_by_kind"):
            window_b = sum(r + w for _, r, w in ours["ssd_by_kind"])
            model_b = sum(r + w for _, r, w in ours.get("modelled_ssd_by_kind") or ())
            one_b = sum(r + w for _, r, w in g1)
            summ[f"{side}_vs_g1_bytes"] = window_b / one_b
            print(
                f"{side}: SSD bytes a window (read + written, medians) {window_b / 2**30:.2f} GiB measured"
                + (f", {model_b / 2**30:.2f} GiB the cost model's" if model_b else "")
                + f"; one step of G = 1 with its plan {one_b / 2**30:.2f} GiB (the cost model's, from "
                f"{ours['modelled_g1_from']}): {window_b / one_b:.2f}x (issue 33's bar: at most 1.3x)"
            )
        if ours.get("updates"):
            summ[f"{side}_updates"] = updates_share(ours)
            print(f"{side}: " + summ[f"{side}_updates"]["line"])
    if pretrained is not None:
        print(f"started from {init_path}: {args.pretrain_steps} steps in memory, last loss "
              f"{pretrained['last_loss']:.4f}, gradient norm {pretrained['last_norms_median']:.3f} (median of the last 20)")  # fmt: skip
        summ["pretrained"] = {k: v for k, v in pretrained.items() if k not in ("losses", "grad_norms")}
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump({"config": args.config, "model": args.model, "summary": summ, "runs": results}, f, indent=2)
    _plot(results, {s: summ[s] for s in sides}, os.path.join(args.out, "ab.png"))
    print(f"wrote {os.path.join(args.out, 'ab.json')} and {os.path.join(args.out, 'ab.png')}")
    return 0
