"""Activation swapping (DESIGN.md, idea 2): the tensors autograd saves in each unit's forward are
kept on the device, moved to pinned host memory, moved on to SSD, or dropped and recomputed, as
the unit's policy says; backward brings them back ahead of need, in the order it uses them.

    mgr = ActivationManager.for_model(model, ActivationSettings(policy="ssd", budget_bytes=...),
                                      store=TensorStore(dirs))
    with mgr.forward():
        loss = model(**batch).loss
    mgr.backward(loss)                 # or: mgr.start_backward(); loss.backward(); mgr.end_backward()
    mgr.stats()                        # bytes moved, waits, the accounted device peak

Note: the hooks. A forward pre-hook on each unit's root modules makes the unit current (and, for
recompute, opens a Segment); a forward hook closes it and registers a grad hook on its outputs,
which fires when backward reaches the unit: the units backward finished before it release what
they consumed, and the activations of the next `prefetch_units` units (in reverse forward order)
start coming back within the budget. `saved_tensors_hooks(pack, unpack)` is active for the
whole forward: pack hands autograd a SavedRef (or a ParamView for a parameter, a RecomputeRef
inside a recompute segment), unpack rebuilds the tensor from wherever its bytes are then.

Note: pieces. A partial or recompute_pieces unit whose root module has children runs each
child's call as its own segment (a piece: for a transformer block the two norms, the attention,
the MLP), with its own checkpoint (the child's arguments) and, partial only, kept outputs
(recompute_pieces is this without the operator log: each piece runs whole again, from its own
checkpoint, the compute of a whole recompute at one piece's peak). In backward a piece is recomputed when
backward reaches it, only its records are fetched (and the previous piece's within the budget),
and the records the pieces after it consumed are released at its recompute (their backward is
done: autograd runs a block's pieces last to first). Backward of the block then holds one
piece's saved tensors at a time, not the block's: the MLP's 9 of a GPT-2 block's 16 x width
values a token (its GELU saving only its input: offloadpp/runtime/activations/gelu.py).
Operators of the root's own forward outside its children (residual adds) save
nothing in these blocks; what they save is kept. A piece whose argument is the previous piece's
output, where that piece is a norm, takes no checkpoint for it: the norm runs again (recompute.py,
Note on derived checkpoints).

Note: the fused head. Where it applies (head.py: config.fused_loss, a supported Hugging Face
causal LM, training with labels), the output embedding returns a placeholder and the loss runs the
head's matmul chunk by chunk after the head unit's forward hook closed it. Its saved tensors are
made under _head_scope, as records of the unit that owns the output embedding (found by the
module): h and the logits with the head's policy (keep, host, ssd) or its checkpoint's (partial,
partial_host, partial_ssd: the logits are the output of its matmul, which partial keeps), or h
alone with the checkpoint's policy where the head recomputes (recompute*: backward computes the
logits again). The planner counts the same (planner/activations.py, Note on the head's loss). The placeholder's own call opens no recompute segment; the norm before it is treated as
always. A hook on the loss starts the head's backward (_head_backward, and the runtime's
on_head_backward) before the fused backward runs; the grad hooks on the norm's output fire once
the fused backward gave it its gradient.

The manager's parts: units.py (each unit's state in a step), backward.py (backward's side:
entering units, fetching ahead, releasing), reports.py (the stats, the auto policies resolved).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from offloadpp.planner import ActivationSettings
from offloadpp.planner.activations import TAIL_PIECES

from ..accel import Accelerator, accelerator
from .backward import ManagerBackward
from .flops import FlopCounter
from .gelu import restore_gelu, substitute_gelu
from .head import FusedHead, fusable_head, head_mode, refuse_grad_in_forward
from .loss import causal_lm, restore_loss, substitute_loss, uses_causal_lm_loss
from .partial import OpLog, Recorder
from .policy import ActPolicy, UnitActProfile
from .recompute import DerivedRef, Segment
from .records import (
    ParamIndex,
    SavedStorage,
)
from .reports import ManagerReports
from .saves import ManagerSaves
from .swap import Swapper
from .swiglu import restore_swiglu, substitute_swiglu
from .units import ActPhase, UnitActivations

log = logging.getLogger("offloadpp.runtime")


class ActivationManager(ManagerBackward, ManagerSaves, ManagerReports):
    def __init__(
        self,
        units: Sequence[tuple[str, Sequence[nn.Module]]],
        config: ActivationSettings,
        *,
        key_prefix: str = "act",
        store=None,
        device: torch.device | str | Accelerator = "cpu",
        policies: Optional[Sequence[str]] = None,
        model: Optional[nn.Module] = None,
        params=None,
    ):
        """units: (name, root modules) in forward order. policies: one per unit, overriding the
        config's (a Plan's). params: the runtime's own saved-parameter hooks (the executor: its
        `pack`, `unpack` and the `handle` type pack returns), tried first (it knows which weights
        are bound and fetches them for backward). device: the engine's accelerator, or a device
        spec (an accelerator of the manager's own, OFFLOADPP_DEVICE applied: accel/select.py)."""
        names = [n for n, _ in units]
        unknown = sorted(set(config.overrides) - set(names))
        if unknown:
            raise ValueError(
                f"activation overrides name units the model does not have: {unknown}; units are {names}"
            )
        if not key_prefix or "/" in key_prefix:
            raise ValueError(f"key_prefix must be a non-empty name without '/', got {key_prefix!r}")
        if policies is not None and len(policies) != len(units):
            raise ValueError(f"{len(policies)} activation policies for {len(units)} units")
        self.config = config
        self.budget = config.budget_bytes
        self._own_accel = not isinstance(device, Accelerator)
        self.accel = accelerator(str(torch.device(device))) if self._own_accel else device
        self.device = self.accel.torch_device
        self.units = [
            UnitActivations(
                n,
                tuple(r),
                ActPolicy(policies[i] if policies is not None else config.overrides.get(n, config.policy)),
            )
            for i, (n, r) in enumerate(units)
        ]
        ssd = {
            ActPolicy.SSD,
            ActPolicy.RECOMPUTE_SSD,
            ActPolicy.RECOMPUTE_NESTED_SSD,
            ActPolicy.RECOMPUTE_PIECES_SSD,
        } | ({ActPolicy.AUTO} if self.budget else set())
        needs_ssd = [u.name for u in self.units if u.requested in ssd]  # (auto under a budget: may)
        if needs_ssd and store is None:
            raise ValueError(f"units {needs_ssd} swap activations to SSD (or may), no TensorStore was given")
        self.store = store
        self.outside = UnitActivations("(outside units)", (), ActPolicy.KEEP)
        self._all = ParamIndex()
        self._model = model
        self._ext = (params.pack, params.unpack, params.handle) if params is not None else None
        self.swapper = Swapper(self.accel, store, key_prefix=key_prefix, host_budget_bytes=None)
        self._handles: list = []
        self._gelus: list[nn.Module] = []
        self._swiglus: list[nn.Module] = []
        self._loss = None
        self._fused: Optional[FusedHead] = None  # the fused head (head.py), where it applies
        self._head_owner: Optional[UnitActivations] = None  # the unit that owns its output embedding
        # the runtime's: called with the head unit's name when backward reaches the fused loss
        self.on_head_backward: Optional[Callable[[str], None]] = None
        self._order: list[UnitActivations] = []
        self._index: dict = {}  # StorageWeakRef -> SavedStorage, this forward's dedup index
        # (unit, its open Segment, None, or the policy the fused head's saves take: _head_scope)
        self._stack: list[tuple[UnitActivations, Optional[Segment | ActPolicy]]] = []
        self._recorders: list[Recorder] = []  # partial units' dispatch modes, innermost last
        self._consumed: list[SavedStorage] = []
        self._evicted: list[SavedStorage] = []  # sources evicted, to come back within the budget (saves.py)
        self._bw_unit: Optional[UnitActivations] = None
        self._in_backward = False
        self._stage = True  # this backward reads SSD records ahead of the device room (start_backward)
        self._active = False  # inside forward(): the unit hooks act only then
        self._flops: Optional[FlopCounter] = None
        self._probing = any(u.requested is ActPolicy.AUTO for u in self.units)
        self.profiles: Optional[tuple[UnitActProfile, ...]] = None  # what auto was resolved from
        self._closed = False
        self.reset_stats()

    @classmethod
    def for_model(
        cls, model: nn.Module, config: ActivationSettings, *, store=None, device=None, unit_split=None
    ):
        """Units found as the runtime finds them (runtime/partition.py); hooks installed."""
        from ..partition import find_units

        modules = dict(model.named_modules())
        defs = find_units(model, unit_split)
        if device is None:
            p = next(model.parameters(), None)
            device = p.device if p is not None else "cpu"
        mgr = cls(
            [(d.name, [modules[q] for q in d.modules]) for d in defs],
            config,
            store=store,
            device=device,
            model=model,
        )
        mgr.install()
        return mgr

    # ---- hooks ---------------------------------------------------------------------------
    def install(self) -> None:
        # GELU's formula saving only its input (gelu.py's Note); undone by remove()
        self._gelus = substitute_gelu(m for u in self.units for m in u.roots)
        # Llama's MLP saving its input, gate's and up's outputs only (swiglu.py's Note)
        self._swiglus = substitute_swiglu(m for u in self.units for m in u.roots)
        # the loss saving the logits only (offloadpp/runtime/activations/loss.py)
        self._loss = substitute_loss(self._model)
        self._install_fused_head()
        self._check_grad_in_forward()
        for u in self.units:
            for m in u.roots:
                self._handles.append(
                    m.register_forward_pre_hook(functools.partial(self._pre, u), with_kwargs=True)
                )
                self._handles.append(m.register_forward_hook(functools.partial(self._post, u)))
                for c in m.children():  # a partial unit's pieces (see the Note on pieces)
                    self._handles.append(
                        c.register_forward_pre_hook(functools.partial(self._piece_pre, u), with_kwargs=True)
                    )
                    self._handles.append(c.register_forward_hook(functools.partial(self._piece_post, u)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        restore_gelu(self._gelus)
        restore_swiglu(self._swiglus)
        self._gelus, self._swiglus = [], []
        if self._fused is not None:
            self._fused.remove()
            self._fused = None
        restore_loss(self._loss)
        self._loss = None

    def _install_fused_head(self) -> None:
        """The head's matmul and the loss fused (head.py), where config.fused_loss asks for it,
        the loss is the substituted causal_lm_loss and a unit owns the output embedding."""
        lin = fusable_head(causal_lm(self._model)) if self.config.fused_loss else None
        if lin is None or not uses_causal_lm_loss(self._model):
            return
        owner = next((u for u in self.units if any(m is lin for r in u.roots for m in r.modules())), None)
        if owner is None:
            return
        if owner.policy is ActPolicy.PARTIAL_HOST_TAIL:  # (its logits, the matmul's output, move
            owner.policy = ActPolicy.PARTIAL_HOST  # as partial_host's: as the planner counts it)
        self._fused = FusedHead(self._model, lin, scope=functools.partial(self._head_scope, owner),
                                mode=lambda: head_mode(owner.policy), gate=lambda: self._active,
                                on_backward=functools.partial(self._head_backward, owner))  # fmt: skip
        self._head_owner = owner
        self._fused.install()

    def _check_grad_in_forward(self) -> None:
        owner = self._head_owner.name if self._fused is not None and self._head_owner is not None else None
        refuse_grad_in_forward({u.name: u.requested for u in self.units}, owner)

    def _head_backward(self, unit: UnitActivations) -> None:
        """Backward reached the fused loss: the head's backward starts here (its records are
        fetched, and the runtime's hook enters its backward visit) as it did at the logits'
        gradient before the head was fused."""
        self._enter_backward(unit)
        if self.on_head_backward is not None:
            self.on_head_backward(unit.name)

    @contextlib.contextmanager
    def _head_scope(self, unit: UnitActivations):
        """The fused loss runs after the head unit's forward closed (see the Note on the fused
        head): what it saves becomes the head's records, with the head's policy (keep, host, ssd),
        else its checkpoint's (partial*: h and the logits; recompute*: h only); grad_in_forward:
        grad_h, grad_W and grad_b, kept."""
        policy = (unit.policy.checkpoint or ActPolicy.KEEP) if unit.policy.recomputes else unit.policy
        if policy is ActPolicy.GRAD_IN_FORWARD:  # (the gradients it holds are kept: head.py)
            policy = ActPolicy.KEEP
        if self._flops is not None:
            unit.flops -= self._flops.total
        self._stack.append((unit, policy))
        try:
            yield
        finally:
            self._stack.pop()
            if self._flops is not None:
                unit.flops += self._flops.total

    @contextlib.contextmanager
    def forward(self):
        """The forward pass: saved-tensor hooks active (and the FLOP counter while profiling)."""
        self._check_open()
        if self._in_backward:
            self.end_backward()  # the previous backward was not closed
        self._all.rebuild(
            [self._model] if self._model is not None else [m for u in self.units for m in u.roots]
        )
        self._stack.clear()
        probe = self._probing and torch.is_grad_enabled()
        self._flops = FlopCounter() if probe else None
        self._active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                with self._flops if self._flops is not None else contextlib.nullcontext():
                    yield
        finally:
            if self._fused is not None:
                self._fused.armed = False  # (a forward that raised before the head)
            while self._recorders:  # a forward that raised inside a partial unit
                self._recorders.pop().__exit__(None, None, None)
            self._active = False
            self._flops = None
            self._stack.clear()
        if probe:
            self._resolve_from_probe()

    def _pre(self, unit: UnitActivations, module, args, kwargs):
        if not self._active or not torch.is_grad_enabled():
            return None
        if unit.phase is ActPhase.IDLE:
            unit.phase = ActPhase.FORWARD
            unit.position = len(self._order)
            self._order.append(unit)
        unit.params.rebuild(unit.roots)
        seg = None
        fused = self._fused is not None and self._fused.armed and module is self._fused.linear
        if (
            unit.policy.recomputes
            and not fused  # (the fused head's placeholder saves nothing; the loss saves for it)
            and not (unit.policy.piecewise and any(True for _ in module.children()))
        ):
            seg = self._open_segment(unit, module, args, kwargs)
        elif unit.policy.partial_last:  # (the segment this call's last child will open: policy.py)
            unit.last_piece = len(unit.segments) + sum(1 for _ in module.children()) - 1
        if self._flops is not None:
            unit.flops -= self._flops.total
        self._stack.append((unit, seg))
        return None

    def _open_segment(self, unit: UnitActivations, module, args, kwargs) -> Segment:
        for rec in unit.open_piece(TAIL_PIECES) if unit.policy.tail else ():  # (policy.py)
            self.swapper.swap_out(rec)
        first = len(unit.records)
        logs = unit.policy.partial or (unit.policy.partial_last and len(unit.segments) == unit.last_piece)
        if unit.policy.piecewise and unit.segments:  # the previous piece's output, derived again
            prev = unit.segments[-1]
            args, kwargs = tree_map(
                lambda x: DerivedRef(prev, x.requires_grad) if prev.derives(x) else x, (args, kwargs)
            )
            if unit.policy.refetch and any(type(x) is DerivedRef for x in tree_leaves((args, kwargs))):
                self._mark_sources(unit, prev)
        if unit.policy.checkpoint is not None:  # the inputs leave the device as swapped records
            args, kwargs = tree_map(functools.partial(self._checkpoint, unit), (args, kwargs))
            inputs = 0  # (the records account their bytes)
        else:
            inputs = self._measure(tree_leaves((args, kwargs)), unit.params)
        seg = Segment(unit.name, module.forward, args, kwargs, self.device, inputs)
        seg.owner = unit
        if unit.policy.nested:  # (nested.py, Note on nested)
            seg.piece_modules = tuple(c for c in module.children() if any(True for _ in c.parameters()))
        elif unit.policy.recomputes and not unit.policy.partial and not unit.policy.piecewise:
            # (a whole recompute releases its pieces' bytes one by one: recompute.py, Note on release)
            seg.release_modules = tuple(c for c in module.children() if any(True for _ in c.parameters()))
        # (a swapped piece: its storages released as backward is done with them, recompute.py,
        # Note on release within a piece; not a tail's, whose last pieces stay on the device)
        seg.release_storages = (
            unit.policy.piecewise and unit.policy.checkpoint is not None and not unit.policy.tail
        )
        seg.first_record = first
        self.swapper.add_device(inputs)
        unit.segments.append(seg)
        if logs:  # the expensive operators' outputs become the unit's records
            seg.log = OpLog()
            keep = functools.partial(self._record, unit, policy=unit.policy.checkpoint or ActPolicy.KEEP)
            recorder = Recorder(unit.name, seg.log, keep)
            recorder.__enter__()
            self._recorders.append(recorder)
        return seg

    def _close_segment(self, seg: Segment, output=None) -> None:
        if seg.log is not None:
            recorder = self._recorders.pop()
            recorder.__exit__(None, None, None)
            recorder.check()
        seg.close(output)

    def _piece_pre(self, unit: UnitActivations, module, args, kwargs):
        """A child of a partial or recompute_pieces unit's root: one piece, its own segment (see the Note on pieces);
        of a nested unit's: where its saved tensors begin (nested.py, Note on nested)."""
        if self._active and unit.policy.nested and self._stack and self._stack[-1][0] is unit:
            seg = self._stack[-1][1]
            if type(seg) is Segment and module in seg.piece_modules:
                if not seg.piece_depth:
                    seg.last_piece_start = seg.count
                seg.piece_depth += 1
            return None
        if (
            not self._active
            or not self._stack
            or self._stack[-1] != (unit, None)
            or not unit.policy.piecewise
        ):
            return None
        self._stack.append((unit, self._open_segment(unit, module, args, kwargs)))
        return None

    def _piece_post(self, unit: UnitActivations, module, args, output):
        if not self._active or not self._stack or self._stack[-1][0] is not unit:
            return None
        seg = self._stack[-1][1]
        if unit.policy.nested:
            if type(seg) is Segment and module in seg.piece_modules:
                seg.piece_depth -= 1
            return None
        if type(seg) is not Segment or seg.fn != module.forward:
            return None
        self._stack.pop()
        self._close_segment(seg, output)
        return None

    def _post(self, unit: UnitActivations, module, args, output):
        if not self._active or not self._stack or self._stack[-1][0] is not unit:
            return None
        _, seg = self._stack.pop()
        if type(seg) is Segment:
            self._close_segment(seg)
        if self._flops is not None:
            unit.flops += self._flops.total
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._grad_hook, unit), mode="any"
            )
        return None

    def _grad_hook(self, unit: UnitActivations, grad) -> None:
        self._enter_backward(unit)

    # ---- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the ActivationManager was closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.end_backward()
        self.remove()
        self.swapper.close()
        if self._own_accel:
            self.accel.close()

    def __enter__(self) -> ActivationManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
