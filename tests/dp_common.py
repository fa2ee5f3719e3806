"""The model, data and hyper-parameters the data-parallel tests share with their rank workers."""

from __future__ import annotations

import torch

LR, WD = 1e-3, 0.01
VOCAB = 128
GLOBAL_BATCH = 4  # sequences per optimizer step, over every rank and micro-batch
SEQ = 16


def tiny_gpt2(seed: int = 0, freeze: bool = False, lora: bool = False):
    """freeze: the position embeddings and the first block's MLP frozen (requires_grad False).
    lora: wrapped by peft's get_peft_model, LoRA r=4 on the attention and MLP input projections
    (the whole base frozen), lora_B drawn non-zero so every adapter trains from the first step."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg)
    if freeze:
        model.transformer.wpe.requires_grad_(False)
        model.transformer.h[0].mlp.requires_grad_(False)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                                           lora_dropout=0.0, fan_in_fan_out=True))  # fmt: skip
        torch.manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def global_batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(n)]


def reference(steps: int, *, clip: float, parts=1, freeze: bool = False, lora: bool = False) -> dict:
    """One process, torch AdamW stepping on each global batch's mean loss, clipped by global
    norm; parts > 1: the batch's gradient accumulated over that many equal parts, as the ranks
    sum theirs (the same gradient, summed in the ranks' order); a sequence: each step's parts (a
    run resumed at other world sizes)."""
    model = tiny_gpt2(freeze=freeze, lora=lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    per_step = [parts] * steps if isinstance(parts, int) else list(parts)
    for x, n in zip(global_batches(steps), per_step, strict=True):
        for part in x.chunk(n):
            (model(input_ids=part, labels=part).loss / n).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict()
