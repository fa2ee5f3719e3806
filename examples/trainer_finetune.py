"""Fine-tune with Hugging Face Trainer and a DeepSpeed config: an ordinary Trainer script, which
knows nothing of offloadpp. Started through offloadpp, it trains on offloadpp's engine with the
training state on disk; started plainly, the same script and config train with ZeRO-Infinity.

    mkdir -p runs/nvme   # the config's swap directory (an SSD path in a real config)
    python -m offloadpp run examples/trainer_finetune.py --deepspeed ds_configs/hf_trainer.offloadpp.json
    deepspeed --num_gpus 1 --module offloadpp run examples/trainer_finetune.py \
        --deepspeed ds_configs/hf_trainer.offloadpp.json --max_steps 100
    python examples/trainer_finetune.py --deepspeed ds_configs/hf_trainer.zero_infinity.json  # ZeRO-Infinity

Every TrainingArguments flag works (--max_steps, --learning_rate, --gradient_accumulation_steps,
--save_steps, --resume_from_checkpoint, ...); the config's "auto" values are filled from them.
--model takes a preset name (offloadpp/presets.py: gpt2-tiny, gpt2-45m, gpt2-1.3b) or a local
Hugging Face model directory. The text is the docstrings of Python's standard library, as bytes
(nothing is downloaded); --text names a file instead.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class ScriptArguments:
    model: str = field(default="gpt2-45m", metadata={"help": "preset name or Hugging Face model directory"})
    text: Optional[str] = field(default=None, metadata={"help": "training text (default: stdlib docstrings)"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence"})
    samples: int = field(default=2048, metadata={"help": "sequences in the training set"})
    save_to: Optional[str] = field(
        default=None, metadata={"help": "where trainer.save_model() writes the weights"}
    )


class ByteText(torch.utils.data.Dataset):
    """Fixed windows of the text's bytes (token ids 0..255): no tokenizer, nothing to download."""

    def __init__(self, text: str, seq_len: int, samples: int, seed: int):
        data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)
        starts = torch.randint(
            0, data.numel() - seq_len - 1, (samples,), generator=torch.Generator().manual_seed(seed)
        )
        self.ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(spec: str):
    if os.path.isdir(spec):
        return AutoModelForCausalLM.from_pretrained(spec, local_files_only=True, torch_dtype=torch.float32)
    from transformers import GPT2LMHeadModel

    from offloadpp.presets import get_preset  # model shapes only (Hugging Face configs, built locally)

    return GPT2LMHeadModel(get_preset(spec).gpt2_config())


def main(argv=None) -> int:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script, args = parser.parse_args_into_dataclasses(argv)
    from offloadpp.bench.data import load_text  # the offline corpus (text only)

    torch.manual_seed(args.seed)
    model = build_model(script.model)  # after TrainingArguments, as Trainer's DeepSpeed docs ask
    data = ByteText(load_text(script.text), script.seq_len, script.samples, args.seed)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    print(f"engine: {type(trainer.model_wrapped).__name__}, steps: {trainer.state.global_step}", flush=True)
    if script.save_to:
        trainer.save_model(script.save_to)
        print(f"weights: {script.save_to} (load with from_pretrained)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
