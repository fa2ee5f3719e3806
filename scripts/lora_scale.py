"""LoRA over a frozen base larger than RAM (issue 22's scale bar, docs/frozen.md).

Builds a Llama-shaped model under `offloadpp.Init` (no weight ever whole in memory), wraps it
with peft's LoRA (r=8 on the attention and MLP projections), trains it through
`offloadpp.initialize` with a ZeRO-Infinity config and the offloadpp block (fp32), saves its
adapters with `engine.save_pretrained` and reads them back; prints each step's time beside the
SSD floor of its reads and writes (the StepReport's bytes over the rates the engine measured at
start), the SSD bytes by kind, the disk footprint and the peak RSS.

`--zero` then trains the same model under ZeRO-Infinity: the same DeepSpeed JSON without the
offloadpp block (`offloadpp bench capacity --zero`'s config, offloadpp/bench/capacity.py, with
its parameter buffer above the largest parameter), `deepspeed.zero.Init`, the same LoraConfig,
`deepspeed.initialize`, the same steps. Each side is a child process whose resident set the
parent samples twice a second: past `--max-rss-gib` it is killed and reported "killed at X GiB"
with the phase it was in; a side that fails or passes `--timeout` is reported the same way, and
the other side still runs. The peak RSS of each side is the kernel's (wait4's ru_maxrss).

    python scripts/lora_scale.py --dir /work/scratch/22/scale --zero       # ~7B: 28 GB of swap a side
    python scripts/lora_scale.py --dir /tmp/x --zero --layers 2 --hidden 256 --inter 512 --heads 4 --vocab 512
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

GIB = 1 << 30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="work folder (swap files, adapters); removed at the end")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clipping of the DeepSpeed config")
    ap.add_argument("--keep", action="store_true", help="leave the work folder")
    ap.add_argument("--block", default="{}", help="offloadpp block keys, a JSON object (e.g. budgets)")
    ap.add_argument("--zero", action="store_true", help="also train the same model under ZeRO-Infinity")
    ap.add_argument("--only-zero", action="store_true", help="the ZeRO-Infinity side alone")
    ap.add_argument("--max-rss-gib", type=float, default=20.0, help="kill a side past this resident set")
    ap.add_argument("--timeout", type=float, default=1800.0, help="kill a side after this many seconds")
    ap.add_argument("--json", help="also write both sides' results to this file")
    ap.add_argument("--child", choices=("offloadpp", "zero"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _config(args, side: str) -> dict:
    """bench capacity's DeepSpeed JSON, one for both sides; the offloadpp side adds the block."""
    from offloadpp.bench.capacity import ds_config

    nvme = os.path.join(args.dir, side, "nvme")
    os.makedirs(nvme, exist_ok=True)
    opts = SimpleNamespace(batch=1, clip=args.clip, width=args.hidden, offloadpp_block=args.block)
    cfg = ds_config(opts, nvme, side)
    # its parameter buffer is sized for GPT-2's vocabulary: here, above this model's largest parameter
    largest = args.hidden * max(args.vocab, args.inter)
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = int(1.05 * largest)
    return cfg


def _llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=args.layers,
            hidden_size=args.hidden,
            intermediate_size=args.inter,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
            vocab_size=args.vocab,
            max_position_embeddings=max(64, args.seq),
        )  # fmt: skip
    )


def _lora(base):
    import peft

    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))


class _Progress:
    """The child's result so far, rewritten at each phase: a side killed mid-way still says how far it got."""

    def __init__(self, path: str):
        self.path, self.out = path, {"phase": "start", "steps": []}

    def phase(self, name: str, **more) -> None:
        self.out.update(phase=name, **more)
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.out, f)
        os.replace(self.path + ".tmp", self.path)
        print(f"[{self.out.get('side')}] {name}", file=sys.stderr, flush=True)


def _steps(args, engine, prog: _Progress, report=None) -> None:
    import torch

    from offloadpp.bench.capacity import _rss

    g = torch.Generator().manual_seed(1)
    for i in range(args.steps):
        x = torch.randint(0, args.vocab, (1, args.seq), generator=g)
        prog.phase(f"step {i + 1}")
        t = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        step = {"step_s": time.perf_counter() - t, "loss": loss.item(), "rss_gib": _rss() / GIB}
        step.update(report(engine) if report else {})
        prog.out["steps"].append(step)
        print(json.dumps(step), flush=True)


def _offloadpp_report(engine) -> dict:
    r = engine.last_report
    return {"ssd_read_bytes": r.ssd_read_bytes, "ssd_write_bytes": r.ssd_write_bytes, "ssd_floor_s": r.ssd_s,
            "floor_s": r.floor_s, "by_kind": [list(k) for k in r.ssd_by_kind]}  # fmt: skip


def _offloadpp_child(args, prog: _Progress) -> None:
    import torch
    from safetensors.torch import load_file

    import offloadpp
    from offloadpp.bench.capacity import _rss

    cfg = _config(args, "offloadpp")
    t0 = time.perf_counter()
    prog.phase("offloadpp.Init + get_peft_model")
    with offloadpp.Init(config=cfg):
        model = _lora(_llama(args))
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    prog.phase("initialize", frozen_params=n_frozen, trainable_params=n_train)
    engine, *_ = offloadpp.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg
    )
    rt = engine.runtime
    prog.out.update(init_s=time.perf_counter() - t0, rss_after_initialize_gib=_rss() / GIB,
                    disk_bytes=rt.disk_bytes(), plan_ssd_footprint_bytes=rt.plan.ssd_footprint_bytes(),
                    frozen_ssd_bytes=rt.plan.frozen_ssd_bytes(), read_gbps=rt.ssd_read_gbps,
                    write_gbps=rt.ssd_write_gbps, budgets=rt.plan.describe_budgets())  # fmt: skip
    _steps(args, engine, prog, _offloadpp_report)
    # the swap directory after the steps (the base and the adapters' state, every file: issue 22's
    # disk bar, docs/frozen.md "On disk"), each trainable parameter's bytes beyond the base
    nvme = cfg["zero_optimization"]["offload_param"]["nvme_path"]  # (the block's default nvme_paths)
    swap = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nvme) for f in fs)
    prog.out.update(swap_dir_bytes_after_steps=swap,
                    swap_bytes_per_trainable=(swap - rt.plan.frozen_ssd_bytes()) / max(1, n_train))  # fmt: skip
    prog.phase("save_pretrained")
    t = time.perf_counter()
    adapters = os.path.join(args.dir, "offloadpp", "adapters")
    engine.save_pretrained(adapters)
    saved = load_file(os.path.join(adapters, "adapter_model.safetensors"))
    mine = {k.replace(".default", ""): v for k, v in rt.trainable_state_dict().items()}
    prog.out.update(save_adapters_s=time.perf_counter() - t,
                    adapters_reloaded_equal=bool(saved) and all(torch.equal(v, mine[k]) for k, v in saved.items()),
                    adapter_files_bytes=sum(os.path.getsize(os.path.join(adapters, f)) for f in os.listdir(adapters)),
                    budget_peaks={b.name: b.run_peak_bytes for b in rt.budget_report()})  # fmt: skip
    engine.close()
    prog.phase("done")


def _zero_child(args, prog: _Progress) -> None:
    import deepspeed

    from offloadpp.bench.capacity import _log, _rss
    from offloadpp.integrations.deepspeed.op_locks import clear_stale_build_locks

    clear_stale_build_locks(report=_log)  # DeepSpeed JIT-builds its ops: an interrupted build's lock hangs it
    # imported before zero.Init patches torch.Tensor.__new__: transformers' lazy import of its
    # generation code, under the patch, fails in torch._dynamo's polyfills (a signature check)
    from transformers import LlamaForCausalLM  # noqa: F401

    cfg = _config(args, "zero")
    t0 = time.perf_counter()
    prog.phase("zero.Init + get_peft_model")
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        base = _llama(args)
    # get_peft_model after zero.Init, as PEFT's DeepSpeed guide does: inside it, each adapter is
    # partitioned as it is built and peft's own init (B = 0) runs on empty tensors, a no-op
    model = _lora(base)
    n_train = sum(
        p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad
    )
    prog.phase("deepspeed.initialize", trainable_params=n_train, rss_after_zero_init_gib=_rss() / GIB,
               zero_init_s=time.perf_counter() - t0)  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg
    )
    prog.out.update(init_s=time.perf_counter() - t0, rss_after_initialize_gib=_rss() / GIB)
    prog.out["disk_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cfg["zero_optimization"]["offload_param"]["nvme_path"]) for f in fs)  # fmt: skip
    _steps(args, engine, prog)
    prog.phase("done")


def _proc_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0


def _run_side(args, side: str) -> dict:
    """Runs one side as a child under the RSS guard and the timeout; its result (as far as it got),
    its peak RSS (the kernel's) and, where it did not finish, how it failed."""
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", side, "--result", result]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000))  # fmt: skip
    t0, seen, killed = time.perf_counter(), 0, None
    proc = subprocess.Popen(argv, env=env)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        seen = max(seen, _proc_rss(proc.pid))
        if killed is None and seen > args.max_rss_gib * GIB:
            killed = f"killed at {seen / GIB:.1f} GiB (over --max-rss-gib {args.max_rss_gib})"
        elif killed is None and time.perf_counter() - t0 > args.timeout:
            killed = f"killed after {args.timeout:.0f} s (--timeout)"
        if killed:
            os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.5)
    with open(result) as f:
        text = f.read()
    os.unlink(result)
    out = json.loads(text) if text else {"phase": "start", "steps": []}
    rc = os.waitstatus_to_exitcode(status)
    out.update(side=side, exit_status=rc, wall_s=time.perf_counter() - t0,
               peak_rss_gib=max(usage.ru_maxrss * 1024, seen) / GIB)  # fmt: skip
    if out["phase"] != "done":
        out["failed"] = f"{killed or f'exit {rc}'} during {out['phase']}"
    if not args.keep:
        shutil.rmtree(os.path.join(args.dir, side), ignore_errors=True)  # its swap: disk for the other side
    return out


def _summary(o: dict) -> str:
    steps = " / ".join(f"{s['step_s']:.1f}" for s in o["steps"]) or "none"
    init = f"init {o['init_s']:.1f} s" if "init_s" in o else "init not finished"
    how = o.get("failed", "finished")
    return f"{o['side']}: {how}; {init}; steps {steps} s; peak RSS {o['peak_rss_gib']:.2f} GiB"


def main() -> int:
    args = _args()
    if args.child:
        import torch

        torch.manual_seed(0)
        prog = _Progress(args.result)
        prog.out["side"] = args.child
        (_offloadpp_child if args.child == "offloadpp" else _zero_child)(args, prog)
        return 0
    os.makedirs(args.dir, exist_ok=True)
    sides = (["offloadpp"] if not args.only_zero else []) + (["zero"] if args.zero or args.only_zero else [])
    results = []
    try:
        for side in sides:
            results.append(_run_side(args, side))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "steps"}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    for o in results:
        print(_summary(o), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    ours = next((o for o in results if o["side"] == "offloadpp"), None)
    return 0 if ours is None or ours.get("adapters_reloaded_equal") else 1


if __name__ == "__main__":
    sys.exit(main())
