"""The optimizer object `offloadpp.initialize` hands back, and reading Adam's hyper-parameters
from wherever DeepSpeed takes them: the config's optimizer block, or an optimizer passed to
initialize (torch.optim Adam/AdamW, DeepSpeed's CPU or fused Adam, offloadpp's CPUAdam).

The update itself runs inside the runtime (fused CPU Adam over state streamed from SSD, during
backward), so this object only carries what user code and schedulers touch: `param_groups`, each
with its own `lr`, `betas`, `eps`, `weight_decay`. LR and momentum schedulers write there; the
engine reads every group back before each backward (OffloadppEngine._push_hypers).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from offloadpp.optim import AdamHyper

# Group keys torch.optim's Adam/AdamW carry that select an implementation, not the math.
_IMPL_GROUP_KEYS = ("foreach", "capturable", "differentiable", "fused", "initial_lr")


class OptimizerError(ValueError):
    """A hyper-parameter offloadpp cannot run; the message names the group and the key."""


def _betas(value: Any, where: str) -> tuple[float, float]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)
    ):
        raise OptimizerError(f"{where}betas: expected two numbers [beta1, beta2], got {value!r}")
    return float(value[0]), float(value[1])


def hyper_from(group: dict, *, adamw: bool, where: str) -> AdamHyper:
    """One param group (or the config's optimizer params) -> AdamHyper, errors naming the key."""
    if group.get("amsgrad"):
        raise OptimizerError(f"{where}amsgrad: not supported (as in DeepSpeedCPUAdam); use Adam or AdamW")
    if group.get("maximize"):
        raise OptimizerError(f"{where}maximize: not supported; negate the loss instead")
    if group.get("decoupled_weight_decay"):
        adamw = True
    b1, b2 = _betas(group.get("betas", (0.9, 0.999)), where)
    values = dict(
        lr=group.get("lr", 1e-3),
        beta1=b1,
        beta2=b2,
        eps=group.get("eps", 1e-8),
        weight_decay=group.get("weight_decay", 0.0),
        bias_correction=group.get("bias_correction", True),
        adamw_mode=bool(group.get("adamw_mode", adamw)),
    )
    for key in ("lr", "eps", "weight_decay"):
        v = values[key]
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            values[key] = float(v)  # torch allows a tensor lr
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise OptimizerError(f"{where}{key}: expected a number, got {v!r}")
    if not isinstance(values["bias_correction"], bool):
        raise OptimizerError(
            f"{where}bias_correction: expected true or false, got {values['bias_correction']!r}"
        )
    try:
        return AdamHyper(**values)
    except ValueError as e:  # pydantic's ValidationError: name the field
        err = e.errors()[0] if hasattr(e, "errors") else None
        field = err["loc"][0] if err else "?"
        field = {"beta1": "betas", "beta2": "betas", "adamw_mode": "adam_w_mode"}.get(field, field)
        msg = err["msg"] if err else str(e)
        raise OptimizerError(f"{where}{field}: {msg} (got {values})") from None


def adam_hyper_from_ds(name: Optional[str], params: Optional[dict]) -> AdamHyper:
    """DeepSpeed's optimizer block -> AdamHyper, with DeepSpeed's semantics: type "Adam" is AdamW
    unless `adam_w_mode` is false; "AdamW" is always AdamW."""
    if name is None:
        raise OptimizerError(
            "optimizer: offloadpp needs an Adam or AdamW: an 'optimizer' block in the DeepSpeed config, or "
            "optimizer= to initialize"
        )
    lowered = str(name).lower()
    if lowered not in ("adam", "adamw"):
        raise OptimizerError(f"optimizer.type: offloadpp runs Adam and AdamW, got {name!r}")
    if params is not None and not isinstance(params, dict):
        raise OptimizerError(f"optimizer.params: expected an object, got {params!r}")
    params = dict(params or {})
    known = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "amsgrad"}
    impl = {"torch_adam", "fp32_optimizer_states"}  # select DeepSpeed's implementation, not the math
    unknown = sorted(set(params) - known - impl)
    if unknown:
        raise OptimizerError(
            f"optimizer.params: unknown key(s) {unknown} for Adam; the keys are {sorted(known)}"
        )
    adam_w_mode = params.pop("adam_w_mode", True)
    if not isinstance(adam_w_mode, bool):
        raise OptimizerError(f"optimizer.params.adam_w_mode: expected true or false, got {adam_w_mode!r}")
    return hyper_from(params, adamw=lowered == "adamw" or adam_w_mode, where="optimizer.params.")


def client_adamw_mode(opt: Any) -> bool:
    """Whether an optimizer passed to initialize decays weights decoupled (AdamW) or as L2 (Adam);
    raises for an optimizer that is not an Adam."""
    if isinstance(opt, torch.optim.AdamW):
        return True
    if isinstance(opt, torch.optim.Adam):
        return bool(opt.defaults.get("decoupled_weight_decay", False))
    for attr in ("adam_w_mode", "adamw_mode"):  # DeepSpeedCPUAdam, FusedAdam; offloadpp's CPUAdam
        if hasattr(opt, attr) and "Adam" in type(opt).__name__:
            return bool(getattr(opt, attr))
    raise OptimizerError(
        f"optimizer=: offloadpp runs Adam/AdamW only (its fused CPU kernel, during backward), got "
        f"{type(opt).__module__}.{type(opt).__name__}; pass torch.optim.AdamW or an 'optimizer' block of "
        "type AdamW"
    )


class OffloadppOptimizer(torch.optim.Optimizer):
    """Param groups and their hyper-parameters; `step()` happens inside the engine.

    Built from `params` (tensors or group dicts) with `defaults` from the config's optimizer
    block, or around a client optimizer (`client=`), whose param group dicts it shares, so a
    scheduler made on either object drives the same values.
    """

    def __init__(self, params, defaults: AdamHyper, *, client: Optional[torch.optim.Optimizer] = None):
        d = dict(
            lr=defaults.lr,
            betas=(defaults.beta1, defaults.beta2),
            eps=defaults.eps,
            weight_decay=defaults.weight_decay,
            bias_correction=defaults.bias_correction,
            adamw_mode=defaults.adamw_mode,
        )
        if client is not None:
            params = [g for g in client.param_groups if g["params"]]
        super().__init__(params, d)
        if client is not None:
            # Share the client's dicts (DeepSpeed keeps the client optimizer as its basic optimizer).
            client.param_groups[:] = [g for g in client.param_groups if g["params"]]
            for g in client.param_groups:
                g.setdefault("adamw_mode", defaults.adamw_mode)
            self.param_groups = client.param_groups
        self._adamw = defaults.adamw_mode
        self.client = client  # the caller's own optimizer, when it gave one (the engine's client_optimizer)
        self.overflow = False  # the last step was skipped (fp16 overflow); Accelerate reads it
        self.hypers()  # every group checked now, at initialize

    def hypers(self) -> list[AdamHyper]:
        """Each group's hyper-parameters as they are now (schedulers change them)."""
        return [
            hyper_from(g, adamw=self._adamw, where=f"param group {i}: ")
            for i, g in enumerate(self.param_groups)
        ]

    def groups_by_name(self, module: torch.nn.Module) -> dict[str, int]:
        """{parameter name: group index} for every parameter of `module` in some group."""
        index = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        return {n: index[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if id(p) in index}

    @torch.no_grad()
    def step(self, closure=None):
        raise RuntimeError(
            "with offloadpp the optimizer runs inside the engine: call engine.step() after engine.backward(loss)"
        )

    def zero_grad(self, set_to_none: bool = True):
        # Gradients never accumulate on the module's parameters: the runtime moves them to host
        # as they are produced. Nothing to clear; kept so user loops calling it keep working.
        return None

    def state_dict(self):
        raise NotImplementedError(
            "the Adam state lives in offloadpp's swap files: save it with engine.save_checkpoint(dir)"
        )

    def load_state_dict(self, state_dict):
        raise NotImplementedError("load the Adam state with engine.load_checkpoint(dir)")
