"""A step as a transaction (`StepTransaction`, an object OffloadEngine builds once its parts
exist: runtime/engine.py): it opens an accumulation window, commits the step, or rolls an
interrupted one back bit for bit, and remembers a step that could do neither. The generations it
relies on: runtime/slots.py."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from typing import Optional

from .unit import UnitPhase

log = logging.getLogger("offloadpp.runtime")


class StepTransaction:
    """The window's transaction. It holds the parts it works on (taken from the engine once, when
    the engine has built them), the Adam step counts at the window's start (`window_steps`), and
    `failed`: the error of a step that could neither complete nor roll back (the engine refuses
    to go on after it)."""

    def __init__(self, engine):
        self.plan, self.speculation, self.txn = engine.plan, engine.speculation, engine.txn
        self.optimizer, self.executor, self.activations = (
            engine.optimizer,
            engine.executor,
            engine.activations,
        )
        self.units, self.store, self.dp = engine.units, engine.store, engine.dp
        self.device_pool, self.host_pool = engine.device_pool, engine.host_pool
        self.deferred_pace, self.accounting = engine.deferred_pace, engine.accounting
        self.window_steps: list[list[int]] = [list(u.steps) for u in self.units]
        self.failed: Optional[BaseException] = None
        self.aborted = False  # a step was interrupted (its errors were raised then)

    def begin_window(self) -> None:
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
        self.window_steps = [list(u.steps) for u in self.units]

    def commit(self) -> None:
        for u in self.units:
            for s in u.slots:
                s.commit()
            u.phase = UnitPhase.IDLE
        self.txn.active = False

    def abort(self, global_step: int) -> None:
        """A step interrupted before it completed (an exception, Ctrl-C in forward or backward):
        every unit back to the state of the last completed step (the `global_step`-th), bit for
        bit (tests/test_faults.py). The engine resets its own micro-batch state after.

        Note: updates already made during backward went to the open generation of their slots,
        which is forgotten; the Adam step counts return to the window's start; gradients
        accumulated in the window are dropped. State the plan keeps in memory (a HOST tier) is
        updated in place and cannot go back: if any was, the engine refuses to go on and names
        the unit (load the last checkpoint)."""
        if isinstance(sys.exc_info()[1], KeyboardInterrupt) and not settled(sys.exc_info()[1]):
            log.warning("offloadpp: interrupted (KeyboardInterrupt) inside a step: the engine goes back to its last "
                        "completed step (%d); checkpoints on disk are not touched", global_step)  # fmt: skip
        errors = self.optimizer.finish_all()  # jobs in flight complete (they cannot be stopped half way)
        try:
            self.optimizer.complete_pending()  # the last completed step's (runtime/pending.py)
        except BaseException as e:  # noqa: BLE001
            errors += [e] + self.optimizer.finish_all()
            self.fail(e)
        errors += self.store.forget_failures()  # reported by the interruption, or moot after the rollback
        for e in errors:
            log.warning("offloadpp: an I/O operation of the interrupted step failed too: %s", e)
        torn = [
            u.name for u in self.units if self.txn.active and u.phase in (UnitPhase.UPDATING, UnitPhase.UPDATED)
            and any(s.resident and s.txn is not None and s.numel for s in u.slots)
        ]  # fmt: skip
        try:
            self.optimizer.drop_uncommitted_writes()
        except BaseException as e:  # noqa: BLE001
            self.fail(e)
        refresh = []
        for u, steps in zip(self.units, self.window_steps):
            updated = u.phase in (UnitPhase.UPDATING, UnitPhase.UPDATED)
            for s in u.slots:
                s.rollback()
            u.steps = list(steps)
            u.phase = UnitPhase.IDLE
            u.start_window()
            if updated and (u.device.copies or self.dp is not None) and u.weights.resident:
                refresh.append(u)
        if refresh and self.dp is not None:  # (gathering it again would need every rank here)
            self.fail(RuntimeError(f"the step was interrupted after unit {refresh[0].name!r}, resident on the device, "
                                    "was updated: over several ranks its weights cannot be rolled back"))  # fmt: skip
            refresh = []
        for u in refresh:  # a resident device copy took the forgotten update: the committed one back
            u.refresh_resident()
        self.executor.end_backward()
        self.activations.end_backward()
        self.txn.active = False
        self.aborted = True
        settle(sys.exc_info()[1])  # (the exception being handled, if any: a caller's roll_back leaves it)
        self.accounting.reset()
        if torn:
            self.fail(RuntimeError(
                f"the step was interrupted after unit {torn[0]!r} was updated, and that unit's optimizer state "
                "lives in memory, where the update cannot be undone"
            ))  # fmt: skip

    def fail(self, cause: BaseException) -> None:
        """The engine cannot go on (the first cause is kept)."""
        if self.failed is None:
            self.failed = cause
            log.error("offloadpp: the engine cannot go on: %s", cause)


# Note: settled. An exception that leaves the engine where it says (the step rolled back for it,
# or a Ctrl-C raised after the step it was held in completed) is marked, so that a caller's code
# around the runtime's calls (the DeepSpeed engine's, a window's) rolling back on any error
# (OffloadEngine.roll_back) neither rolls back twice nor says it twice.
_SETTLED = "_offloadpp_settled"


def settle(exc: Optional[BaseException]) -> Optional[BaseException]:
    if exc is not None:
        try:
            setattr(exc, _SETTLED, True)
        except (AttributeError, TypeError):  # takes no attributes: said twice at worst
            pass
    return exc


def settled(exc: Optional[BaseException]) -> bool:
    return bool(getattr(exc, _SETTLED, False))


def interrupted_after_step(step: int) -> KeyboardInterrupt:
    """The KeyboardInterrupt to raise for a Ctrl-C held until step `step` completed (said here)."""
    log.warning("offloadpp: interrupted (KeyboardInterrupt) at the end of step %d, which completed first; "
                "checkpoints on disk are not touched", step)  # fmt: skip
    return settle(KeyboardInterrupt())


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
