"""`offloadpp bench dp`: one rank against several on this machine, and the cost model's estimate
for several GPUs of a machine like the paper's.

    offloadpp bench dp [--model gpt2-45m] [--ranks 2] [--steps 8] [--estimate-paper]

Contenders: the same model, the same initial weights and the same global batches (every rank
`micro_batch` sequences; one process takes the whole global batch as one micro-batch, so both
take one optimizer step over the same samples, with the same settings), every array on SSD as
offloadpp.initialize plans it ("auto" budgets). One process runs under plain python, the ranks
under torchrun (gloo, the CPU as each rank's device), one after the other, each in its own swap
folder. Reported per contender (medians over the timed steps): step time, samples/s, each
rank's SSD bytes read and written per step and its swap files on disk, the bytes its
collectives moved and the time they took, and the link bandwidth measured at start. On a CPU
the ranks share the cores: the point is what the partitioning costs and saves per rank, not a
speed-up.

--estimate-paper adds the cost model's step estimate for the GPT-3 13B of docs/paper on 1, 2 and
4 GPUs of a machine like the paper's (docs/paper/rtx4090-12ssd.hardware.json: its 12 SSDs, host
memory and cores shared by the ranks), with the GPUs' collectives at --paper-collective-gbps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PAPER = os.path.join(REPO, "docs", "paper")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-45m", help="model preset (offloadpp/presets.py)")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks of the second contender")
    p.add_argument("--steps", type=int, default=8, help="timed steps per contender (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping by global norm")
    p.add_argument("--dir", default=os.path.join("runs", "bench-dp"), help="swap folders (removed after)")
    p.add_argument(
        "--estimate-paper", action="store_true", help="also the 13B estimates on the paper's machine"
    )
    p.add_argument("--paper-collective-gbps", type=float, default=10.0,
                   help="the paper machine's GPUs' all-gather bus bandwidth, GB/s (an assumption: see docs)")  # fmt: skip
    p.add_argument("--paper-micro-batch", type=int, default=32)
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH")
    # (a rank of a contender: started by this command itself)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def worker(args: argparse.Namespace) -> int:
    """One rank (or the one process): trains and writes its step reports to OUT/rankN.json."""
    import torch

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.presets import get_preset
    from offloadpp.runtime import RuntimeConfig

    preset = get_preset(args.model)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(preset.gpt2_config())
    settings = Settings(gradient_clipping=args.clip)
    os.makedirs(args.dir, exist_ok=True)
    cfg = RuntimeConfig(nvme_paths=[args.dir], settings=settings, device="cpu", log_every=0)
    eng = assemble_engine(model, cfg, hyper=AdamHyper(lr=1e-4, weight_decay=0.01))
    g = torch.Generator().manual_seed(1)
    reports = []
    try:
        for step in range(args.warmup + args.steps):
            batch = torch.randint(
                0, preset.vocab_size, (args.ranks * preset.micro_batch, preset.seq_len), generator=g
            )
            x = batch.chunk(world)[rank]
            eng.backward(eng(input_ids=x, labels=x).loss)
            r = eng.step()
            if step >= args.warmup:
                reports.append(r.as_dict())
        info = {"rank": rank, "world": world, "disk_bytes": eng.disk_bytes(), "reports": reports,
                "params": sum(u.numel for u in eng.units), "link_gbps": getattr(eng, "link_gbps", None)}  # fmt: skip
    finally:
        eng.close()
    with open(os.path.join(args.worker, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
    return 0


def _contender(args: argparse.Namespace, ranks: int, out: str) -> list[dict]:
    d = os.path.join(args.dir, f"ranks{ranks}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    common = ["--worker", out, "--model", args.model, "--ranks", str(args.ranks), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--clip", str(args.clip), "--dir", d]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if ranks == 1:
        cmd = [sys.executable, "-m", "offloadpp", "bench", "dp", *common]
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--nproc_per_node", str(ranks), "--master_port", str(_port()), "-m", "offloadpp",
               "bench", "dp", *common]  # fmt: skip
    _log(f"offloadpp bench dp: {ranks} rank(s): {' '.join(cmd)}")
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    shutil.rmtree(d, ignore_errors=True)
    if r.returncode != 0:
        raise RuntimeError(f"{ranks} rank(s) failed ({r.returncode}):\n{r.stderr[-6000:]}")
    return [json.load(open(os.path.join(out, f"rank{k}.json"))) for k in range(ranks)]


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(infos: list[dict], samples: int) -> dict:
    def med(key: str, k: int = 0) -> float:
        return statistics.median(r[key] for r in infos[k]["reports"])

    step = statistics.median(
        max(i["reports"][s]["step_s"] for i in infos) for s in range(len(infos[0]["reports"]))
    )
    return {
        "ranks": len(infos),
        "step_s": step,
        "samples_per_s": samples / step,
        "ssd_read_bytes_per_rank": med("ssd_read_bytes"),
        "ssd_write_bytes_per_rank": med("ssd_write_bytes"),
        "disk_bytes_per_rank": [i["disk_bytes"] for i in infos],
        "comm_bytes_per_rank": med("comm_bytes"),
        "comm_s": med("comm_s"),
        "floor_s": med("floor_s"),
        "link_gbps": infos[0]["link_gbps"],
        "params": infos[0]["params"],
    }


def paper_estimates(args: argparse.Namespace) -> list[dict]:
    """The cost model's 13B step on 1, 2 and 4 GPUs of the paper's machine: what `offloadpp plan
    --config docs/paper/ds_config.json --model docs/paper/gpt3-13b.config.json --hardware
    docs/paper/rtx4090-12ssd.hardware.json --machine-from-hardware --micro-batch M --ranks N
    --collective-gbps G` prints, through the same resolve stage."""
    from dataclasses import replace

    from offloadpp.assemble import resolve_for_model
    from offloadpp.integrations.deepspeed.build import parse_ds_config, settings_from
    from offloadpp.integrations.deepspeed.config import load_ds_config, parse_block
    from offloadpp.planner.resolve import load_hardware, machine_for
    from offloadpp.presets import hf_config_dict, meta_model

    ds = load_ds_config(os.path.join(PAPER, "ds_config.json"))
    hw_path = os.path.join(PAPER, "rtx4090-12ssd.hardware.json")
    settings = settings_from(parse_ds_config(ds), parse_block(ds)).model_copy(
        update={
            "micro_batch": args.paper_micro_batch,
            "hardware_profile": hw_path,
            "collective_gbps": args.paper_collective_gbps,
        }  # fmt: skip
    )
    hw = load_hardware(hw_path)
    cfg, _ = hf_config_dict(os.path.join(PAPER, "gpt3-13b.config.json"))
    model = meta_model(cfg)
    out = []
    for n in (1, 2, 4):
        machine = replace(machine_for(hw), ranks=n, local_ranks=n)
        e = resolve_for_model(model, settings, device="cuda", machine=machine).estimate
        out.append({"gpus": n, "step_s": e.step_s, "samples_per_s": n * args.paper_micro_batch / e.step_s,
                    "bound": e.bound, "ssd_s": e.ssd_s, "comm_s": e.comm_s, "compute_s": e.compute_s,
                    "ssd_bytes_per_rank": e.ssd_read_bytes + e.ssd_write_bytes, "comm_bytes_per_rank": e.comm_bytes})  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args)
    from offloadpp.presets import get_preset

    preset = get_preset(args.model)
    samples = args.ranks * preset.micro_batch
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, args.ranks):
            out = os.path.join(tmp, f"r{n}")
            os.makedirs(out)
            rows.append(_summary(_contender(args, n, out), samples))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"offloadpp bench dp, {when}: {args.model} ({rows[0]['params'] / 1e6:.1f}M parameters), global batch "
          f"{samples}x{preset.seq_len}, every array on SSD, clip {args.clip:g}, {args.steps} timed steps (medians)")  # fmt: skip
    print(
        "| ranks | step s | samples/s | SSD read / written per rank per step | on disk per rank | "
        "collectives per rank per step | link GB/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        disk = ", ".join(f"{b / 2**20:.0f}" for b in r["disk_bytes_per_rank"])
        comm = f"{r['comm_bytes_per_rank'] / 2**20:.0f} MiB in {r['comm_s']:.3f} s" if r["ranks"] > 1 else "-"
        link = f"{r['link_gbps']:.2f}" if r["link_gbps"] else "-"
        print(f"| {r['ranks']} | {r['step_s']:.3f} | {r['samples_per_s']:.2f} | "
              f"{r['ssd_read_bytes_per_rank'] / 2**20:.0f} / {r['ssd_write_bytes_per_rank'] / 2**20:.0f} MiB | "
              f"{disk} MiB | {comm} | {link} |")  # fmt: skip
    result = {"when": when, "model": args.model, "rows": rows}
    if args.estimate_paper:
        est = paper_estimates(args)
        print(f"\ncost model, GPT-3 13B at micro-batch {args.paper_micro_batch} per GPU on the paper's machine "
              f"(collectives at {args.paper_collective_gbps:g} GB/s):")  # fmt: skip
        print(
            "| GPUs | step s | samples/s | bound | SSD s | collectives s | SSD per rank | collectives per rank |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for e in est:
            print(f"| {e['gpus']} | {e['step_s']:.1f} | {e['samples_per_s']:.2f} | {e['bound']} | {e['ssd_s']:.1f} | "
                  f"{e['comm_s']:.1f} | {e['ssd_bytes_per_rank'] / 1e9:.0f} GB | {e['comm_bytes_per_rank'] / 1e9:.0f} GB |")  # fmt: skip
        result["paper"] = est
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
