"""A step as a transaction: the part of OffloadEngine (runtime/engine.py) that opens an
accumulation window, commits the step, or rolls an interrupted one back bit for bit (a mixin:
it works on the engine's parts). The generations it relies on: runtime/slots.py."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading

from .unit import UnitPhase

log = logging.getLogger("offloadpp.runtime")


class StepTransaction:
    """The transaction half of OffloadEngine."""

    def _begin_window(self) -> None:
        """A new accumulation window: its updates may run during backward (not deferred, or
        speculative), so the slots' writes go to a new generation until the step commits
        (slots.py). The last step's pending updates are that step's: done before it opens."""
        active = not self.plan.deferred_update or self.speculation.speculating
        if active:
            self.optimizer.complete_pending()
        self.txn.active = active
        if self.deferred_pace is not None:
            dev, host = (None, None) if self.txn.active else self.deferred_pace
            self.device_pool.pace_bytes, self.host_pool.pace_bytes = dev, host
        self._window_steps = [list(u.steps) for u in self.units]

    def _loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _commit(self) -> None:
        for u in self.units:
            for s in u.slots:
                s.commit()
            u.phase = UnitPhase.IDLE
        self.txn.active = False

    def _abort_step(self) -> None:
        """A step interrupted before it completed (an exception, Ctrl-C in forward or backward):
        every unit back to the state of the last completed step, bit for bit (tests/test_faults.py).

        Note: updates already made during backward went to the open generation of their slots,
        which is forgotten; the Adam step counts return to the window's start; gradients
        accumulated in the window are dropped. State the plan keeps in memory (a HOST tier) is
        updated in place and cannot go back: if any was, the engine refuses to go on and names
        the unit (load the last checkpoint)."""
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):
            log.warning("offloadpp: interrupted (KeyboardInterrupt) inside a step: the engine goes back to its last "
                        "completed step (%d); checkpoints on disk are not touched", self.global_step)  # fmt: skip
        errors = self.optimizer.finish_all()  # jobs in flight complete (they cannot be stopped half way)
        try:
            self.optimizer.complete_pending()  # the last completed step's (runtime/pending.py)
        except BaseException as e:  # noqa: BLE001
            errors += [e] + self.optimizer.finish_all()
            self._fail(e)
        errors += self.store.forget_failures()  # reported by the interruption, or moot after the rollback
        for e in errors:
            log.warning("offloadpp: an I/O operation of the interrupted step failed too: %s", e)
        torn = [
            u.name for u in self.units if self.txn.active and u.phase in (UnitPhase.UPDATING, UnitPhase.UPDATED)
            and any(s.resident and s.txn is not None for s in u.slots)
        ]  # fmt: skip
        try:
            self.optimizer.drop_uncommitted_writes()
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        refresh = []
        for u, steps in zip(self.units, self._window_steps):
            updated = u.phase in (UnitPhase.UPDATING, UnitPhase.UPDATED)
            for s in u.slots:
                s.rollback()
            u.steps = list(steps)
            u.phase = UnitPhase.IDLE
            u.start_window()
            if updated and (u.device.is_cuda or self.dp is not None) and u.weights.resident:
                refresh.append(u)
        if refresh and self.dp is not None:  # (gathering it again would need every rank here)
            self._fail(RuntimeError(f"the step was interrupted after unit {refresh[0].name!r}, resident on the device, "
                                    "was updated: over several ranks its weights cannot be rolled back"))  # fmt: skip
            refresh = []
        for u in refresh:  # a resident device copy took the forgotten update: the committed one back
            u.refresh_resident()
        self.executor.end_backward()
        self.activations.end_backward()
        self.txn.active = False
        self.micro_in_window = 0
        self._boundary_override = None
        self._micro = None
        self._aborted = True
        self.accounting.reset()
        if torn:
            self._fail(RuntimeError(
                f"the step was interrupted after unit {torn[0]!r} was updated, and that unit's optimizer state "
                "lives in memory, where the update cannot be undone"
            ))  # fmt: skip

    def _fail(self, cause: BaseException) -> None:
        if self._failed is None:
            self._failed = cause
            log.error("offloadpp: the engine cannot go on: %s", cause)


@contextlib.contextmanager
def holding_interrupts():
    """Ctrl-C (SIGINT) held while the block runs: yields a list that holds the signals that came
    meanwhile, for the caller to raise KeyboardInterrupt once its work is complete (its
    bookkeeping too, not only the block); elsewhere than the main thread, or where another
    handler was installed, nothing changes (the list stays empty)."""
    got: list = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield got
        return
    old = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, old)
