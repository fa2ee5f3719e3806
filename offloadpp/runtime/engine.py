"""OffloadEngine: trains an nn.Module whose training state lives on SSD (DESIGN.md, idea 1).

    config = RuntimeConfig(nvme_paths=[...], settings=Settings(...))
    plan = offloadpp.assemble.resolve_for_model(model, config.settings).plan   # the resolve stage
    engine = OffloadEngine(model, config, plan, hyper=AdamHyper(lr=1e-4))
    for batch in data:
        loss = engine(**batch).loss
        engine.backward(loss)
        report = engine.step()      # a StepReport on an accumulation boundary, else None

The model is split into units (runtime/partition.py), a finished Plan says where each unit's
arrays live and what each budget is (the runtime never re-decides it), and the executor's hooks
stream weights in ahead of each unit while the optimizer pipeline updates units on a worker as
their gradients complete (runtime/optimizer.py). After step() returns the weights are exactly
those an in-memory AdamW step gives. The engine's buffer pools hold to the plan's budgets
(runtime/memory.py) and each StepReport carries their peaks. What runs between steps
(checkpoints, exports, hyper-parameters, reports) is runtime/between_steps.py's.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import weakref
from dataclasses import replace
from typing import Any, Callable, Optional, Union

import psutil
import torch
from torch import nn
from torch.autograd.profiler import record_function

import offloadpp.runtime.host_heap as host_heap
from offloadpp.io import SwapDirLock, TensorStore, aligned_empty, measure_ssd, remove_swap_files
from offloadpp.optim import AdamHyper, default_num_threads
from offloadpp.planner import Plan, PlanError, build_schedule, fmt_bytes, io_settings, walk_peaks
from offloadpp.planner.cost import StepEstimate
from offloadpp.planner.decide import adam_threads
from offloadpp.planner.plan import shard_units
from offloadpp.planner.resolve import check_plan

from .accumulate import WindowResult, WindowRunner
from .activations.manager import ActivationManager
from .between_steps import BetweenSteps
from .config import RuntimeConfig, StepReport
from .device import Device
from .dp.distributed import DataParallel, rank_dirs
from .dp.sharded import ShardedUnit, initialize_sharded_units
from .dp.sharded_optimizer import ShardedOptimizerPipeline
from .executor import Executor
from .lifetime import close_at_exit, closed
from .memory import BufferPool
from .optimizer import OptimizerPipeline
from .partition import find_units, layout_units
from .precision import LossScaler
from .preflight import check_free_space, check_nvme_paths
from .reports import StepAccounting
from .slots import Txn
from .speculation import SpeculationPolicy, finish_updates
from .state import Exporter, check_buffers, default_init_fn, initialize_units, replace_meta_params
from .transaction import StepTransaction, holding_interrupts, interrupted_after_step, settle, settled
from .unit import Unit, UnitPhase

log = logging.getLogger("offloadpp.runtime")


def stripe_weights(paths, stripe) -> Optional[list[float]]:
    """Each swap directory's share of a striped tensor from the plan's (the profiled directory it
    lies in, or that lies in it: the runtime's are sub-directories of the ones profiled); None,
    equal parts, unless every directory has one."""
    if not stripe or len(paths) < 2:
        return None
    out = []
    for p in paths:
        p = os.path.abspath(p)
        w = [w for d, w in stripe if os.path.commonpath([p, os.path.abspath(d)]) in (p, os.path.abspath(d))]
        if not w:
            log.info("swap directory %s was not profiled: striping evenly", p)
            return None
        out.append(w[0])
    return out


class OffloadEngine(BetweenSteps):
    def __init__(
        self,
        model: nn.Module,
        config: RuntimeConfig,
        plan: Plan,
        *,
        hyper: Optional[AdamHyper] = None,
        init_fn: Optional[Callable[[nn.Module], None]] = None,
        progress: bool = False,
        predicted: Union[StepEstimate, tuple[Optional[StepEstimate], ...], None] = None,
        dp: Optional[DataParallel] = None,
    ):
        """plan: the finished plan for this model and config (offloadpp.assemble.resolve_for_model
        or planner.resolve); predicted: its estimated step, for the reports (or a Resolved's
        (estimate, deferred_estimate[, loop_estimate]): a speculative plan's step that defers, a
        vertical plan's per-micro-batch loop: reports.StepAccounting.predicted_for). A model on the meta
        device (built under offloadpp.Init) gets its weights unit by unit: from the safetensors
        its from_pretrained named, else from init_fn (default: the model's own init). dp: the
        data-parallel ranks (runtime/dp/distributed.py), each holding its shard of the state in a
        folder of its own under each nvme path (runtime/dp/sharded.py); the engine closes it."""
        self.dp = dp
        if dp is not None:
            config = config.model_copy(update={"nvme_paths": rank_dirs(config.nvme_paths, dp.rank)})
        self.config = config
        self.settings = s = config.settings
        self.hypers: tuple[AdamHyper, ...] = (hyper if hyper is not None else AdamHyper(),)
        self.module = model
        self.device = Device(config.device)
        # on the CPU device the step's freed memory is the device's: returned to the OS where
        # memory is short (host_heap's Notes)
        state = sum(
            u.numel * 16 + u.frozen_bytes(plan.compute_dtype) for u in plan.units
        )  # (frozen: docs/frozen.md)
        self._return_heap = not self.device.copies and host_heap.needed(
            state, psutil.virtual_memory().available
        )
        if self._return_heap:
            host_heap.return_freed_memory()
        if plan.budgets is None:
            raise PlanError(
                "the plan has no budgets: make it with offloadpp.assemble.resolve_for_model or planner.resolve"
            )
        check_nvme_paths(config.nvme_paths)
        self.replaced_params = replace_meta_params(model, self.device.placeholder)  # {id(old): new}
        meta = bool(self.replaced_params)
        check_buffers(model, self.device.torch_device)
        # frozen parameters get a segment of their own on one rank (docs/frozen.md)
        layouts = layout_units(model, find_units(model, s.units), split_frozen=plan.ranks == 1)
        specs = shard_units([lay.spec() for lay in layouts], dp.world if dp else 1)  # one rank's
        check_plan(plan, specs, self.device.kind, s)
        if plan.adam_threads is None:  # a plan made without the resolve stage (tests, benchmarks)
            plan = replace(plan, adam_threads=adam_threads(s, default_num_threads()))
        self.plan = plan
        # the plan's estimate, and for a speculative plan that of a step that defers its updates
        # (Resolved.deferred_estimate): a step's report is set beside the one of the way it ran
        self.predicted, self.predicted_deferred, self.predicted_loop = (
            tuple(predicted) + (None,) * (3 - len(predicted))
            if isinstance(predicted, tuple)
            else (predicted, None, None)
        )
        self.schedule = build_schedule(self.plan)
        self._closed = True  # until set up: close() has nothing to do
        self._lock = SwapDirLock(config.nvme_paths)  # one run per swap directory
        self.store = None
        try:
            n, nbytes = remove_swap_files(config.nvme_paths)
            if n:
                log.warning(
                    "removed %d stale swap files (%s) an earlier run left in %s", n, fmt_bytes(nbytes),
                    ", ".join(config.nvme_paths),
                )  # fmt: skip
            check_free_space(config.nvme_paths, self.plan)
            self.store = TensorStore(list(config.nvme_paths), config=self._io_config(), create=True,
                                     weights=stripe_weights(config.nvme_paths, plan.ssd_stripe))  # fmt: skip
            self._setup(model, layouts, init_fn, meta, progress)
        except BaseException:
            if self.store is not None:
                self.store.close()
            self._lock.release()
            raise
        # Note: an engine dropped without close() must leave nothing behind (threads, open
        # files, buffers, the lock). Its parts are released by a finalizer that holds them, not
        # the engine, so it runs once the engine is unreachable (the hooks reach the engine
        # weakly where torch keeps them out of the collector's sight: executor._param_hook).
        self._finalizer = weakref.finalize(
            self, _release, self.optimizer, self.activations.swapper, self.device, self.store,
            (self.device_pool, self.host_pool), self._lock, self.dp,
            None if config.keep_swap else tuple(config.nvme_paths),
        )  # fmt: skip
        close_at_exit(self)

    def _io_config(self):
        """The config's I/O engine with the plan's block size, queue depth and threads (the
        resolve stage decided them: planner/io_settings.py)."""
        return io_settings.applied(self.config.io, self.plan)

    def _setup(self, model, layouts, init_fn, meta: bool, progress: bool) -> None:
        self._build_pools()
        self._build_units(layouts)
        modules = dict(model.named_modules())
        self._initialize_weights(model, modules, init_fn, meta, progress)
        self._build_step(model, modules)
        self._measure_floor()
        self._start_counting()
        self._closed = False
        log.info("%s", self.plan.describe())

    def _build_pools(self) -> None:
        """The buffer pools, each held to its budget (runtime/memory.py)."""
        budgets = self.plan.budgets
        # the device budget less the saved activations' part (Budgets.buffer_bytes)
        self.device_pool = BufferPool(
            "device", budgets.buffer_bytes, lambda n, dt: aligned_empty(n, dt, pin=False)
        )
        self.host_pool = BufferPool("host", budgets.host_bytes, lambda n, dt: aligned_empty(n, dt),
                                    poison=self.device.accel.poisons_host_reuse)  # fmt: skip
        if self.device.copies:
            self.device.budget_bytes = budgets.buffer_bytes
        # the stand-in's capacity, unless set: the device budget where it counts everything the
        # device holds (with the activations' part; without, activations are not bounded)
        self.device.accel.set_capacity(budgets.device_bytes if budgets.activation_bytes is not None else None)
        # a speculative plan's budgets hold a speculating step; a step that defers (it clips)
        # is paced to what the plan's deferred walk holds (runtime/memory.py, the pace Note)
        self.deferred_pace = walk_peaks(self.plan, self.schedule, "base") if self.plan.speculative else None

    def _build_units(self, layouts) -> None:
        """A Unit per layout (over ranks a ShardedUnit: this rank's shards), its slots in the pools."""
        self.txn = Txn()  # open while a step's updates may run during backward (slots.py, generations)
        unit_cls = functools.partial(ShardedUnit, dp=self.dp) if self.dp is not None else Unit
        self.units = [
            unit_cls(
                lay,
                self.plan,
                self.device,
                self.store,
                device_pool=self.device_pool,
                host_pool=self.host_pool,
                txn=self.txn,
            )  # fmt: skip
            for lay in layouts
        ]

    def _initialize_weights(self, model, modules, init_fn, meta: bool, progress: bool) -> None:
        """The first weights into the store: the model's own, a checkpoint's, or init_fn's (meta)."""
        source = getattr(model, "_offloadpp_source", None)
        if meta and init_fn is None:
            init_fn = default_init_fn(model)
        prefix = getattr(model, "base_model_prefix", "")
        with torch.no_grad():
            if self.dp is not None:
                missing = initialize_sharded_units(self.units, modules, init_fn, meta, source, prefix, self.dp)  # fmt: skip
            else:
                missing = initialize_units(self.units, modules, init_fn, meta, progress, source, prefix=prefix)  # fmt: skip
        if missing:
            log.warning("offloadpp: %d parameters were not in %s and were initialised: %s", len(missing),
                        source.folder, ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))  # fmt: skip
        self.store.wait_all()

    def _build_step(self, model, modules) -> None:
        """What runs a step: the optimizer pipeline, the executor's hooks (given the pipeline),
        the activation manager's, the exporter's, the fp16 loss scaler."""
        s, dev = self.settings, self.device
        pipeline = functools.partial(ShardedOptimizerPipeline, dp=self.dp) if self.dp else OptimizerPipeline
        self.optimizer = pipeline(
            self.units, self.schedule, self.plan, self.hypers, self.store, self.host_pool, dev
        )
        self.host_pool.reclaim = self.device_pool.reclaim = self.optimizer.reclaim  # (memory.py's Note)
        if not dev.copies:  # autograd's gradients are the device's memory (optimizer._charge_grads)
            self.optimizer.grad_pool = self.device_pool
        self.executor = Executor(self.schedule, self.units, self.optimizer)
        self.executor.install(modules)
        self.activations = ActivationManager(  # after the executor's hooks: they bind weights first
            [(u.name, [modules[q] for q in u.layout.unit.modules]) for u in self.units],
            s.activations.model_copy(update={"budget_bytes": self.plan.budgets.activation_bytes}),
            store=self.store.tagged("activations"),
            device=dev.accel,
            policies=self.plan.activations or ("keep",) * len(self.units),  # (): the plan keeps them all
            model=model,
            params=self.executor,
        )
        self.activations.install()
        self.activations.on_head_backward = self.executor.backward_reaches  # (the fused head's backward)
        self.exporter = Exporter(self.units, self._quiesce)
        self.exporter.install(model, modules)
        self.loss_scaler = LossScaler(s.loss_scaling) if s.compute_dtype == "fp16" else None

    def _measure_floor(self) -> None:
        """The SSD's rates (and the ranks' link) for each step's floor: as configured, else measured."""
        c = self.config
        if c.ssd_read_gbps and c.ssd_write_gbps:
            self.ssd_read_gbps, self.ssd_write_gbps = c.ssd_read_gbps, c.ssd_write_gbps
        else:
            r, w = measure_ssd(self.store)
            self.ssd_read_gbps, self.ssd_write_gbps = c.ssd_read_gbps or r, c.ssd_write_gbps or w
        # the ranks' link, for the floor: as configured, else measured now (every rank at once)
        self.link_gbps = (
            (self.settings.collective_gbps or self.dp.measure_gbps()) if self.dp is not None else None
        )

    def _start_counting(self) -> None:
        """The step's counters and the state of the accumulation window, at the first step."""
        self.global_step = 0  # optimizer steps taken (skipped fp16 steps do not count)
        self.micro_in_window = 0
        self._boundary_override: Optional[bool] = None  # set_boundary, for the current micro-batch
        self._micro: Optional[str] = None  # how far the current micro-batch got: "forward", "backward"
        self.speculation = SpeculationPolicy(
            self.settings.speculate, self.plan.speculative, self.plan.clipping
        )
        self.accounting = StepAccounting(self)  # (the parts it reads exist now)
        self.transaction = StepTransaction(self)
        self._windows = WindowRunner(self)

    # ---- training ---------------------------------------------------------------------------
    def _boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return self.micro_in_window + 1 >= self.settings.gradient_accumulation_steps

    def set_boundary(self, boundary: Optional[bool]) -> None:
        """Whether the current micro-batch ends the accumulation window, decided by the caller
        rather than by counting `gradient_accumulation_steps` micro-batches (None: count). Holds
        until the next step(); call it before backward.

        Note: why it exists. Trainer and Accelerate end a window where they decide, e.g. a
        shorter last window at the end of an epoch (DeepSpeed's set_gradient_accumulation_boundary).
        The forward of the micro-batch already started reading optimizer state for the boundary
        it expected; the pipeline adjusts (optimizer.set_boundary).
        """
        if boundary is not None and not isinstance(boundary, bool):
            raise TypeError(f"set_boundary: expected True, False or None, got {boundary!r}")
        self._check_open()
        if boundary is False and not self.plan.persistent_grads:
            raise ValueError(
                "set_boundary(False): this run keeps no gradients between micro-batches "
                "(gradient_accumulation_steps is 1); set gradient_accumulation_steps to the micro-batches "
                "of one step"
            )
        if self._micro == "backward":
            raise RuntimeError("set_boundary: call it before backward (this micro-batch's backward has run)")
        self._boundary_override = boundary
        if self._micro == "forward":
            self.optimizer.set_boundary(self._boundary())

    def __call__(self, *args, **kwargs):
        return self._forward(lambda: self.module(*args, **kwargs))

    forward = __call__

    def _forward(self, run: Callable[[], Any]):
        """A forward: one micro-batch's (`run` calls the model), or a vertical window's (runs G)."""
        self._check_open()
        t0 = time.perf_counter()
        if self.accounting.step_t0 is None:
            self.accounting.step_t0 = t0
        try:
            if torch.is_grad_enabled():
                first = self.micro_in_window == 0
                if first:
                    self.transaction.begin_window()
                self.optimizer.begin_micro(first=first, boundary=self._boundary(), speculate=self.txn.active,
                                           grad_scale=self._loss_scale())  # fmt: skip
                self._micro = "forward"
            self.executor.start_forward()
            with record_function("offloadpp::forward"), self.activations.forward():  # saved-tensor hooks
                out = run()
        except BaseException:
            self._abort_step()
            raise
        self.accounting.forward_s += time.perf_counter() - t0
        return out

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of `loss` (scaled by 1/gradient_accumulation_steps unless scale_wrt_gas is
        False, and by the fp16 loss scale); units are handed to the optimizer as their gradients
        complete."""
        self._backward([loss], scale_wrt_gas=scale_wrt_gas)

    def _backward(self, losses: list, *, scale_wrt_gas: bool = True) -> None:
        """One backward over `losses` (a vertical window's G: runtime/window.py's Note)."""
        self._check_open()
        t0 = time.perf_counter()
        scale = (
            1.0 / self.settings.gradient_accumulation_steps if scale_wrt_gas else 1.0
        ) * self._loss_scale()
        self._micro = "backward"
        try:
            self.executor.start_backward()
            self.activations.start_backward(stage=len(losses) == 1)  # (not a vertical window's)
            self.optimizer.begin_backward()
            with record_function("offloadpp::backward"):
                torch.autograd.backward([loss * scale if scale != 1.0 else loss for loss in losses])
                for u in self.optimizer.order:  # units some of whose parameters got no gradient
                    if u.phase not in (UnitPhase.GRADS_READY, UnitPhase.UPDATING, UnitPhase.UPDATED):
                        self.optimizer.on_grads(u)
            self.executor.end_backward()
            self.activations.end_backward()
        except BaseException:
            self._abort_step()
            raise
        self.accounting.backward_s += time.perf_counter() - t0

    def train_window(self, batches, *, vertical: Optional[bool] = None, loss_fn=None, forward=None,
                     scale_wrt_gas: bool = True, done=None) -> WindowResult:  # fmt: skip
        """Forward, backward and the optimizer step of one accumulation window of micro-batches
        (each a dict of the model's keyword arguments, or a tuple of its positional ones), run
        vertically (each unit over all micro-batches while its weights are on the device:
        runtime/accumulate.py) where `vertical` says, None: as the plan chose (Plan.vertical,
        Settings.accumulation). forward(batch), if given, computes a micro-batch's output in
        place of the model called on it (it calls the model itself: the Trainer's training step,
        integrations/deepspeed/trainer_window.py); scale_wrt_gas as backward's; done(result),
        if given, is the caller's bookkeeping of the step (its counters, its scheduler), run inside
        the step's end, where a Ctrl-C is held until both are complete. Between windows. Returns
        each micro-batch's loss and the step's report; anything that raises before the step
        completed rolls the window back."""
        return self._windows.train(batches, vertical=vertical, loss_fn=loss_fn, forward=forward,
                                   scale_wrt_gas=scale_wrt_gas, done=done)  # fmt: skip

    def eval_window(self, batches, *, vertical: Optional[bool] = None) -> list:
        """The model's outputs for each batch, forward only (no gradients), vertically as
        train_window."""
        return self._windows.evaluate(batches, vertical=vertical)

    def step(self) -> Optional[StepReport]:
        """Waits for the optimizer. On an accumulation boundary returns the StepReport."""
        self._check_open()
        t0 = time.perf_counter()
        if not self._boundary():
            try:
                self.optimizer.finish()
            except BaseException:
                self._abort_step()
                raise
            # (the micro-batch's state changes with no call between: a Ctrl-C finds it before or after)
            self._boundary_override, self._micro = None, None
            self.micro_in_window += 1
            self.accounting.optimizer_s += time.perf_counter() - t0
            return None
        outcome = None
        scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        # Note: the end of a step is not interruptible where its updates write in place (deferred
        # updates): a Ctrl-C while they run would leave some units updated. It is held until the
        # step is complete and counted, then raised. (A speculating step is a transaction to its end.)
        with holding_interrupts() as interrupted:
            try:
                with record_function("offloadpp::optimizer_wait"):
                    if self.plan.deferred_update:
                        steps = {u.name: w for u, w in zip(self.units, self.transaction.window_steps)}
                        outcome = finish_updates(self.optimizer, scale=scale or 1.0, loss_scaler=self.loss_scaler,
                                                 max_norm=self.settings.gradient_clipping, steps=steps,
                                                 dp=self.dp, lazy=self.optimizer.lazy)  # fmt: skip
                    self.optimizer.finish()
                    self.optimizer.release_grads()
                    self.store.check_writes()  # a write that failed reports its own cause, here
                    check_nvme_paths(self.config.nvme_paths, probe=False)  # still there (not removed)
                    self.transaction.commit()
            except BaseException as e:
                if self.txn.active:
                    self._abort_step()  # nothing committed yet: back to the last completed step
                else:
                    self.transaction.fail(e)  # deferred updates half written: the engine cannot go on
                raise
            self._boundary_override, self._micro = None, None
            self.micro_in_window = 0
            if outcome is None or not outcome.skipped:
                self.global_step += 1
            if outcome is not None and not outcome.skipped:
                self.speculation.record(self.global_step, outcome.clipped)
            exposed = time.perf_counter() - t0  # the updates are done (the heap's trim is not theirs)
            if self._return_heap:
                host_heap.trim()
            self.accounting.optimizer_s += time.perf_counter() - t0
            report = self.accounting.report(self.global_step, outcome, scale, exposed)
        if self.config.log_every and report.step % self.config.log_every == 0:
            log.info("%s", report.summary())
        if interrupted:
            raise interrupted_after_step(self.global_step)
        return report

    @property
    def window_open(self) -> bool:
        """A window is half done: a micro-batch's forward or backward ran, or earlier micro-batches
        of the window completed, and its step has not."""
        return self._micro is not None or self.micro_in_window > 0

    def roll_back(self) -> None:
        """For a caller whose own code around forward, backward and step raised (the DeepSpeed
        engine's, e.g. a Ctrl-C between its forward and the runtime's backward; a window's): the
        open window back to the last completed step, as an error inside them does (_abort_step).
        Called while handling the error; nothing again for an error the engine settled already
        (transaction.settled). Between windows nothing had begun: nothing changes, and a Ctrl-C
        is said to have found the engine at its last step."""
        exc = sys.exc_info()[1]
        if self._closed or self.transaction.failed is not None or settled(exc):
            return
        if not self.window_open:
            if isinstance(exc, KeyboardInterrupt):
                log.warning("offloadpp: interrupted (KeyboardInterrupt) between steps: the engine is at its last "
                            "completed step (%d), as it was; checkpoints on disk are not touched",
                            self.global_step)  # fmt: skip
            settle(exc)
            return
        self._abort_step()

    def _abort_step(self) -> None:
        """The step interrupted: back to the last completed one (StepTransaction.abort), and this
        engine's micro-batch state with it."""
        self.transaction.abort(self.global_step)
        self.micro_in_window = 0
        self._boundary_override = None
        self._micro = None

    def _loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the OffloadEngine was closed")
        failed = self.transaction.failed
        if failed is not None:
            raise RuntimeError(
                f"the OffloadEngine cannot go on after a step failed ({failed}); the last checkpoint is "
                "intact: close this engine and load it into a new one"
            ) from failed

    def close(self) -> None:
        """Waits for all I/O, removes the hooks, frees the buffers, releases the swap
        directories' lock. The model's parameters are left as placeholders (export weights first
        with module.state_dict())."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        closed(self)
        errors = []
        failed = self.transaction.failed
        if failed is None:
            try:
                self.optimizer.complete_pending()  # the last step's updates (runtime/pending.py)
            except BaseException as e:  # noqa: BLE001 - raised below, after everything is released
                errors.append(e)
        errors += self.optimizer.finish_all()
        try:
            self.activations.close()
            self.executor.release_all()
            self.executor.remove()
            self.exporter.remove()
        finally:
            try:
                self._finalizer()
            except BaseException as e:  # noqa: BLE001 - raised below unless a failed step reported it
                errors.append(e)
        if errors and failed is None and not self.transaction.aborted:
            raise errors[0]  # not reported yet: a close() after clean steps must not hide it
        for e in errors:
            log.warning("offloadpp: closing after a failed step: %s", e)

    def __enter__(self) -> OffloadEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _release(optimizer, swapper, device, store, pools, lock, dp=None, remove_swap=None) -> None:
    """Everything an engine holds outside Python's reach: worker threads, queued writes, open
    swap files and the I/O engine's threads, buffers, the swap files themselves (unless
    keep_swap: `remove_swap` None), the lock. Each part is released even if another fails; the
    first error is raised after."""
    first: Optional[BaseException] = None
    removing = () if remove_swap is None else (lambda: remove_swap_files(remove_swap),)
    closers = (
        optimizer.close,
        swapper.close,
        device.close,  # (its streams' queued work runs first)
        store.close,
        *(p.clear for p in pools),
        *removing,
        lock.release,
    )
    for step in closers + ((dp.close,) if dp is not None else ()):
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the rest is released
            first = first or e
    if first is not None:
        raise first
