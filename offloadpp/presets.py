"""Model presets shared by the benchmarks, the A/B harness and the demo.

Named after DESIGN.md's measurements so a number here can be set beside one there. Every preset
is a Hugging Face config built locally (nothing is downloaded); weights are random unless a
caller loads its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModelPreset:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    micro_batch: int
    seq_len: int
    vocab_size: int = 50257

    def gpt2_config(self):
        from transformers import GPT2Config

        return GPT2Config(
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            n_positions=self.n_positions,
            vocab_size=self.vocab_size,
            # Dropout off: both sides of an A/B, and the in-memory reference, must see the same math.
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )


PRESETS = {
    # DESIGN.md's 44.8M GPT-2: 6 layers, width 512, batch 2x128, fp32.
    "gpt2-45m": ModelPreset(
        "gpt2-45m", n_layer=6, n_embd=512, n_head=8, n_positions=256, micro_batch=2, seq_len=128
    ),
    # DESIGN.md's capacity model: 1.31B parameters, 24 layers, width 2048, batch 1x128.
    "gpt2-1.3b": ModelPreset(
        "gpt2-1.3b", n_layer=24, n_embd=2048, n_head=16, n_positions=1024, micro_batch=1, seq_len=128
    ),
    # Small enough for tests and the demo's quick path.
    "gpt2-tiny": ModelPreset(
        "gpt2-tiny", n_layer=2, n_embd=64, n_head=4, n_positions=128, micro_batch=2, seq_len=32
    ),
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


def hf_config_dict(spec: str) -> tuple[dict, Optional[ModelPreset]]:
    """A Hugging Face config dict for a preset name, a model directory or a config.json, and the
    preset when it was one. Raises ValueError naming the choices."""
    if spec in PRESETS:
        p = PRESETS[spec]
        return p.gpt2_config().to_dict(), p
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(
            f"model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}), a model directory with config.json, "
            "or a config file"
        )
    with open(path) as f:
        return json.load(f), None


def meta_model(config: dict):
    """The causal-LM model of a Hugging Face config dict, built on the meta device (no memory):
    what planning needs to see the units exactly as the runtime will."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    cfg.pop("transformers_version", None)
    hf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)
