"""CPUAdam: a drop-in for DeepSpeedCPUAdam on the fused SIMD kernel (csrc/adam/).

Same constructor, param groups and ``step(closure)``; ``state_dict``/``load_state_dict`` in
torch Adam's layout (``step``, ``exp_avg``, ``exp_avg_sq``), so a checkpoint moves between it
and ``torch.optim.Adam``/``AdamW``. The optimizer owns its hyper-parameters (its param groups)
and its steps (per-parameter state); nothing lives in a global id map.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Dict, Mapping, Optional

import torch
from pydantic import ValidationError

import offloadpp._C as _C
from offloadpp.optim.hyper import AdamHyper
from offloadpp.optim.kernels import DTYPE_CODES, HALF_DTYPES, NO_DTYPE, _scalar, _threads, check_tensor

__all__ = ["CPUAdam", "AMSGradNotSupportedError"]


class AMSGradNotSupportedError(ValueError, RuntimeError):
    """amsgrad=True: not supported (DeepSpeedCPUAdam raises RuntimeError for it, hence both bases)."""


def _hyper_error(where: str, err: ValidationError) -> ValueError:
    msgs = "; ".join(
        f"{'.'.join(str(x) for x in e['loc'])}={e.get('input')!r}: {e['msg']}" for e in err.errors()
    )
    return ValueError(f"{where}: {msgs}")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU tensors with the fused SIMD kernel.

    Args as ``deepspeed.ops.adam.DeepSpeedCPUAdam``; plus ``num_threads`` (default: every core
    this process may run on), the threads each step uses.

    ``step(closure=None, *, grad_scale=1.0, clip_coef=1.0, check_finite=False, half_out=None)``:
    grads are used as ``grad * clip_coef / grad_scale`` in the same pass; with ``check_finite``
    every grad is scanned first and, if any is inf/nan, no parameter or state changes and
    ``last_step_skipped`` is set; ``half_out`` maps a param to a bf16/fp16 tensor that receives
    the updated values in the same pass.
    """

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        num_threads: Optional[int] = None,
    ):
        if amsgrad:
            raise AMSGradNotSupportedError("CPUAdam does not support the AMSGrad variant (amsgrad=True)")
        self.adam_w_mode = bool(adamw_mode)  # DeepSpeedCPUAdam's attribute name
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        self.num_threads = num_threads
        _threads(num_threads)
        self._hyper_of(
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction),
            "CPUAdam",
        )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
        )
        super().__init__(model_params, defaults)
        self.last_step_skipped = False

    # ---- hyper-parameters ----

    def _hyper_of(self, group: Mapping, where: str) -> AdamHyper:
        betas = group["betas"]
        try:
            beta1, beta2 = betas
        except (TypeError, ValueError):
            raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}") from None
        try:
            return AdamHyper(
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                adamw_mode=self.adam_w_mode,
                bias_correction=bool(group["bias_correction"]),
            )
        except ValidationError as e:
            raise _hyper_error(where, e) from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def add_param_group(self, param_group: dict) -> None:
        if param_group.get("amsgrad", self.defaults.get("amsgrad", False)):
            raise AMSGradNotSupportedError("CPUAdam does not support the AMSGrad variant (amsgrad=True)")
        if param_group.get("maximize", False):
            raise ValueError("CPUAdam does not support maximize=True")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._hyper_of(group, f"param_groups[{len(self.param_groups) - 1}]")

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("bias_correction", True)

    # ---- the step ----

    def _name(self, gi: int, pi: int, group: Mapping) -> str:
        names = group.get("param_names")
        if names is not None and pi < len(names):
            return f"param {names[pi]!r}"
        return f"param_groups[{gi}]['params'][{pi}]"

    def _new_state(self, p: torch.Tensor, state: dict) -> None:
        sdt = torch.float32 if self.fp32_optimizer_states or p.dtype not in HALF_DTYPES else p.dtype
        state["step"] = 0
        state["exp_avg"] = torch.zeros(p.shape, dtype=sdt)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=sdt)

    def _explain(self, name: str, p, g, state: dict) -> None:
        """Raises the ValueError that says what is wrong with a param, its grad or its state."""
        check_tensor(p, name, tuple(DTYPE_CODES))
        check_tensor(g, f"{name}: grad", tuple(DTYPE_CODES))
        if g.shape != p.shape:
            raise ValueError(f"{name}: grad has shape {tuple(g.shape)}, param has {tuple(p.shape)}")
        sdts = (torch.float32, p.dtype) if p.dtype in HALF_DTYPES else (torch.float32,)
        for key in ("exp_avg", "exp_avg_sq"):
            s = state.get(key)
            if isinstance(s, torch.Tensor) and s.shape != p.shape:
                raise ValueError(
                    f"{name}: state {key} has shape {tuple(s.shape)}, param has {tuple(p.shape)}"
                )
        m = check_tensor(state.get("exp_avg"), f"{name}: exp_avg", sdts, p.numel())
        check_tensor(state.get("exp_avg_sq"), f"{name}: exp_avg_sq", (m.dtype,), p.numel())
        raise ValueError(f"{name}: unsupported param/grad/state combination")  # not reached

    @torch.no_grad()
    def step(
        self,
        closure: Optional[Callable[[], float]] = None,
        *,
        grad_scale: float = 1.0,
        clip_coef: float = 1.0,
        check_finite: bool = False,
        half_out: Optional[Mapping[torch.Tensor, torch.Tensor]] = None,
    ):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mult = _scalar(clip_coef, "clip_coef") / _scalar(grad_scale, "grad_scale", positive=True)
        half_ids: Dict[int, torch.Tensor] = {id(k): v for k, v in half_out.items()} if half_out else {}
        with torch.autograd.profiler.record_function("offloadpp::cpu_adam.step"):
            self.last_step_skipped = not self._update(mult, bool(check_finite), half_ids)
        return loss

    def _update(self, mult: float, check_finite: bool, half_ids: Dict[int, torch.Tensor]) -> bool:
        """The step after the closure: False if check_finite found inf/nan (nothing changed)."""
        threads = _threads(self.num_threads)
        # Check everything and group the work before touching any value. The checks are inlined
        # (one pass of cheap attribute reads per param); _explain says what failed.
        codes, strided, f32, tensor = DTYPE_CODES, torch.strided, torch.float32, torch.Tensor
        work = []  # per group: hyper, {(step, types): [(state, segment)]}
        for gi, group in enumerate(self.param_groups):
            hyper = self._hyper_of(group, f"param_groups[{gi}]")
            buckets = defaultdict(list)
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    self._new_state(p, state)
                m, v = state.get("exp_avg"), state.get("exp_avg_sq")
                pc, gc = codes.get(p.dtype), codes.get(g.dtype)
                shape = p.shape
                if (
                    pc is None or gc is None or not isinstance(m, tensor) or not isinstance(v, tensor)
                    or p.layout is not strided or g.layout is not strided or m.layout is not strided
                    or v.layout is not strided or not (p.is_cpu and g.is_cpu and m.is_cpu and v.is_cpu)
                    or g.shape != shape or m.shape != shape or v.shape != shape or m.dtype is not v.dtype
                    or not (m.dtype is f32 or (pc != 0 and m.dtype is p.dtype))
                    or not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous())
                ):  # fmt: skip
                    self._explain(self._name(gi, pi, group), p, g, state)
                n = p.numel()
                out = half_ids.get(id(p)) if half_ids else None
                out_code, out_ptr = NO_DTYPE, 0
                if out is not None:
                    name = self._name(gi, pi, group)
                    check_tensor(out, f"{name}: half_out", HALF_DTYPES, n)
                    if m.dtype is not f32:
                        raise ValueError(f"{name}: half_out needs fp32 optimizer states")
                    out_code, out_ptr = codes[out.dtype], out.data_ptr()
                step = int(state["step"]) + 1
                buckets[(step, (pc, gc, codes[m.dtype], out_code))].append(
                    (state, (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), out_ptr, n))
                )
            work.append((hyper, buckets))

        if check_finite:
            flat = []
            for _, buckets in work:
                for (_, types), items in buckets.items():
                    for _, seg in items:
                        flat += (seg[1], seg[5], types[1])
            if not _C.adam_all_finite(flat, mult, threads):
                return False

        for hyper, buckets in work:
            for (step, types), items in buckets.items():
                segs = [x for _, seg in items for x in seg]
                _C.adam_step(
                    segs,
                    *types,
                    *hyper.kernel_args(),
                    step,
                    mult,
                    False,
                    threads,
                    -1,
                )
                for state, _ in items:
                    state["step"] = step
        return True

    # ---- checkpoints in torch Adam's layout ----

    def state_dict(self) -> dict:
        """torch Adam's layout: per-param ``step`` (0-dim float32 tensor), ``exp_avg``,
        ``exp_avg_sq``; groups also carry ``decoupled_weight_decay`` (= adamw_mode) for
        ``torch.optim.Adam``."""
        sd = super().state_dict()
        sd["state"] = {
            k: {**v, "step": torch.tensor(float(v["step"]), dtype=torch.float32)} if "step" in v else dict(v)
            for k, v in sd["state"].items()
        }
        for g in sd["param_groups"]:
            g["decoupled_weight_decay"] = self.adam_w_mode
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads this optimizer's or torch Adam/AdamW's ``state_dict``. Moments are kept in fp32
        (or the params' dtype with ``fp32_optimizer_states=False``), ``step`` becomes an int."""
        groups = state_dict["param_groups"]
        for gi, g in enumerate(groups):
            if g.get("amsgrad", False):
                raise AMSGradNotSupportedError(f"param_groups[{gi}]: checkpoint uses amsgrad=True")
            if g.get("maximize", False):
                raise ValueError(f"param_groups[{gi}]: checkpoint uses maximize=True")
            dwd = g.get("decoupled_weight_decay")
            if dwd is not None and bool(dwd) != self.adam_w_mode and float(g.get("weight_decay", 0)) != 0:
                raise ValueError(
                    f"param_groups[{gi}]: checkpoint decoupled_weight_decay={dwd} but this CPUAdam has "
                    f"adamw_mode={self.adam_w_mode} and weight_decay != 0"
                )
        saved = state_dict["state"]
        ids = [i for g in groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(groups) != len(self.param_groups) or len(ids) != len(params):
            raise ValueError(
                f"state_dict has {len(groups)} param groups with {len(ids)} params; this optimizer has "
                f"{len(self.param_groups)} with {len(params)}"
            )
        # Build and check every state before changing anything. Moments are put in by us rather
        # than by torch, which would cast fp32 moments of 16-bit params to the params' dtype.
        states = {}
        for i, p in zip(ids, params):
            if i not in saved:
                continue
            s = saved[i]
            sdt = torch.float32 if self.fp32_optimizer_states or p.dtype not in HALF_DTYPES else p.dtype
            new = {k: v for k, v in s.items() if k not in ("step", "exp_avg", "exp_avg_sq")}
            step = s["step"]
            stepf = float(step.item() if isinstance(step, torch.Tensor) else step)
            if not math.isfinite(stepf) or stepf < 0 or stepf != int(stepf):
                raise ValueError(f"state of param {i}: step must be a whole number >= 0, got {step!r}")
            new["step"] = int(stepf)
            for key in ("exp_avg", "exp_avg_sq"):
                t = s[key]
                if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(
                        f"state of param {i}: {key} is {shape}, param has shape {tuple(p.shape)}"
                    )
                new[key] = t.detach().to(device="cpu", dtype=sdt, copy=True).contiguous()
            states[p] = new
        super().load_state_dict({"state": {}, "param_groups": groups})  # torch restores the groups
        for p, new in states.items():
            self.state[p] = new
