"""Clipping and fp16 without losing the overlap: speculate, validate, redo exactly.

Gradient clipping by global norm and the fp16 overflow check need every gradient before the
first update may use any (DESIGN.md). Deferring the updates to the end of backward is exact but
puts the whole Adam pass after backward. Instead, while a step speculates, each unit is updated
during backward with its raw gradients, as without clipping (runtime/optimizer.py), and at the
end of backward the global norm and the overflow flag decide (`finish_updates`):

  clip coefficient exactly 1, nothing overflowed   commit: the speculative updates are the
                                                    ones deferred updates would have made
  fp16 overflow                                     the speculative updates are forgotten and the
                                                    step skipped, as deferred updates skip it
  the norm is over the limit (clipping)            the speculative updates are forgotten and
                                                    every unit is updated again from the state of
                                                    the last completed step, with the clipped
                                                    gradients: the deferred updates, bit for bit

Note: what makes the redo exact. Nothing is undone by arithmetic (SuperOffload's rollback,
`adam_rollback` in DeepSpeed's CPU Adam, inverts the update in floating point and does not give
the previous state back; and it speculates only where no clipping is configured). Here the
speculative writes go to the new generation of each transactional slot (runtime/slots.py, the
step's transaction is open) while the previous generation, the last completed step's state, stays
on SSD untouched until the step commits; the gradients are kept until then (in their gradient
buffer, where deferred updates keep them, or, for the unit whose gradients complete last, where
autograd left them). Forgetting the new generation and running the deferred updates over the kept
gradients is the deferred step: the same inputs, the same kernel calls (each element of the fused
Adam is the same IEEE sequence however the work is split), and the same clip coefficient, since
every unit's squared norm is summed over the same pieces either way (Unit.norm_pieces, and
optim.adam_step_pieces takes it in the Adam pass bit for bit as squared_norm does).

Note: when to speculate (Settings.speculate "auto"). A validated speculative step costs what an
unclipped one does; a redo costs the wasted speculative pass (on the worker, overlapped with
backward), the state read again after it, and the memory a speculating step holds beyond a
deferred one. An overflow costs nothing more than deferring would (the step is skipped either
way), so only clipping counts. Steps speculate while the recent ones validated: with clipping a
run begins deferred (a deferred step knows its norm too), speculates once SPECULATE_AFTER steps
in a row had norms within the limit, and defers again after a step that clipped; clipping
typically triggers early in training and then for good or not at all, so a run that always clips
(a fresh model) never pays for a redo. Without clipping (fp16 alone) nothing but an overflow can
fail: it speculates from the start. Every switch is counted and logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger("offloadpp.runtime")

SPECULATE_AFTER = 2  # steps within the clip norm in a row before speculating again


class SpeculationPolicy:
    """Whether the next step speculates: mode "on", "off" or "auto" (Settings.speculate), on a
    plan that allows it (Plan.speculative)."""

    def __init__(self, mode: str, allowed: bool, clipping: bool):
        self.mode = mode
        self.allowed = allowed and mode != "off"
        # "on" always; "auto" once recent steps validated (with clipping: none yet, module Note)
        self.speculating = self.allowed and (mode == "on" or not clipping)
        self.within = 0  # steps in a row whose norm stayed within the clip norm, while deferring
        self.switches = 0

    def record(self, step: int, clipped: bool) -> None:
        """The outcome of optimizer step `step` (clipped: its clip coefficient was below 1)."""
        if not self.allowed or self.mode != "auto":
            return
        if self.speculating and clipped:
            self.speculating, self.within = False, 0
            self.switches += 1
            log.info(
                "offloadpp: step %d clipped its gradients: updates are deferred until %d steps in a row stay "
                "within the clip norm", step, SPECULATE_AFTER,
            )  # fmt: skip
        elif not self.speculating:
            self.within = 0 if clipped else self.within + 1
            if self.within >= SPECULATE_AFTER:
                self.speculating = True
                self.switches += 1
                log.info(
                    "offloadpp: %d steps in a row within the clip norm: updates run speculatively during "
                    "backward again", self.within,
                )  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """How a step's updates went (StepReport carries it)."""

    grad_norm: float
    skipped: bool
    clipped: bool
    mode: str  # "speculative" | "deferred"
    speculated: int = 0  # units updated during backward
    committed: int = 0  # of them, kept as they were
    redone: int = 0  # of them, forgotten and updated again with the clipped gradients


def clip_coef(max_norm: float, grad_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient, clamped at 1 (1 exactly: no clipping)."""
    return min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm > 0 else 1.0


def finish_updates(
    optimizer, *, scale: float, max_norm: float, loss_scaler, steps: dict, dp=None, lazy: bool = False
) -> Outcome:
    """At step(), once backward is over: the global norm and overflow check validate the step's
    speculative updates (if any), and the updates not made yet are made (module Note).
    scale: the fp16 loss scale (1 otherwise); steps: each unit's Adam step counts at the start of
    the window (for a redo); dp: the data-parallel ranks, whose shards' parts are summed (several
    ranks never speculate: planner/resolve.py); lazy: a step that deferred leaves its updates
    pending, to be applied at each unit's next visit (runtime/pending.py)."""
    optimizer.wait_absorbed()
    sq = sum(u.sq_norm for u in optimizer.order if u.sq_norm is not None)
    if dp is not None:
        sq = dp.sum(sq)  # each rank's shards' part (runtime/dp/sharded_optimizer.py)
    finite = math.isfinite(sq)
    grad_norm = math.sqrt(sq) / scale if finite else float("inf")
    spec = optimizer.speculated()
    mode = "speculative" if optimizer.speculating else "deferred"
    if loss_scaler is not None:
        loss_scaler.update(overflow=not finite)
    if not finite:
        if loss_scaler is None:
            raise FloatingPointError(f"the global gradient norm is {sq} (inf or nan): the loss diverged")
        optimizer.forget(spec, steps)
        optimizer.skip_update()
        return Outcome(grad_norm, True, False, mode, speculated=len(spec))
    clip = clip_coef(max_norm, grad_norm)
    if clip != 1.0 and spec:
        optimizer.forget(spec, steps)  # the redo: every unit from the last completed step
    if lazy and not optimizer.speculating:
        optimizer.defer_to_visits(clip_coef=clip, grad_scale=scale)
    else:
        optimizer.run_deferred(clip_coef=clip, grad_scale=scale)
    committed = len(spec) if clip == 1.0 else 0
    return Outcome(grad_norm, False, clip != 1.0, mode, len(spec), committed, len(spec) - committed)


__all__ = ["Outcome", "SPECULATE_AFTER", "SpeculationPolicy", "clip_coef", "finish_updates"]
