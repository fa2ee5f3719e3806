"""The optimizer object `offloadpp.initialize` hands back.

The update itself runs inside the runtime (fused CPU Adam over state streamed from SSD, during
backward), so this object only carries what user code and LR schedulers touch: `param_groups`
with `lr`, `betas`, `eps`, `weight_decay`. DeepSpeed's schedulers write `lr` here; the engine
reads it back before each optimizer step.
"""

from __future__ import annotations

import torch

from offloadpp.optim import AdamHyper


class OffloadppOptimizer(torch.optim.Optimizer):
    def __init__(self, params, hyper: AdamHyper):
        defaults = dict(
            lr=hyper.lr,
            betas=(hyper.beta1, hyper.beta2),
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            bias_correction=hyper.bias_correction,
            adamw_mode=hyper.adamw_mode,
        )
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            for key in ("betas", "eps", "weight_decay", "adamw_mode", "bias_correction"):
                if group[key] != defaults[key]:
                    raise ValueError(
                        f"param group {i}: {key}={group[key]!r} differs from the optimizer's {defaults[key]!r}; "
                        "offloadpp applies one set of Adam hyper-parameters to all groups (only lr may vary "
                        "over time, through the scheduler)"
                    )

    def hyper(self) -> AdamHyper:
        g = self.param_groups[0]
        return AdamHyper(
            lr=g["lr"],
            beta1=g["betas"][0],
            beta2=g["betas"][1],
            eps=g["eps"],
            weight_decay=g["weight_decay"],
            adamw_mode=g["adamw_mode"],
            bias_correction=g["bias_correction"],
        )

    @torch.no_grad()
    def step(self, closure=None):
        raise RuntimeError(
            "with offloadpp the optimizer runs inside the engine: call engine.step() after engine.backward(loss)"
        )

    def zero_grad(self, set_to_none: bool = True):
        # Gradients never accumulate on the module's parameters: the runtime moves them to host
        # as they are produced. Nothing to clear; kept so user loops calling it keep working.
        return None
