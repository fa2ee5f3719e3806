"""LoRA over a frozen base larger than RAM (issue 22's scale bar, docs/frozen.md).

Builds a Llama-shaped model under `offloadpp.Init` (no weight ever whole in memory), wraps it
with peft's LoRA (r=8 on the attention and MLP projections), trains it through
`offloadpp.initialize` with a ZeRO-Infinity config and the offloadpp block (fp32), saves its
adapters with `engine.save_pretrained` and reads them back; prints each step's time beside the
SSD floor of its reads and writes (the StepReport's bytes over the rates the engine measured at
start), the SSD bytes by kind, the disk footprint and the peak RSS (the kernel's, of this process).

    python scripts/lora_scale.py --dir /work/scratch/22/scale              # ~7B: 28 GB of swap
    python scripts/lora_scale.py --dir /tmp/x --layers 2 --hidden 256 --inter 512 --heads 4 --vocab 512
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time


def _rss() -> float:
    """This process's resident set now, GiB."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="work folder (swap files, adapters); removed at the end")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the work folder")
    ap.add_argument("--block", default="{}", help="offloadpp block keys, a JSON object (e.g. budgets)")
    args = ap.parse_args()

    import peft
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    import offloadpp

    nvme = os.path.join(args.dir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    off = {"device": "nvme", "nvme_path": nvme}
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": off},
        "offloadpp": {"enabled": True, **json.loads(args.block)},
    }
    mc = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.inter,
                     num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                     max_position_embeddings=max(64, args.seq))  # fmt: skip
    t0 = time.perf_counter()
    rss = {"start": _rss()}
    with offloadpp.Init(config=cfg):
        base = LlamaForCausalLM(mc)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model: {n_frozen / 1e9:.2f}B frozen, {n_train / 1e6:.2f}M trainable", flush=True)
    engine, *_ = offloadpp.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg
    )
    rt = engine.runtime
    rss["after initialize"] = _rss()
    out: dict = {"frozen_params": n_frozen, "trainable_params": n_train, "init_s": time.perf_counter() - t0,
                 "disk_bytes": rt.disk_bytes(), "plan_ssd_footprint_bytes": rt.plan.ssd_footprint_bytes(),
                 "frozen_ssd_bytes": rt.plan.frozen_ssd_bytes(), "read_gbps": rt.ssd_read_gbps,
                 "write_gbps": rt.ssd_write_gbps, "steps": []}  # fmt: skip
    print(rt.plan.describe_budgets(), flush=True)
    out["budgets"] = rt.plan.describe_budgets()
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (1, args.seq), generator=g)
        t = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        r = engine.last_report
        step = {"step_s": time.perf_counter() - t, "loss": loss.item(), "ssd_read_bytes": r.ssd_read_bytes,
                "ssd_write_bytes": r.ssd_write_bytes, "ssd_floor_s": r.ssd_s, "floor_s": r.floor_s,
                "by_kind": [list(k) for k in r.ssd_by_kind]}  # fmt: skip
        step["rss_gib"] = _rss()
        out["steps"].append(step)
        print(json.dumps(step), flush=True)
    t = time.perf_counter()
    adapters = os.path.join(args.dir, "adapters")
    engine.save_pretrained(adapters)
    out["save_adapters_s"] = time.perf_counter() - t
    saved = load_file(os.path.join(adapters, "adapter_model.safetensors"))
    mine = {k.replace(".default", ""): v for k, v in rt.trainable_state_dict().items()}
    out["rss_gib"] = rss
    out["adapters_reloaded_equal"] = bool(saved) and all(torch.equal(v, mine[k]) for k, v in saved.items())
    out["adapter_files_bytes"] = sum(os.path.getsize(os.path.join(adapters, f)) for f in os.listdir(adapters))
    out["budget_peaks"] = {b.name: b.run_peak_bytes for b in rt.budget_report()}
    engine.close()
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({k: v for k, v in out.items() if k != "steps"}), flush=True)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if out["adapters_reloaded_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
