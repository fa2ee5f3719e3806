"""One Hugging Face Trainer (or Accelerate) run, in a process of its own, for tests/test_hf_trainer.py.

Trainer and Accelerate keep process-wide state (AcceleratorState, the DeepSpeed config weakref,
environment variables), so a run with DeepSpeed and one without cannot share a process. Reads a
JSON spec (argv[1]), writes a JSON result (argv[2]) and the final weights (spec["weights"]).

spec: model ("gpt2" | "llama"), lora (peft's LoRA over it), dropout (GPT-2's, 0 unless given),
out (Trainer's output_dir), steps, gas, deepspeed (a config dict or null), save_steps, resume (a
checkpoint folder), save_model (a folder), loop ("trainer" | "accelerate"), samples, small_memory (the whole state dict would not fit: offloadpp's check is
told so, and result["get_state_dict"] says what Accelerate's get_state_dict did).
result["logits"]: the trained model's logits on LOGITS_INPUT, before the save.
"""

from __future__ import annotations

import json
import os
import sys

import torch

VOCAB = 96
LOGITS_INPUT = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


def build_model(kind: str, lora: bool = False, dropout: float = 0.0):
    import transformers

    if lora:  # peft's LoRA r=8 on the attention and MLP projections, lora_B drawn non-zero
        import peft

        targets = ["c_attn", "c_proj", "c_fc"] if kind == "gpt2" else ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"]  # fmt: skip
        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, fan_in_fan_out=kind == "gpt2")
        model = peft.get_peft_model(build_model(kind), cfg)
        torch.manual_seed(100)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        return model
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.x = torch.randint(0, VOCAB, (n, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def trainer_run(spec: dict, result: dict) -> torch.nn.Module:
    from transformers import Trainer, TrainingArguments

    model = build_model(spec["model"], spec.get("lora", False), spec.get("dropout", 0.0))
    args = TrainingArguments(
        output_dir=spec["out"],
        deepspeed=spec["deepspeed"],
        per_device_train_batch_size=2,
        gradient_accumulation_steps=spec["gas"],
        max_steps=spec["steps"],
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        weight_decay=spec.get("weight_decay", 0.1),  # Trainer's two groups: decay on matrices only
        max_grad_norm=1.0,
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 500,
        report_to=[],
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(spec["samples"]))
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    engine = trainer.model_wrapped
    result["engine"] = type(engine).__name__
    result["groups"] = len(trainer.optimizer.param_groups)
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result["lrs"] = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    result["scheduler"] = type(getattr(engine, "lr_scheduler", None)).__name__
    if hasattr(engine, "runtime"):
        result["disk_bytes"] = engine.runtime.disk_bytes()
        result["windows_vertical"] = engine.windows_vertical  # (whole windows: the Trainer's, run_window)
        result["state_on_ssd"] = all(
            not s.resident for u in engine.runtime.units for s in (u.master, u.exp_avg, u.exp_avg_sq)
        )
    if spec.get("save_model"):
        before_save(spec, result, engine, trainer.accelerator)
        trainer.save_model(spec["save_model"])
    return trainer.model


def before_save(spec: dict, result: dict, model, accelerator) -> None:
    model.eval()
    with torch.no_grad():
        result["logits"] = model(input_ids=LOGITS_INPUT.to(model.device)).logits.tolist()
    model.train()
    if spec.get("small_memory"):
        from offloadpp.integrations.deepspeed import export

        export.memory_available = lambda: 1
        try:
            accelerator.get_state_dict(model)
            result["get_state_dict"] = "returned the whole state dict"
        except MemoryError as e:
            result["get_state_dict"] = f"{type(e).__name__}: {e}"


def accelerate_run(spec: dict, result: dict) -> torch.nn.Module:
    """A plain Accelerate loop: accumulate, backward, clip, step, schedule."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from transformers import get_linear_schedule_with_warmup

    plugin = DeepSpeedPlugin(hf_ds_config=spec["deepspeed"]) if spec["deepspeed"] else None
    acc = Accelerator(gradient_accumulation_steps=spec["gas"], deepspeed_plugin=plugin)
    model = build_model(spec["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = get_linear_schedule_with_warmup(opt, 2, spec["steps"])
    loader = torch.utils.data.DataLoader(Tokens(spec["samples"]), batch_size=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    result["engine"] = type(model).__name__
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    if spec.get("save_model"):
        before_save(spec, result, model, acc)
        acc.save_model(model, spec["save_model"], max_shard_size="20KB")  # sharded, with an index
        acc.unwrap_model(model).config.save_pretrained(spec["save_model"])
    return acc.unwrap_model(model)


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    if spec["deepspeed"]:
        import offloadpp

        offloadpp.patch_deepspeed()
    result: dict = {}
    run = accelerate_run if spec.get("loop") == "accelerate" else trainer_run
    model = run(spec, result)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, spec["weights"])
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
