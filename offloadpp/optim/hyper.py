"""AdamHyper: Adam's hyper-parameters, validated once where they enter (DESIGN.md convention 6)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AdamHyper(BaseModel):
    """Hyper-parameters of one Adam/AdamW step. Frozen; bad values raise ``ValueError``
    (pydantic's ``ValidationError``) naming the field and the value.

    ``adamw_mode=True`` decays weights decoupled from the gradient (AdamW: ``p *= 1 - lr * wd``);
    ``False`` adds ``wd * p`` to the gradient (Adam with L2), as ``torch.optim.Adam``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    lr: float = Field(1e-3, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.999, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adamw_mode: bool = True
    bias_correction: bool = True

    def kernel_args(self) -> tuple:
        """The hyper-parameters in the order the native kernels take them (csrc/adam bindings:
        lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction)."""
        return (
            self.lr,
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            self.adamw_mode,
            self.bias_correction,
        )
