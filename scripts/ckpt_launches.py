"""Two-rank checkpoints, launch after launch: N launches of 2 CPU ranks (gloo) under torchrun and
under the deepspeed launcher, each saving with engine.save_checkpoint and resuming exactly.

    .venv/bin/python scripts/ckpt_launches.py --launches 30 [--launcher torchrun|deepspeed|both] [--work DIR]

Each launch (the same file, started by the launcher with --worker) builds a tiny GPT-2 through
offloadpp.initialize from a DeepSpeed JSON config (every array on SSD, clipping), trains 2 steps,
saves tag "a", trains 2 more and keeps the weights; then loads tag "a" into the same engine,
trains the same 2 steps again and compares: the weights (and losses) must be bit for bit the
first run's, on every rank. A launch counts as good only if every rank exits 0 and says so.
Prints one line per launch and a summary `torchrun 30/30 ...`; exits 1 unless every launch
passed. The checkpoint race of issue 25 (a rank reading `.TAG.partial` after rank 0 renamed it)
failed about 7 launches in 10.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 128


def _batches(n: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(n)]


def worker(out: str, nvme: str, ckpt: str) -> None:
    import torch
    import transformers

    import offloadpp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)  # dropout on: the restored RNG states matter
    ds = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
        # (the SSD's speeds given: measuring them at each start would double a launch's time)
        "offloadpp": {"enabled": True, "ssd_read_gbps": 2.0, "ssd_write_gbps": 2.0},
    }
    engine, *_ = offloadpp.initialize(model=model, config=ds)
    batches = _batches(4)

    def train(bs) -> list[float]:
        losses = []
        for b in bs:
            x = b.chunk(world)[rank]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    try:
        train(batches[:2])
        engine.save_checkpoint(ckpt, tag="a")
        want_losses = train(batches[2:])
        want = {k: v.clone() for k, v in engine.module.state_dict().items()}  # (a collective)
        path, _ = engine.load_checkpoint(ckpt, tag="a")
        assert engine.global_steps == 2, engine.global_steps
        got_losses = train(batches[2:])
        got = engine.module.state_dict()
        same = got_losses == want_losses and all(torch.equal(got[k], want[k]) for k in want)
        res = {"rank": rank, "ok": bool(same), "path": path, "losses": [want_losses, got_losses]}
    finally:
        engine.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launcher: str, work: str, timeout: float) -> tuple[bool, str]:
    """One 2-rank launch in a fresh folder; (passed, why not)."""
    if os.path.exists(work):
        shutil.rmtree(work)
    out, nvme, ckpt = (os.path.join(work, n) for n in ("out", "nvme", "ckpt"))
    for d in (out, nvme):
        os.makedirs(d)
    me = os.path.abspath(__file__)
    args = [me, "--worker", out, nvme, ckpt]
    if launcher == "torchrun":
        cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(_port()), *args]
    else:
        cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(_port()), *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    if r.returncode != 0:
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "Error" in ln or "error" in ln]
        return False, f"rc {r.returncode}: " + (lines[-1] if lines else (r.stderr or r.stdout)[-300:])
    for rank in range(2):
        p = os.path.join(out, f"rank{rank}.json")
        if not os.path.isfile(p):
            return False, f"rank {rank} wrote no result"
        res = json.load(open(p))
        if not res["ok"]:
            return False, f"rank {rank}: the resumed run differs ({res['losses']})"
    return True, ""


def main() -> int:
    if "--worker" in sys.argv:  # (the deepspeed launcher puts --local_rank=N before it)
        rest = sys.argv[sys.argv.index("--worker") + 1 :]
        worker(*rest[:3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=30)
    ap.add_argument("--launcher", choices=("torchrun", "deepspeed", "both"), default="both")
    ap.add_argument("--work", default="")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="offloadpp-ckpt-launches-")
    launchers = ("torchrun", "deepspeed") if a.launcher == "both" else (a.launcher,)
    counts = dict.fromkeys(launchers, 0)
    try:
        for i in range(a.launches):  # the launchers alternate: a run cut short has counts of both
            for name in launchers:
                t0 = time.perf_counter()
                ok, why = launch(name, os.path.join(work, f"{name}{i}"), a.timeout)
                counts[name] += ok
                print(f"{name} launch {i + 1}/{a.launches}: {'ok' if ok else 'FAILED ' + why}"
                      f" ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
                shutil.rmtree(os.path.join(work, f"{name}{i}"), ignore_errors=True)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    print(
        " ".join(f"{n} {g}/{a.launches}" for n, g in counts.items()) + " launches saved and resumed exactly"
    )
    return 0 if all(g == a.launches for g in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
