"""save_16bit_model, save_pretrained and the consolidated state dict.

The first two write the current weights as files from_pretrained loads, unit by unit at bounded
memory (runtime/export.py), whatever the file name: `pytorch_model.bin` (DeepSpeed's default)
in torch.save's format, a `.safetensors` name as safetensors, sharded with an index when large.
The third is the whole model as one dict in memory, which is what Accelerate's get_state_dict
and the Trainer ask DeepSpeed for on save: it is built only when it fits both in the memory
available (MEMORY_SHARE) and in the engine's host budget (the host memory the run was promised:
a model larger than that is why it runs out of core), else it refuses naming the streaming calls,
rather than have the kernel kill the process half way.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

# (one error for every whole-model dict that would not fit: the engine's and a checkpoint's)
from offloadpp.runtime.checkpoint_weights import WeightsDoNotFitError

# The consolidated dict may take at most this share of the memory available when it is asked
# for (the same rule as the engine's __del__ giving the model its weights back): the rest is
# for the process going on (the next step's buffers, the caller's copy as it writes the file).
MEMORY_SHARE = 0.5

STREAMING_CALLS = (
    "engine.save_16bit_model(dir) (pytorch_model.bin, sharded with an index when large) or "
    "engine.save_pretrained(dir) (safetensors and config.json); after offloadpp.patch_deepspeed(), "
    "Trainer.save_model and Accelerator.save_model stream the same way"
)


def save_weights(engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool,
                 max_shard_bytes: Optional[int] = None) -> list[str]:  # fmt: skip
    """The weights in the compute precision (fp32 when training in fp32, as DeepSpeed does)."""
    engine._finish_micro()
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return engine.runtime.export_weights(
        save_dir, filename=save_filename, exclude_frozen=exclude_frozen_parameters, **kw
    )


def save_pretrained(engine, save_dir: str, safe_serialization: bool = True,
                    max_shard_bytes: Optional[int] = None) -> list[str]:  # fmt: skip
    """A Hugging Face model folder: the weights (sharded with an index when large), config.json
    and generation_config.json when the model has them. A peft model (LoRA and the rest) writes
    what its own save_pretrained writes, its adapters, from the trainable parameters alone
    (docs/frozen.md); save_16bit_model exports the whole model, base and adapters."""
    module = engine.module
    if _is_peft(module):
        state = engine.runtime.trainable_state_dict()  # (every rank takes part)
        dp = engine.runtime.dp
        if dp is None or dp.rank == 0:
            module.save_pretrained(save_dir, state_dict=state, safe_serialization=safe_serialization)
        return (
            sorted(os.path.join(save_dir, f) for f in os.listdir(save_dir)) if os.path.isdir(save_dir) else []
        )
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    files = save_weights(
        engine, save_dir, name, exclude_frozen_parameters=False, max_shard_bytes=max_shard_bytes
    )
    dp = engine.runtime.dp
    if dp is not None and dp.rank != 0:
        return files  # (over several ranks rank 0 writes the folder; the others took part in gathering)
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(save_dir)
        files.append(os.path.join(save_dir, "config.json"))
    gen = getattr(module, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(save_dir)
    return files


def save_merged(engine, save_dir: str, safe_serialization: bool = True,
                 max_shard_bytes: Optional[int] = None) -> list[str]:  # fmt: skip
    """A peft LoRA model's base with its adapters merged (peft's merge_and_unload, written as
    the base model's own folder: its names, its config.json), streamed unit by unit: each LoRA
    layer's weight W + scale * B @ A is made from the unit's frozen segment and adapters as the
    unit is exported (runtime/export.py Merge; docs/frozen.md)."""
    module = engine.module
    if not _is_peft(module):
        raise TypeError(f"save_merged: the engine's model ({type(module).__name__}) is not a peft model")
    engine._finish_micro()
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    files = engine.runtime.export_weights(save_dir, filename=name, merge=lora_merge(module), **kw)
    dp = engine.runtime.dp
    if dp is None or dp.rank == 0:
        base = module.get_base_model()
        for what in (getattr(base, "config", None), getattr(base, "generation_config", None)):
            if what is not None and hasattr(what, "save_pretrained"):
                what.save_pretrained(save_dir)
    return files


def lora_merge(module):
    """The Merge of a peft LoRA model: names as in its base model (no `base_model.model.`, no
    `.base_layer`, the adapters' own weights dropped, a modules_to_save copy in its module's
    place) and each LoRA layer's active adapters as deltas. DoRA and other tuners are refused."""
    from offloadpp.runtime.export import Merge

    prefix = "base_model.model."
    adapters = module.active_adapters if isinstance(module.active_adapters, list) else [module.active_adapter]

    def rename(name: str) -> Optional[str]:
        if ".lora_" in name or ".original_module." in name:
            return None
        name = name.removeprefix(prefix).replace(".base_layer.", ".")
        for a in adapters:
            name = name.replace(f".modules_to_save.{a}.", ".")
        return None if ".modules_to_save." in name else name

    deltas = {}
    for mname, m in module.named_modules():
        if not (hasattr(m, "lora_A") and hasattr(m, "base_layer")):
            continue
        pairs = []
        for a in adapters:
            if a not in m.lora_A:
                continue
            if getattr(m, "use_dora", {}).get(a):
                raise NotImplementedError(
                    f"save_merged: {mname!r} uses DoRA, which the streamed merge does not fold"
                )
            pairs.append((f"{mname}.lora_A.{a}.weight", f"{mname}.lora_B.{a}.weight", float(m.scaling[a]),
                          bool(getattr(m, "fan_in_fan_out", False))))  # fmt: skip
        if pairs:
            deltas[rename(f"{mname}.base_layer.weight")] = tuple(pairs)
    return Merge(rename, deltas)


def _is_peft(module) -> bool:
    """A peft model (PeftModel and its task classes), without importing peft where it is absent."""
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def memory_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def weights_bytes(module: torch.nn.Module, dtype: torch.dtype, exclude_frozen: bool = False) -> int:
    """Bytes of the module's state dict with its floating weights in `dtype` (tied weights once)."""
    seen, n = set(), 0
    for p in module.parameters():
        if id(p) not in seen and not (exclude_frozen and not p.requires_grad):
            seen.add(id(p))
            n += p.numel() * dtype.itemsize
    for b in module.buffers():
        n += b.numel() * b.element_size()
    return n


def consolidated_state_dict(engine, dtype: torch.dtype, exclude_frozen_parameters: bool = False) -> dict:
    """The whole model's weights in `dtype` on the CPU, fetched unit by unit, when they fit
    (module Note); else WeightsDoNotFitError naming the streaming calls."""
    need = weights_bytes(engine.module, dtype, exclude_frozen_parameters)
    avail = memory_available()
    budget = engine.runtime.plan.budgets.host_bytes
    dp = engine.runtime.dp
    if dp is not None:  # every rank builds the dict (each unit is gathered): all build it or none does
        avail, budget = (min(v) for v in zip(*dp.all_gather_object((avail, budget))))
    if need > avail * MEMORY_SHARE:
        raise WeightsDoNotFitError(
            f"offloadpp: the whole model's weights as one state dict would take {need / 1e9:.2f} GB ({dtype}), "
            f"more than {MEMORY_SHARE:.0%} of the {avail / 1e9:.2f} GB of memory available now; building it "
            f"would get the process killed. Write them to files unit by unit instead: {STREAMING_CALLS}"
        )
    if need > budget:
        raise WeightsDoNotFitError(
            f"offloadpp: the whole model's weights as one state dict would take {need / 1e9:.2f} GB ({dtype}), "
            f"more than the engine's host budget of {budget / 1e9:.2f} GB (host_budget_bytes); building it would "
            f"hold that much host memory past the budget. Write them to files unit by unit instead: {STREAMING_CALLS}"
        )
    engine._finish_micro()
    sd = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype) for k, v in sd.items()}
