"""Fine-tune a GPT-2-style model with all training state on disk: a DeepSpeed script, unchanged but
for `offloadpp.initialize` in place of `deepspeed.initialize`.

    deepspeed --num_gpus 1 examples/finetune.py --deepspeed_config ds_configs/demo.offloadpp.json
    python examples/finetune.py --deepspeed_config ds_configs/demo.offloadpp.json \
        --model path/to/hf_model_dir --text my_corpus.txt --steps 100

--model takes a preset name (offloadpp/presets.py), a local Hugging Face model directory (its
weights are loaded) or a config.json (random init). Text is tokenised as bytes unless the model
directory has a tokenizer. Without --text the docstrings of Python's standard library are used.
Without an "offloadpp" block in the config this is plain DeepSpeed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import offloadpp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True)
    p.add_argument("--model", default="gpt2-45m", help="preset name, HF model dir, or config.json")
    p.add_argument("--text", default=None, help="training text file (default: stdlib docstrings)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=os.path.join("runs", "demo"), help="checkpoint and exported weights go here"
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def build_model(spec: str):
    """(model, tokenizer or None, default seq_len) from a preset, an HF directory or a config file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from offloadpp.presets import PRESETS

    if spec in PRESETS:
        preset = PRESETS[spec]
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(preset.gpt2_config()), None, preset.seq_len
    if os.path.isdir(spec):
        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True, torch_dtype=torch.float32)
        tokenizer = None
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError):
            pass  # no tokenizer files: byte-level tokens
        return model, tokenizer, 128
    if os.path.isfile(spec):
        config = AutoConfig.from_pretrained(spec, local_files_only=True)
        return AutoModelForCausalLM.from_config(config), None, 128
    raise SystemExit(
        f"--model {spec!r}: not a preset ({sorted(PRESETS)}), a model directory or a config file"
    )


def token_batches(text: str, tokenizer, micro_batch: int, seq_len: int, seed: int):
    from offloadpp.bench.data import byte_batches

    if tokenizer is None:
        yield from byte_batches(text, micro_batch, seq_len, seed)
        return
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, ids.numel() - seq_len - 1, (micro_batch,), generator=gen).tolist()
        batch = torch.stack([ids[s : s + seq_len] for s in starts])
        yield batch, batch.clone()


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    from offloadpp.bench.data import load_text

    torch.manual_seed(args.seed)
    model, tokenizer, seq_len = build_model(args.model)
    seq_len = args.seq_len or seq_len
    engine, _, _, _ = offloadpp.initialize(args=args, model=model, model_parameters=model.parameters())

    text = load_text(args.text)
    batches = token_batches(text, tokenizer, engine.train_micro_batch_size_per_gpu(), seq_len, args.seed)
    gas = engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_batch_size() * seq_len
    bar = tqdm(range(args.steps), desc="fine-tuning", unit="step", file=sys.stdout)
    for _ in bar:
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(gas):
            ids, labels = next(batches)
            ids, labels = (
                ids.to(engine.device),
                labels.to(engine.device),
            )  # the engine's device (LOCAL_RANK's)
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        dt = time.perf_counter() - t0
        bar.set_postfix(
            loss=f"{total / gas:.4f}", tok_s=f"{tokens_per_step / dt:.0f}", lr=f"{engine.get_lr()[0]:.2e}"
        )

    os.makedirs(args.out, exist_ok=True)
    engine.save_checkpoint(os.path.join(args.out, "checkpoint"))
    export_dir = os.path.join(args.out, "model")
    engine.save_16bit_model(export_dir, "model.safetensors")
    if hasattr(model, "config"):
        model.config.save_pretrained(export_dir)
    print(f"checkpoint: {os.path.join(args.out, 'checkpoint')}  exported weights: {export_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
