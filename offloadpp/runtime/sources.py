"""Where a model's first weights come from when they are not in memory: safetensors files on
disk, read one tensor at a time (safetensors memory-maps the file and copies out only the bytes
of the tensor asked for), so a model larger than RAM loads unit by unit into the store."""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch


class SafetensorsSource:
    """The tensors of a Hugging Face model folder's safetensors (one file, or shards with an index)."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(
                f"{folder!r} has no model.safetensors or model.safetensors.index.json (offloadpp streams safetensors "
                "weights only; convert .bin checkpoints with safetensors first)"
            )
        self._handles = [safe_open(os.path.join(folder, name), framework="pt") for name in files]
        self._where = {k: h for h in self._handles for k in h.keys()}
        self.used: set[str] = set()

    def tensor(self, names: Sequence[str], prefix: str = "") -> Optional[torch.Tensor]:
        """The stored tensor under any of `names` (also without or with the model's base prefix,
        as Hugging Face checkpoints of a base model name them; and as the base model names a
        parameter that peft's wrapper calls `base_model.model.<name>` or `<layer>.base_layer.<w>`:
        docs/frozen.md), or None."""
        for n in _with_base_names(names):
            for cand in (n, n.removeprefix(prefix + "."), f"{prefix}.{n}" if prefix else n):
                h = self._where.get(cand)
                if h is not None:
                    self.used.add(cand)
                    return h.get_tensor(cand)
        return None


def _with_base_names(names: Sequence[str]) -> list[str]:
    """`names`, then each as the base model under a peft wrapper names it."""
    out = list(names)
    for n in names:
        base = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if base not in out:
            out.append(base)
    return out
