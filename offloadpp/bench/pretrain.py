"""A trained starting point for `offloadpp bench ab --pretrain-steps N`: the preset's model
trained in memory (torch AdamW, gradient clipping 1.0) for N steps on the A/B's own text (byte
tokens of the standard library's docstrings, bench/data.py) in another batch order, saved as
the initial weights both sides load.

Note: why. A fine-tune starts from a trained model, whose gradient norms are far smaller than a
fresh model's (33 at the first step of GPT-2 45M from random weights, 8 by the sixth): with
clipping at 1.0 (the Hugging Face Trainer's default) the norms decide whether a step clips, and
so whether offloadpp's updates can run during backward (speculation) or wait for the norm (a
deferred step). An A/B from random weights measures only the deferred step.
"""

from __future__ import annotations

import json
import math
import time
from typing import Callable

PRETRAIN_SEED_OFFSET = 1000  # the pre-training batch order differs from the A/B's (seed + this)
PRETRAIN_LR = 5e-4
PRETRAIN_CLIP = 1.0


def pretrain(model_name: str, steps: int, seed: int, path: str, log: Callable[[str], None] = print) -> dict:
    """Trains the preset `model_name` (initialised with `seed`, as bench ab's fresh weights are)
    for `steps` steps and writes its weights to `path` (safetensors, the tied head left out);
    returns what it did: losses and pre-clipping gradient norms per step, seconds."""
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel

    from offloadpp.bench.data import byte_batches, stdlib_docstrings
    from offloadpp.presets import get_preset

    preset = get_preset(model_name)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(preset.gpt2_config())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.01)
    data = byte_batches(
        stdlib_docstrings(), preset.micro_batch, preset.seq_len, seed=seed + PRETRAIN_SEED_OFFSET
    )
    losses, norms = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        ids, labels = next(data)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), PRETRAIN_CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == steps - 1:
            log(f"[pretrain] step {step} loss {losses[-1]:.4f} grad norm {norms[-1]:.3f}")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, path)
    tail = norms[-min(20, len(norms)) :] if norms else []
    out = {
        "model": model_name,
        "steps": steps,
        "lr": PRETRAIN_LR,
        "clip": PRETRAIN_CLIP,
        "seconds": time.perf_counter() - t0,
        "losses": losses,
        "grad_norms": norms,
        "last_loss": losses[-1] if losses else math.nan,
        "last_norms_median": sorted(tail)[len(tail) // 2] if tail else math.nan,
    }
    with open(path + ".json", "w") as f:
        json.dump(out, f, indent=2)
    return out
