"""save_16bit_model and save_pretrained: the current weights as files from_pretrained loads,
written unit by unit at bounded memory (runtime/export.py)."""

from __future__ import annotations

import os


def save_weights(engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> list[str]:
    """The weights in the compute precision (fp32 when training in fp32, as DeepSpeed does)."""
    return engine.runtime.export_weights(
        save_dir, filename=save_filename, exclude_frozen=exclude_frozen_parameters
    )


def save_pretrained(engine, save_dir: str) -> list[str]:
    """A Hugging Face model folder: the weights (sharded with an index when large), config.json
    and generation_config.json when the model has them."""
    files = save_weights(engine, save_dir, "model.safetensors", exclude_frozen_parameters=False)
    dp = engine.runtime.dp
    if dp is not None and dp.rank != 0:
        return files  # (over several ranks rank 0 writes the folder; the others took part in gathering)
    module = engine.module
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(save_dir)
        files.append(os.path.join(save_dir, "config.json"))
    gen = getattr(module, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(save_dir)
    return files
