"""Init/train/close cycles on the user's path (a DeepSpeed JSON config through
`offloadpp.initialize`): after each `close()` the process must be back where it started.

    .venv/bin/python scripts/init_close_cycles.py --cycles 20            # the bar of issue 25
    .venv/bin/python scripts/init_close_cycles.py --cycles 4 --dir /tmp/x
    .venv/bin/deepspeed --num_gpus 1 scripts/init_close_cycles.py --cycles 3   # under the launcher

Checked after every cycle against the state after the first (warm-up) cycle, when torch,
DeepSpeed and the I/O engine have opened what they keep for the process: threads, open
descriptors (right after close(), the engine still referenced, too), the swap folder's listing (no swap file left), and RSS within --rss-tolerance
(2%) at the last cycle; /dev/shm against its listing before the first cycle. LOCAL_SIZE=1 is
set as the deepspeed launcher sets it (DeepSpeed's shared-memory all-reduce maps its
/dev/shm buffers only then). Prints one JSON line per cycle and a verdict; exits 1 when a
check fails. tests/test_swapdir.py runs it with fewer cycles.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time


def _snapshot(swap: str, threads_at_most: int | None = None) -> dict:
    """What the process holds now. Worker threads exit asynchronously once shut down: wait
    until the count stops changing, and, given `threads_at_most` (the first cycle's count),
    up to 5 s more for it to come down to that: under load a thread still on its way out can
    hold steady past one 50 ms look, and a leak stays past the 5 s anyway."""
    import psutil

    gc.collect()
    for _ in range(40):
        n = threading.active_count()
        time.sleep(0.05)
        if threading.active_count() == n:
            break
    deadline = time.monotonic() + 5.0
    while (
        threads_at_most is not None
        and threading.active_count() > threads_at_most
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
        gc.collect()
    return {
        "threads": threading.active_count(),
        "thread_names": sorted(t.name for t in threading.enumerate()),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        "shm": sorted(n for n in os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else [],
        "swap": sorted(os.listdir(swap)) if os.path.isdir(swap) else [],
    }


def _config(nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
        "offloadpp": {"enabled": True},
    }


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def cycle(nvme: str, steps: int) -> int:
    """One init/train/close; returns the descriptors close() left open that the process did
    not have before initialize (the engine still referenced, as a caller holds it)."""
    import torch
    import transformers

    import offloadpp

    torch.manual_seed(0)
    before = _fds()
    cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=64, vocab_size=512)
    engine, *_ = offloadpp.initialize(model=transformers.GPT2LMHeadModel(cfg), config=_config(nvme))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 512, (2, 32), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.close()
    return _fds() - before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--steps", type=int, default=2, help="training steps per cycle")
    ap.add_argument("--dir", default=None, help="the nvme path (default: a temporary folder)")
    ap.add_argument("--rss-tolerance", type=float, default=0.02)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = ap.parse_args(argv)
    os.environ.setdefault("LOCAL_SIZE", "1")  # as the deepspeed launcher sets it
    import transformers

    transformers.logging.set_verbosity_error()
    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="offloadpp-cycles-")
        args.dir = tmp.name
    os.makedirs(args.dir, exist_ok=True)
    swap = os.path.join(args.dir, "offloadpp")
    shm_before = _snapshot(swap)["shm"]
    failures: list[str] = []
    base = None
    for i in range(args.cycles):
        kept_open = cycle(args.dir, args.steps)
        now = _snapshot(swap, None if base is None else base["threads"])
        print(json.dumps({"cycle": i, "fds_open_after_close": kept_open, **{k: v for k, v in now.items() if k != "shm"},
                          "shm_new": sorted(set(now["shm"]) - set(shm_before))}), flush=True)  # fmt: skip
        left = [n for n in now["swap"] if n.endswith(".oswp")]
        if left:
            failures.append(f"cycle {i}: {len(left)} swap files left after close(), e.g. {left[0]}")
        new_shm = sorted(set(now["shm"]) - set(shm_before))
        if new_shm:
            failures.append(f"cycle {i}: new in /dev/shm: {new_shm}")
        if base is None:
            base = now  # (the first cycle's own descriptors: what torch and DeepSpeed keep open)
            continue
        if kept_open > 0:
            failures.append(
                f"cycle {i}: close() left {kept_open} more descriptors open than before initialize"
            )
        for key in ("threads", "fds"):
            if now[key] > base[key]:
                names = (
                    f" ({now['thread_names']}, after the first cycle {base['thread_names']})"
                    if key == "threads"
                    else ""
                )
                failures.append(f"cycle {i}: {key} {now[key]}, {base[key]} after the first cycle{names}")
        if now["swap"] != base["swap"]:
            failures.append(
                f"cycle {i}: the swap folder holds {now['swap']}, after the first cycle {base['swap']}"
            )
    if base is not None and args.cycles > 1:
        growth = now["rss_mb"] / base["rss_mb"] - 1
        verdict = f"RSS {base['rss_mb']} -> {now['rss_mb']} MB ({growth:+.1%}) over {args.cycles - 1} cycles"
        if growth > args.rss_tolerance:
            failures.append(f"{verdict}: more than {args.rss_tolerance:.0%}")
        print(verdict)
    if tmp is not None:
        tmp.cleanup()
    for f in dict.fromkeys(failures):
        print("FAIL:", f)
    print("cycles: ok" if not failures else f"cycles: {len(failures)} failed check(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
