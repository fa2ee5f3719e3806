"""What a step did: the engine's counters, its StepReport and its budgets' peaks
(`StepAccounting`, an object OffloadEngine builds once its parts exist: runtime/engine.py)."""

from __future__ import annotations

import time
from typing import Optional

from offloadpp.planner.traffic import KINDS, tally

from .config import BudgetUse, StepReport
from .speculation import Outcome


class StepAccounting:
    """A step's counters and its StepReport. It holds the parts whose counters it reads (taken
    from the engine once, when the engine has built them); the engine adds the step's times
    (`step_t0`, `forward_s`, `backward_s`, `optimizer_s`) as they pass."""

    def __init__(self, engine):
        self.store, self.optimizer, self.executor = engine.store, engine.optimizer, engine.executor
        self.activations, self.device, self.dp = engine.activations, engine.device, engine.dp
        self.device_pool, self.host_pool = engine.device_pool, engine.host_pool
        self.plan, self.predicted, self.speculation = engine.plan, engine.predicted, engine.speculation
        self.predicted_deferred = engine.predicted_deferred
        self.predicted_loop = engine.predicted_loop
        self.ssd_read_gbps, self.ssd_write_gbps = engine.ssd_read_gbps, engine.ssd_write_gbps
        self.link_gbps = engine.link_gbps
        self._act_run_peak = self._act_host_run_peak = 0
        self.reset()

    def reset(self) -> None:
        """A new step starts counting."""
        self.activations.reset_stats()
        self.device_pool.reset_step_peak()
        self.host_pool.reset_step_peak()
        self.device.step_peak_bytes = self.device.bytes_in_use
        self.step_t0: Optional[float] = None
        self.vertical = False  # the step is a vertical window's (runtime/accumulate.py sets it)
        self.forward_s = self.backward_s = self.optimizer_s = 0.0
        self._io0 = self.store.stats
        self._kinds0 = self.store.bytes_by_kind()
        self._wait0 = self._waits()
        self._adam0 = self.optimizer.adam_s
        self._misses0 = self.executor.misses
        self._h2d0, self._d2h0 = self.device.h2d_bytes, self.device.d2h_bytes
        self._comm0 = self.dp.comm if self.dp is not None else (0, 0.0)

    def _waits(self) -> float:
        act = self.activations.swapper
        return (
            self.executor.wait_s + self.device_pool.wait_s + self.host_pool.wait_s
            + act.swap_out_wait_s + act.swap_in_wait_s
        )  # fmt: skip

    def report(self, step: int, outcome: Optional[Outcome], scale, exposed: float) -> StepReport:
        """The StepReport of the step that just ended (the `step`-th optimizer step); counting
        starts again."""
        io = self.store.stats - self._io0
        kinds = self.store.bytes_by_kind()
        by_kind = tally((k, w, n - self._kinds0.get((k, w), 0)) for (k, w), n in kinds.items() if k in KINDS)
        wait = self._waits() - self._wait0
        compute = max(0.0, self.forward_s + self.backward_s - wait)
        adam = self.optimizer.adam_s - self._adam0
        ssd = io.bytes_read / (self.ssd_read_gbps * 1e9) + io.bytes_written / (self.ssd_write_gbps * 1e9)
        comm = self.dp.comm if self.dp is not None else (0, 0.0)
        comm_bytes, comm_s = comm[0] - self._comm0[0], comm[1] - self._comm0[1]
        comm_floor = comm_bytes / (self.link_gbps * 1e9) if self.link_gbps else 0.0
        now = time.perf_counter()
        predicted = self.predicted_for(outcome.mode if outcome is not None else "in-backward", self.vertical)
        report = StepReport(
            step=step,
            step_s=now - (self.step_t0 if self.step_t0 is not None else now),
            forward_s=self.forward_s,
            backward_s=self.backward_s,
            optimizer_wait_s=self.optimizer_s,
            fetch_wait_s=wait,
            compute_s=compute,
            adam_s=adam,
            ssd_s=ssd,
            floor_s=max(compute, ssd, adam, comm_floor),
            ssd_read_bytes=io.bytes_read,
            ssd_write_bytes=io.bytes_written,
            host_to_device_bytes=self.device.h2d_bytes - self._h2d0,
            device_to_host_bytes=self.device.d2h_bytes - self._d2h0,
            fetch_misses=self.executor.misses - self._misses0,
            grad_norm=outcome.grad_norm if outcome is not None else None,
            skipped=outcome is not None and outcome.skipped,
            loss_scale=scale,
            updates=outcome.mode if outcome is not None else "in-backward",
            speculated_units=outcome.speculated if outcome is not None else 0,
            committed_units=outcome.committed if outcome is not None else 0,
            redone_units=outcome.redone if outcome is not None else 0,
            optimizer_exposed_s=exposed,
            mode_switches=self.speculation.switches,
            predicted_s=predicted.step_s if predicted is not None else None,
            budgets=self.budget_report(),
            recompute_s=self.activations.recompute_s,
            ranks=self.dp.world if self.dp is not None else 1,
            comm_bytes=comm_bytes,
            comm_s=comm_s,
            comm_floor_s=comm_floor,
            ssd_by_kind=by_kind,
            predicted_ssd_by_kind=predicted.ssd_by_kind if predicted is not None else (),
        )
        self.reset()
        return report

    def predicted_for(self, updates: str, vertical: bool = True):
        """The cost model's estimate of a step whose updates ran as `updates` (StepReport.updates):
        a speculative plan's estimate is of a step that validates, so a step that deferred (it
        clipped) is set beside the plan's deferred estimate, which moves other bytes (the
        gradients through their home and back, the state read at the next visit). A vertical
        plan's estimates are of its window run whole (train_batch): a step that ran horizontally
        (`vertical` False: a per-micro-batch loop, or a window that recorded its RNG tapes) is
        set beside the estimate of that loop (Resolved.loop_estimate), of a step that validates.
        None where there is no estimate of that way."""
        if self.plan.vertical and not vertical:
            return None if updates == "deferred" and self.plan.speculative else self.predicted_loop
        if updates == "deferred" and self.plan.speculative:
            return self.predicted_deferred
        return self.predicted

    def budget_report(self) -> tuple[BudgetUse, ...]:
        """Each budget with the most the engine held against it in the current step and since it
        started, by its own accounting: the device buffers (on CUDA the device copies, on the CPU
        device its pool) against the device budget less the activations' part, the host buffers
        (optimizer state, gradients, staging), the saved activations on the device against their
        part, and the host buffers of swapped activations (not limited)."""
        b = self.plan.budgets
        if self.device.copies:
            dev_step, dev_run = self.device.step_peak_bytes, self.device.peak_bytes
        else:
            dev_step, dev_run = self.device_pool.step_peak_bytes, self.device_pool.peak_bytes
        act = self.activations.stats()
        self._act_run_peak = max(self._act_run_peak, act.peak_device_bytes)
        self._act_host_run_peak = max(self._act_host_run_peak, act.peak_host_bytes)
        return (
            BudgetUse("device", b.buffer_bytes, dev_step, dev_run, self.device_pool.step_longest_wait_s),
            BudgetUse(
                "host",
                b.host_bytes,
                self.host_pool.step_peak_bytes,
                self.host_pool.peak_bytes,
                self.host_pool.step_longest_wait_s,
            ),
            BudgetUse("activations", b.activation_bytes, act.peak_device_bytes, self._act_run_peak),
            BudgetUse("activation staging", None, act.peak_host_bytes, self._act_host_run_peak),
        )

    def peak_device_bytes(self) -> int:
        """Peak bytes of the runtime's own device buffers so far (activations not counted)."""
        return self.budget_report()[0].run_peak_bytes

    def peak_host_bytes(self) -> int:
        """Peak bytes of the runtime's host buffers so far (optimizer state, gradients, staging)."""
        return self.host_pool.peak_bytes
