"""Splitting a model into units: the repeated blocks, the modules before them (embeddings), the
modules after them (final norm, head). Each parameter gets exactly one owner.

Note: how blocks are found. The blocks are the nn.ModuleList whose children share one class and
that holds the most parameters (for the Hugging Face GPT-2, Llama, Qwen2, OPT and GPT-NeoX models
that is `transformer.h`, `model.layers`, `model.decoder.layers`, `gpt_neox.layers`). Walking from
the root down to that list, every sibling registered before it is part of the "embed" unit and
every one after it of the "head" unit; deeper levels' trailing siblings run first (GPT-2's ln_f
before the root's lm_head). A few modules are registered before the blocks but run after them
(OPT's final_layer_norm and project_out): names in POST_NAMES always go to the head. A model that
does not fit this shape passes an explicit split (Settings.units).

Note: tied weights. A parameter reachable from two units (GPT-2's lm_head.weight is
transformer.wte.weight) belongs to the first unit in forward order that reaches it; the other
unit *borrows* it: its weights are fetched with it, and its gradient reaches the owner.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import nn

from offloadpp.planner import UnitSpec

POST_NAMES = frozenset(
    {"final_layer_norm", "final_layernorm", "project_out", "ln_f", "norm", "lm_head", "embed_out"}
)
# Hugging Face config.model_type -> attribute name of the blocks' ModuleList.
KNOWN_BLOCKS = {"gpt2": "h", "llama": "layers", "qwen2": "layers", "opt": "layers", "gpt_neox": "layers"}


class UnitDiscoveryError(ValueError):
    """The model could not be split into units; the message says what to pass instead."""


@dataclass(frozen=True)
class UnitDef:
    name: str
    modules: tuple[str, ...]  # qualified names of the unit's root modules, in forward order


@dataclass(frozen=True)
class ParamSlot:
    """One parameter of a unit: where it sits in the unit's flat buffer, and every name it has."""

    names: tuple[str, ...]  # qualified names; several when tied
    shape: torch.Size
    dtype: torch.dtype  # as the model created it
    offset: int  # elements into the flat buffer (the frozen segment's, when `frozen`)
    numel: int
    requires_grad: bool
    frozen: bool = False  # in the unit's frozen segment (UnitLayout.frozen), not its trainable flat buffer
    index: int = 0  # its place among all the unit's parameters, in registration order

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class UnitLayout:
    """A unit's definition, its owned parameters (the objects and their slots) and its borrows.

    params: the parameters of the unit's flat buffer (master, moments, gradients); `frozen`:
    those of its frozen segment (docs/frozen.md), stored once, read-only, no optimizer state.
    Over several data-parallel ranks every parameter stays in `params` (split_frozen False)."""

    unit: UnitDef
    params: list[tuple[nn.Parameter, ParamSlot]]
    borrows: tuple[str, ...]
    backward_needs_weights: bool
    frozen: list[tuple[nn.Parameter, ParamSlot]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(s.numel for _, s in self.params)

    @property
    def frozen_numel(self) -> int:
        return sum(s.numel for _, s in self.frozen)

    @property
    def all_params(self) -> list[tuple[nn.Parameter, ParamSlot]]:
        """Every parameter the unit owns, in the order it registers them (both segments)."""
        return sorted(self.params + self.frozen, key=lambda ps: ps[1].index)

    @property
    def frozen_dtype(self) -> str | None:
        """The frozen parameters' dtype where they are all one 16-bit dtype (UnitSpec.frozen_dtype)."""
        dtypes = {p.dtype for p, _ in self.frozen}
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtypes.pop()) if len(dtypes) == 1 else None

    def spec(self) -> UnitSpec:
        return UnitSpec(self.unit.name, self.numel, self.borrows, self.backward_needs_weights,
                        frozen_numel=self.frozen_numel, frozen_dtype=self.frozen_dtype)  # fmt: skip


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _block_lists(model: nn.Module) -> list[tuple[str, int]]:
    """(name, parameter count) of every nn.ModuleList of same-class children (for a known
    Hugging Face model type, only those with the type's attribute name), largest first."""
    config = getattr(model, "config", None)
    known = KNOWN_BLOCKS.get(getattr(config, "model_type", None))
    found = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 1:
            continue
        if known is not None and name.rsplit(".", 1)[-1] != known:
            continue
        if len({type(c) for c in mod}) != 1:
            continue
        found.append((name, sum(p.numel() for p in mod.parameters())))
    return sorted(found, key=lambda nn_: -nn_[1])


def _other_stack(model: nn.Module, best: str) -> str | None:
    """A second stack of blocks beside `best` (an encoder beside a decoder), if the model has one."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        lists = _block_lists(model)
        return next((n for n, _ in lists if n != best and not n.startswith(best + ".")), "its encoder")
    total = sum(p.numel() for p in model.parameters())
    for name, numel in _block_lists(model):
        nested = name.startswith(best + ".") or best.startswith(name + ".")
        if name != best and not nested and len(model.get_submodule(name)) >= 2 and numel >= 0.2 * total:
            return name
    return None


def _find_blocks(model: nn.Module) -> str:
    lists = _block_lists(model)
    best, best_numel = lists[0] if lists else (None, -1)
    if best is None or best_numel <= 0:
        raise UnitDiscoveryError(
            f"no nn.ModuleList of blocks found in {type(model).__name__}; pass the unit split explicitly "
            '(Settings.units, or "units" in the DeepSpeed config\'s offloadpp block: a list of lists of module '
            "qualified names, in forward order)"
        )
    return best


def find_units(model: nn.Module, override: tuple[tuple[str, ...], ...] | None = None) -> list[UnitDef]:
    """The units of `model` in forward order."""
    if override is not None:
        modules = dict(model.named_modules())
        units = []
        for group in override:
            for q in group:
                if q not in modules:
                    raise UnitDiscoveryError(
                        f"Settings.units names module {q!r}, which the model does not have"
                    )
            units.append(UnitDef("+".join(group), tuple(group)))
        return units
    blocks = _find_blocks(model)
    units = _split_at(model, blocks)
    other = _other_stack(model, blocks)
    if other is not None:
        split = [list(u.modules) for u in units]
        raise UnitDiscoveryError(
            f"{type(model).__name__} has two stacks of blocks ({other!r} besides {blocks!r}): offloadpp splits one "
            f"stack into units, so {other!r} would silently become part of a single unit with the embeddings. "
            "Encoder-decoder models get no automatic split; to train with that split anyway, pass it as "
            f'Settings.units (the DeepSpeed block\'s "units"): {json.dumps(split)}'
        )
    return units


def _split_at(model: nn.Module, blocks: str) -> list[UnitDef]:
    """embed (what comes before the blocks), one unit per block, head (what comes after)."""
    path = blocks.split(".")
    pre: list[str] = []
    post_by_level: list[list[str]] = []
    mod, prefix = model, ""
    for part in path:
        level_post: list[str] = []
        after = False
        for name, child in mod.named_children():
            if name == part:
                after = True
                continue
            if not _has_params(child):
                continue
            (level_post if after or name in POST_NAMES else pre).append(prefix + name)
        post_by_level.append(level_post)
        mod, prefix = getattr(mod, part), prefix + part + "."
    post = [q for level in reversed(post_by_level) for q in level]
    units = [UnitDef("embed", tuple(pre))] if pre else []
    units += [UnitDef(f"{blocks}.{name}", (f"{blocks}.{name}",)) for name, _ in mod.named_children()]
    if post:
        units.append(UnitDef("head", tuple(post)))
    return units


def layout_units(model: nn.Module, defs: list[UnitDef], split_frozen: bool = True) -> list[UnitLayout]:
    """Assigns every parameter to one unit (first in forward order wins) and lays each unit's
    parameters out back to back in its flat buffer; with split_frozen, the frozen ones
    (requires_grad False) in the unit's frozen segment instead. Raises if a parameter has no unit."""
    modules = dict(model.named_modules())
    all_names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        all_names.setdefault(id(p), []).append(name)
    owner: dict[int, str] = {}
    layouts = []
    for d in defs:
        params: list[tuple[nn.Parameter, ParamSlot]] = []
        frozen: list[tuple[nn.Parameter, ParamSlot]] = []
        borrows: list[str] = []
        offset = frozen_offset = 0
        only_embeddings = True
        for q in d.modules:
            root = modules[q]
            for sub in root.modules():
                if any(True for _ in sub.parameters(recurse=False)) and not isinstance(sub, nn.Embedding):
                    only_embeddings = False
            for _, p in root.named_parameters(prefix=q):
                if id(p) in owner:
                    if owner[id(p)] != d.name and owner[id(p)] not in borrows:
                        borrows.append(owner[id(p)])
                    continue
                owner[id(p)] = d.name
                names = tuple(all_names[id(p)])
                index = len(params) + len(frozen)
                if split_frozen and not p.requires_grad:
                    slot = ParamSlot(names, p.shape, p.dtype, frozen_offset, p.numel(), False, True, index)
                    frozen.append((p, slot))
                    frozen_offset += p.numel()
                else:
                    params.append((p, ParamSlot(names, p.shape, p.dtype, offset, p.numel(), p.requires_grad,
                                                False, index)))  # fmt: skip
                    offset += p.numel()
        params_all = params + frozen
        if not params_all:
            raise UnitDiscoveryError(f"unit {d.name!r} owns no parameters (modules {list(d.modules)})")
        if any(not p.dtype.is_floating_point for p, _ in params_all):
            bad = next(s.name for p, s in params_all if not p.dtype.is_floating_point)
            raise UnitDiscoveryError(
                f"parameter {bad!r} is not floating point; the runtime trains float parameters"
            )
        layouts.append(UnitLayout(d, params, tuple(borrows), not only_embeddings, frozen))
    for name, p in model.named_parameters():
        if id(p) not in owner:
            raise UnitDiscoveryError(
                f"parameter {name!r} belongs to no unit: it is registered on a module that is not inside "
                "any unit (pass Settings.units to cover it)"
            )
    return layouts


def unit_specs(model: nn.Module, override: tuple[tuple[str, ...], ...] | None = None,
               split_frozen: bool = True) -> list[UnitSpec]:  # fmt: skip
    """The planner's view of `model`'s units (what resolve and the engine's plan check compare)."""
    return [lay.spec() for lay in layout_units(model, find_units(model, override), split_frozen)]
