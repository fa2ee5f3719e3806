"""An accumulation window run whole: `OffloadEngine.train_window` and `eval_window`.

Vertical (runtime/window.py): forward runs unit by unit, each unit over all G micro-batches
while its weights are bound; one backward over the G losses runs unit by unit in reverse, each
unit's gradients summed over the micro-batches on the device (by autograd, or in fp32 with
16-bit compute: runtime/window_grads.py, then rounded once to the compute dtype: Plan.window_grad_dtype)
and handed to the optimizer once; the step follows.
Weights are read once for forward and once for backward per window, and the gradients never
leave the device between micro-batches.

Note: RNG. Each micro-batch draws what it would have drawn run alone, in order (runtime/rng.py):
the first window of each input shape runs horizontally (forward, backward, step per micro-batch,
exact by definition) and records the tape of random operators each shape's forward makes; later
windows predict each micro-batch's start state from it. If a forward ends elsewhere than the next
one's predicted start, the window's graph is dropped before any backward (the engine back to its
last step, as after an interruption) and the window runs horizontally, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .config import StepReport
from .rng import RngState, Tape, TapeRecorder, predicted_starts, shape_key
from .transaction import holding_interrupts, interrupted_after_step
from .unit import TORCH_DTYPES
from .window import VerticalForward
from .window_grads import GradSums

log = logging.getLogger("offloadpp.runtime")


@dataclass(frozen=True)
class WindowResult:
    """losses: each micro-batch's loss (detached), in order; report: the step's; vertical:
    whether the window ran vertically."""

    losses: tuple[torch.Tensor, ...]
    report: Optional[StepReport]
    vertical: bool

    @property
    def mean_loss(self) -> torch.Tensor:
        return torch.stack([x.float() for x in self.losses]).mean()


def call(module: Callable, batch: Any):
    """A micro-batch as the model takes it: a dict of keyword arguments, a tuple (or list) of
    positional ones, or one argument."""
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def loss_of(out: Any, loss_fn: Optional[Callable[[Any], torch.Tensor]]) -> torch.Tensor:
    """The loss in a model's output: loss_fn(out) if given, else out.loss (Hugging Face), out
    itself if a tensor, else its first element."""
    if loss_fn is not None:
        loss = loss_fn(out)
    elif getattr(out, "loss", None) is not None:
        loss = out.loss
    elif isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        loss = out[0]
    else:
        raise TypeError(f"train_window: the model returned {type(out).__name__} with no loss; pass loss_fn")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"train_window: the loss must be a one-element tensor, got {loss!r:.80}")
    return loss


def _flag(scale) -> bool:
    return bool(scale()) if callable(scale) else scale


class WindowRunner:
    """Runs windows for an engine; holds the RNG tapes by input shape (the Note on RNG)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.tapes: dict[tuple, Tape] = {}
        self.sums = GradSums(engine.executor, engine.units)

    # ---- training ---------------------------------------------------------------------------
    def train(
        self, batches, *, vertical: Optional[bool], loss_fn, forward=None, scale_wrt_gas=True, done=None
    ) -> WindowResult:
        """forward(batch): a micro-batch's output (default: the model called on it, `call`);
        scale_wrt_gas: the losses divided by gradient_accumulation_steps (engine.backward's), or
        a function that says it when backward runs (a micro-batch step that calls backward itself
        says it as it runs: integrations/deepspeed/trainer_window.py); done(result): the
        caller's bookkeeping of the completed step, inside its end (_step). Whatever raises
        before the step completed rolls the window back (OffloadEngine.roll_back: this code's
        own between the engine's calls too); what it refuses up front changes nothing."""
        e = self.engine
        forward = forward if forward is not None else functools.partial(call, e.module)
        batches = list(batches)
        if not batches:
            raise ValueError("train_window: no micro-batches")
        e._check_open()
        if e.window_open:
            raise RuntimeError(
                "train_window: an accumulation window of single micro-batches (forward/backward/step) is half "
                "done; finish it with step() on its last micro-batch first"
            )
        if not torch.is_grad_enabled():
            raise RuntimeError("train_window: gradients are disabled (torch.no_grad); use eval_window")
        try:
            return self._train(batches, vertical, loss_fn, forward, scale_wrt_gas, done)
        except BaseException:
            e.roll_back()
            raise

    def _train(self, batches: list, vertical, loss_fn, forward, scale_wrt_gas, done) -> WindowResult:
        e = self.engine
        vertical = (e.plan.vertical if vertical is None else vertical) and len(batches) > 1
        keys = [shape_key(e.module.training, b) for b in batches]
        if vertical and all(k in self.tapes for k in keys):
            result = self._vertical(batches, keys, loss_fn, forward, scale_wrt_gas, done)
            if result is not None:
                return result
        return self._horizontal(batches, keys, loss_fn, forward, scale_wrt_gas, done)

    def _step(self, losses, vertical: bool, done) -> WindowResult:
        """The window's step and the caller's bookkeeping of it (done), a Ctrl-C held until both
        are complete (as OffloadEngine.step holds it until its own is), then raised."""
        e = self.engine
        with holding_interrupts() as interrupted:
            result = WindowResult(tuple(x.detach() for x in losses), e.step(), vertical=vertical)
            if done is not None:
                done(result)
        if interrupted:
            raise interrupted_after_step(e.global_step)
        return result

    def _horizontal(self, batches: list, keys: list, loss_fn, forward, scale, done) -> WindowResult:
        """Forward, backward, step per micro-batch; the tape of each shape not seen yet recorded."""
        e = self.engine
        losses = []
        count = len(batches) != e.settings.gradient_accumulation_steps
        for m, batch in enumerate(batches):
            loss = loss_of(self._forward_taped(forward, batch, keys[m]), loss_fn)
            if count:  # a window of another length than gradient_accumulation_steps: ends at its last
                e.set_boundary(m == len(batches) - 1)
            e.backward(loss, scale_wrt_gas=_flag(scale))
            losses.append(loss.detach())
            if m < len(batches) - 1:
                e.step()
        return self._step(losses, False, done)

    def _vertical(self, batches: list, keys: list, loss_fn, forward, scale, done) -> Optional[WindowResult]:
        """The window run vertically; None if the RNG did not follow the tapes (rerun it)."""
        e = self.engine
        e._boundary_override = True  # one backward, on the window's boundary
        # its gradients kept in the dtype a window's are (Plan.window_grad_dtype): in the
        # gradient slots acquired from its forward on (the optimizer reads ahead), for this window
        e.optimizer.window_grads = TORCH_DTYPES[e.plan.window_grad_dtype]
        try:
            return self._vertical_run(batches, keys, loss_fn, forward, scale, done)
        finally:
            e.optimizer.window_grads = None

    def _vertical_run(
        self, batches: list, keys: list, loss_fn, forward, scale, done
    ) -> Optional[WindowResult]:
        e = self.engine
        outs, off, starts = self._forward_vertical(forward, batches, keys)
        if off is not None:
            log.warning(
                "offloadpp: micro-batch %d's forward drew other random numbers than its input shape's first "
                "window did; the window runs again horizontally (and its shapes' RNG tapes are recorded again)",
                off,
            )
            del outs
            e._abort_step()  # nothing was updated yet: the graph and its activations are dropped
            self._forget(keys, starts)
            return None
        losses = [loss_of(o, loss_fn) for o in outs]
        del outs
        # 16-bit compute: each unit's gradients summed over the window in fp32 (window_grads.py)
        summing = self.sums.summing(losses) if e.plan.compute_dtype != "fp32" else contextlib.nullcontext()
        with summing:
            e._backward(losses, scale_wrt_gas=_flag(scale))
        e.accounting.vertical = True  # (its report is set beside the window's estimate)
        return self._step(losses, True, done)

    # ---- evaluation -------------------------------------------------------------------------
    def evaluate(self, batches, *, vertical: Optional[bool]) -> list:
        e = self.engine
        batches = list(batches)
        if not batches:
            raise ValueError("eval_window: no micro-batches")
        vertical = (e.plan.vertical if vertical is None else vertical) and len(batches) > 1
        keys = [shape_key(e.module.training, b) for b in batches]
        forward = functools.partial(call, e.module)
        with torch.no_grad():
            if vertical and all(k in self.tapes for k in keys):
                outs, off, starts = self._forward_vertical(forward, batches, keys)
                if off is None:
                    return outs
                self._forget(keys, starts)  # (no graph: nothing else to drop)
            return [self._forward_taped(forward, b, k) for b, k in zip(batches, keys)]

    # ---- the forwards both share ----------------------------------------------------------------
    def _forward_taped(self, forward, batch, key):
        """One micro-batch's forward; its input shape's RNG tape recorded if not seen yet."""
        e = self.engine
        tape = Tape() if key not in self.tapes else None
        with TapeRecorder(tape) if tape is not None else contextlib.nullcontext():
            out = e._forward(functools.partial(forward, batch))
        if tape is not None:
            self.tapes[key] = tape
        return out

    def _forward_vertical(self, forward, batches: list, keys: list):
        """The window's forwards run vertically from the tapes' predicted start states: (the
        outputs, the first micro-batch whose forward did not end where the next one was predicted
        to start (None: all did; the generators are then left where the last one's forward left
        them), the start states)."""
        e = self.engine
        dev = e.device.torch_device
        starts = predicted_starts(RngState(dev), [self.tapes[k] for k in keys], dev)
        fwd = VerticalForward(dev, starts)
        e.executor.window = fwd
        try:
            outs = e._forward(lambda: fwd.run(forward, batches))
        finally:
            e.executor.window = None
        off = next((m for m in range(len(batches) - 1) if fwd.ends[m] != starts[m + 1]), None)
        if off is None:
            fwd.ends[-1].restore()
        return outs, off, starts

    def _forget(self, keys: list, starts: list) -> None:
        """A window whose tapes did not hold: the generators back to its start, its shapes' tapes
        dropped (recorded again by the horizontal run that follows)."""
        starts[0].restore()
        for k in keys:
            self.tapes.pop(k, None)
