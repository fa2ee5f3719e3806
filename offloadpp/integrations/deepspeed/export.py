"""save_16bit_model: the current weights as safetensors that `from_pretrained` loads."""

from __future__ import annotations

import os

import torch


def save_weights(engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> str:
    from safetensors.torch import save_file

    module = engine.module
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        engine.runtime.settings.compute_dtype
    ]
    # Tied weights (embeddings and lm_head) are one parameter under two names: safetensors stores
    # a tensor once, and from_pretrained re-ties from the config. Keep the first name only.
    first_name: dict[int, str] = {}
    skip = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            skip.add(name)
        else:
            first_name[id(p)] = name
        if exclude_frozen_parameters and not p.requires_grad:
            skip.add(name)
    state = module.state_dict()  # weights come in from SSD unit by unit (the runtime's hooks)
    tensors = {}
    for name, t in state.items():
        if name in skip:
            continue
        tensors[name] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, save_filename)
    tmp = path + ".partial"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    return path
