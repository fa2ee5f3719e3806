"""The swap directory of a small LoRA run against issue 22's disk bar (the frozen base plus 16 B per
trainable parameter), under each gradient clipping and `speculate` setting (docs/frozen.md "On
disk"). Prints one Markdown row per setting: the bytes of every file in the swap directory after
the steps, and the plan's footprint, each as the base plus so many bytes per trainable parameter.

    python scripts/lora_footprint.py --dir /tmp/fp [--width 512] [--steps 3]

The model: a 2-layer GPT-2 of the given width with peft's LoRA r=8 on the attention and MLP
projections (the adapters about 2% of the base at width 512), through `offloadpp.initialize`
with every array on SSD. tests/test_peft.py asserts the bar on the same shape.
"""

from __future__ import annotations

import argparse
import os
import shutil

SETTINGS = [(0.0, "auto"), (1.0, "auto"), (1.0, "on"), (0.0, "on")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="work folder (one swap directory a setting, removed after)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)

    import peft
    import torch
    import transformers

    import offloadpp
    from offloadpp.planner.plan import flat_numel

    print("| gradient_clipping | speculate | speculative | base bytes | trainable (padded) | swap dir bytes "
          "| B per trainable parameter on disk | the plan's footprint, B per trainable parameter |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for clip, speculate in SETTINGS:
        torch.manual_seed(0)
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=args.width, n_head=4,
                                                                    n_positions=32, vocab_size=96))  # fmt: skip
        lora = peft.LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
        model = peft.get_peft_model(base, lora)
        nvme = os.path.join(args.dir, f"clip{clip:g}-{speculate}")
        os.makedirs(nvme, exist_ok=True)
        off = {"device": "nvme", "nvme_path": nvme}
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": off},
            "offloadpp": {"enabled": True, "speculate": speculate},
        }
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = offloadpp.initialize(model=model, model_parameters=trainable, config=cfg)
        try:
            g = torch.Generator().manual_seed(1)
            for _ in range(args.steps):
                x = torch.randint(0, 96, (2, 16), generator=g)
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
            rt = engine.runtime
            frozen = rt.plan.frozen_ssd_bytes()
            n = sum(flat_numel(u.numel) for u in rt.units)
            disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nvme) for f in fs)
            print(f"| {clip:g} | {speculate} | {rt.plan.speculative} | {frozen:,} | {n:,} | {disk:,} | "
                  f"{(disk - frozen) / n:.2f} | {(rt.plan.ssd_footprint_bytes() - frozen) / n:.2f} |", flush=True)  # fmt: skip
        finally:
            engine.close()
            shutil.rmtree(nvme, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
