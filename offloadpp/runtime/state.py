"""Getting training state in and out: the first weights (from the model, or initialised unit by
unit for a model built on the meta device) and `module.state_dict()` between steps. Checkpoints
are checkpoint.py's.

Note: a model larger than memory. Built on the meta device, it never exists whole in RAM: each
unit's parameters are pointed at a fresh fp32 buffer, the user's init function (for Hugging
Face models, `model._init_weights`) runs over the unit's modules, and the buffer is written to
the store and given back before the next unit. Parameters a unit's modules borrow from another
unit (tied weights) point at scratch memory meanwhile, so that their owner's values stand.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import nn
from tqdm import tqdm

from offloadpp.io.engine import crc32c
from offloadpp.optim import convert_

from .partition import ParamSlot
from .slots import Hold
from .unit import Unit


def replace_meta_params(
    model: nn.Module, placeholder: Callable[[torch.Size, torch.dtype], torch.Tensor]
) -> dict[int, nn.Parameter]:
    """Swaps every parameter on the meta device for a fresh nn.Parameter holding a placeholder
    (ties kept: one new object per old one; a meta tensor cannot be re-pointed at memory).
    Returns {id(old parameter): its replacement}: an optimizer built over the old objects
    follows them (remap_param_groups)."""
    new: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(placeholder(p.shape, p.dtype), requires_grad=p.requires_grad)
            mod._parameters[name] = new[id(p)]
    return new


def remap_param_groups(optimizer, replaced: dict[int, nn.Parameter]) -> None:
    """Points an optimizer's parameter groups at the parameters replace_meta_params made."""
    if not replaced:
        return
    for g in optimizer.param_groups:
        g["params"] = [replaced.get(id(p), p) for p in g["params"]]


def check_buffers(model: nn.Module, device: torch.device) -> None:
    """Module buffers stay in memory on the device; none may be on the meta device."""
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(
                f"buffer {name!r} is on the meta device: the runtime materialises parameters only; build "
                "modules with buffers (e.g. rotary embeddings) on a real device"
            )
    if device.type != "cpu":
        for mod in model.modules():
            for name, b in list(mod._buffers.items()):
                if b is not None and b.device != device:
                    mod._buffers[name] = b.to(device)


def initialize_units(
    units: list[Unit], modules: dict, init_fn: Optional[Callable], meta: bool, progress: bool, source=None,
    prefix: str = "",
) -> list[str]:  # fmt: skip
    """Writes each unit's first master weights (and compute copy) to its homes: from the model
    as it is, or (a model on the meta device) from `source` (runtime/sources.py) and, for what
    the source lacks, the module's own init. Returns the parameters the source lacked."""
    missing: list[str] = []
    for u in tqdm(units, desc="offloadpp: initialising units", disable=not progress, leave=False):
        master = u.master
        if master.resident:
            master.make_resident()
        else:
            master.acquire(Hold.EXPORT, overwrite=True)
        buf = master.buffer
        buf[u.numel :].zero_()
        frozen = open_frozen(u)
        missing += fill_unit(u, buf, modules, init_fn, meta, source, prefix)
        if frozen is not None:
            close_frozen(u)
        if not master.resident:
            g = master.write_generation()
            master.wrote(master.store.put(master.key_of(g), buf), g)
        if u.compute is not master:
            init_compute_copy(u)
        for s in (u.exp_avg, u.exp_avg_sq, u.grads):
            if s.resident:
                s.make_resident()
        if u.device.copies and u.weights.resident and u.compute is master:
            to_device(u)
        master.release(Hold.EXPORT)
    return missing


def fill_unit(u: Unit, buf: torch.Tensor, modules: dict, init_fn: Optional[Callable], meta: bool, source=None,
              prefix: str = "") -> list[str]:  # fmt: skip
    """Writes the unit's first fp32 weights into `buf` (its flat layout), from the model as it
    is, or (on the meta device) from `source` and, for what the source lacks, the module's own
    init; points the parameters at placeholders after. Returns the parameters the source lacked."""
    missing: list[str] = []
    params = u.layout.all_params
    frozen = u.frozen_slot.buffer if u.frozen else None  # (held by initialize_units: open_frozen)

    def dest(s: ParamSlot) -> torch.Tensor:
        return (frozen if s.frozen else buf)[s.offset : s.offset + s.numel]

    if meta and source is not None:
        loaded = [(s, source.tensor(s.names, prefix)) for _, s in params]
        if any(t is None for _, t in loaded):
            missing.extend(s.name for s, t in loaded if t is None)
            _run_init(u, buf, modules, init_fn)
        for s, t in loaded:
            if t is not None:
                if tuple(t.shape) != tuple(s.shape):
                    raise ValueError(
                        f"{s.name!r}: the checkpoint's tensor has shape {tuple(t.shape)}, the model's {tuple(s.shape)}"
                    )
                dest(s).copy_(t.reshape(-1))
    elif meta:
        _run_init(u, buf, modules, init_fn)
    else:
        for p, s in params:
            dest(s).copy_(p.detach().reshape(-1))
    for p, s in params:
        p.data = u.device.placeholder(s.shape, u.compute_dtype)
    return missing


def open_frozen(u: Unit) -> Optional[torch.Tensor]:
    """The buffer fill_unit writes u's frozen segment into (held), or None: u has none."""
    f = u.frozen_slot
    if f is None:
        return None
    if f.resident:
        f.make_resident()
    else:
        f.acquire(Hold.EXPORT, overwrite=True)
    f.buffer[u.frozen_numel :].zero_()
    return f.buffer


def close_frozen(u: Unit) -> None:
    """u's frozen segment, filled by fill_unit: its CRC-32C kept (the reference checkpoints
    record, docs/frozen.md), written to its home once, and given back."""
    f = u.frozen_slot
    buf = f.buffer
    u.frozen_crc = crc32c(buf.data_ptr(), buf.numel() * buf.element_size())
    if f.stored:
        f.wrote(f.store.put(f.key_of(0), buf), 0)
    f.release(Hold.EXPORT)


def default_init_fn(model: nn.Module) -> Callable[[nn.Module], None]:
    """The model's own initialisation, applied module by module: Hugging Face's _init_weights,
    else each module's reset_parameters (torch's convention); then, in a peft model, each LoRA
    layer's own init of its adapters (docs/frozen.md)."""
    init = getattr(model, "_init_weights", None)
    if not callable(init):

        def init(m: nn.Module) -> None:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()

    adapters = _lora_inits(model)
    if not adapters:
        return init

    def with_adapters(m: nn.Module) -> None:
        init(m)
        # Note: a LoRA layer's adapters were made on the meta device with its base layer (peft
        # moves them there), so their values are gone; Hugging Face's init would draw lora_B at
        # random, and the model would not start as its base does. module.apply runs the children
        # (lora_A, lora_B) first, so this, on the LoRA layer, has the last word.
        if hasattr(m, "reset_lora_parameters") and hasattr(m, "lora_A"):
            for a in m.lora_A:
                m.reset_lora_parameters(a, adapters.get(a, True))

    return with_adapters


def _lora_inits(model: nn.Module) -> dict:
    """{adapter: its init_lora_weights} of a peft model's LoRA adapters ({} for other models)."""
    cfg = getattr(model, "peft_config", None)
    if not isinstance(cfg, dict):
        return {}
    return {name: getattr(c, "init_lora_weights", True) for name, c in cfg.items()}


def to_device(u: Unit) -> None:
    """A unit whose weights are resident on the device: its compute copy (the master, with fp32)
    copied up."""
    u.compute.acquire(Hold.EXPORT)
    if u.weights.tensor is None:
        u.weights.load_resident()
    else:
        u.weights.refresh()
    u.compute.release(Hold.EXPORT, after=(u.weights.last_copy,))


def init_compute_copy(u: Unit) -> None:
    """The compute copy made from the master (held in u.master.buffer): kept at its home, and
    copied up where the weights are resident on the device (on CUDA that copy has no home of
    its own: Plan.homes)."""
    c = u.compute
    if c.resident:
        if c.buffer is None:
            c.make_resident()
    else:
        c.acquire(Hold.EXPORT, overwrite=True)
    convert_(c.buffer, u.master.buffer)
    if c.stored:
        g = c.write_generation()
        c.wrote(c.store.put(c.key_of(g), c.buffer), g)
    if u.device.copies and u.weights.resident:
        to_device(u)  # (the buffer is still held: the EXPORT hold is taken again, and dropped after the copy)
    c.release(Hold.EXPORT)


def _run_init(u: Unit, buf: torch.Tensor, modules: dict, init_fn: Optional[Callable]) -> None:
    if init_fn is None:
        raise ValueError(
            f"parameter {u.layout.all_params[0][1].name!r} is on the meta device and no init_fn was given: pass "
            "init_fn (for Hugging Face models, model._init_weights) to initialise units one by one"
        )
    owned = {id(p) for p, _ in u.layout.all_params}
    scratch = []
    for p, s in u.params:
        p.data = buf[s.offset : s.offset + s.numel].view(s.shape)
    for p, s in u.frozen:  # (initialised in the compute dtype, where they stay)
        p.data = u.frozen_slot.buffer[s.offset : s.offset + s.numel].view(s.shape)
    for q in u.layout.unit.modules:
        for p in modules[q].parameters():
            if id(p) not in owned:  # borrowed from another unit: let init write into scratch
                scratch.append((p, p.data))
                p.data = torch.zeros(p.shape, dtype=torch.float32)
    with torch.no_grad():
        for q in u.layout.unit.modules:
            modules[q].apply(init_fn)
    for p, data in scratch:
        p.data = data


# ---- module.state_dict() between steps ----------------------------------------------------------
class Exporter:
    """Fills `module.state_dict()` with the current weights, fetching each unit's master as it
    goes (one unit held at a time)."""

    def __init__(self, units: list[Unit], before: Callable[[], None]):
        self.units = units
        self._before = before  # waits for the optimizer: values are only final between steps
        self._session = False
        self._held: Optional[Unit] = None
        self._values: dict[str, torch.Tensor] = {}  # within one state_dict() call, by param name
        self._handles = []

    def install(self, model: nn.Module, modules: dict) -> None:
        owner_of = {}
        for u in self.units:
            for p, s in u.layout.all_params:
                owner_of[id(p)] = (u, s)
        self._handles.append(model.register_state_dict_pre_hook(functools.partial(self._open)))
        self._handles.append(model.register_state_dict_post_hook(functools.partial(self._close)))
        for u in self.units:
            for q in u.layout.unit.modules:
                entries = [
                    (rel, *owner_of[id(p)]) for rel, p in modules[q].named_parameters(remove_duplicate=False)
                ]
                hook = functools.partial(self._fill, entries)
                self._handles.append(modules[q].register_state_dict_post_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _open(self, module, prefix, keep_vars) -> None:
        self._before()
        self._session = True

    def _close(self, module, state_dict, prefix, local_metadata) -> None:
        self._session = False
        self._values.clear()
        self._let_go()

    def _let_go(self) -> None:
        if self._held is not None:
            self._held.end_export()
            self._held = None

    def _fill(self, entries, module, state_dict, prefix, local_metadata) -> None:
        if not self._session:
            self._before()
        for rel, u, s in entries:
            key = prefix + rel
            if key in state_dict:
                state_dict[key] = self.value(u, s)
        if not self._session:
            self._values.clear()
            self._let_go()

    def value(self, u: Unit, s: ParamSlot) -> torch.Tensor:
        if s.name in self._values:
            return self._values[s.name]
        v = u.exported(s, self.master(u)).to(s.dtype, copy=True)
        if self._session:
            self._values[s.name] = v
        return v

    def master(self, u: Unit) -> torch.Tensor:
        """u's fp32 master weights (held for export until another unit is asked for)."""
        if self._held is not u:
            self._let_go()
            self._master = u.export_master()
            self._held = u
        return self._master
