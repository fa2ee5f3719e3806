"""OffloadppEngine: DeepSpeedEngine's surface over offloadpp's runtime.

It is a DeepSpeedEngine (a subclass, so `isinstance` checks in Accelerate, Trainer and user code
hold, and `accelerator.unwrap_model` finds the model) and an nn.Module holding the model as
`module` (so `parameters()`, `state_dict()`, `train()`/`eval()` and attribute pass-through to the
model behave as DeepSpeed's). DeepSpeed's own `__init__` never runs: every public method of
DeepSpeedEngine is either written here (PipelineEngine's whole-window API in pipeline_api.py),
inherited because it only reads the parsed config (`surface.INHERITED`), or replaced by one
that raises naming what to use instead (`surface.UNSUPPORTED`); tests/test_ds_engine_surface.py
checks that split covers all of them.

The update itself is the runtime's (fused CPU Adam during backward). Each param group's
hyper-parameters are read from `optimizer.param_groups` before every backward, so any scheduler
(DeepSpeed's, Trainer's, one passed as lr_scheduler) takes effect at the next step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any, Optional

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

import offloadpp.integrations.deepspeed.surface as surface
from offloadpp.integrations.deepspeed.checkpoint import save_engine_checkpoint
from offloadpp.integrations.deepspeed.ds_import import load_checkpoint
from offloadpp.integrations.deepspeed.monitor import StepEvents
from offloadpp.integrations.deepspeed.optimizer import OffloadppOptimizer
from offloadpp.integrations.deepspeed.pipeline_api import PipelineWindows, cast_floats
from offloadpp.runtime.transaction import holding_interrupts, interrupted_after_step

logger = logging.getLogger("offloadpp")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class OffloadppEngine(PipelineWindows, DeepSpeedEngine):
    def __init__(self, runtime, config: dict, ds_config, optimizer: OffloadppOptimizer, *, groups: dict,
                 lr_scheduler=None, training_dataloader=None, collate_fn=None):  # fmt: skip
        torch.nn.Module.__init__(self)
        self._modules["module"] = runtime.module  # nn.Module's methods see the model as a child
        self.__dict__["module"] = runtime.module
        self.runtime = runtime
        self.config = config  # the config dict, as DeepSpeedEngine.config (Trainer reads it)
        self._config = ds_config  # DeepSpeed's parsed DeepSpeedConfig: the inherited getters read it
        self.optimizer = self.basic_optimizer = optimizer
        self.client_optimizer = optimizer.client  # the caller's own optimizer, if it gave one
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.collate_fn = collate_fn
        self._groups = groups  # parameter name -> param group index, fixed at initialize
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.last_report = None
        self.reports: list = []  # StepReports of this process, newest last
        self.last_window = None  # the last train_batch's WindowResult (runtime/accumulate.py)
        self.windows_vertical: list[
            bool
        ] = []  # whether each whole window (train_batch, the Trainer's) ran vertically
        self._capture = None  # a window of micro-batch steps running (trainer_window.run_window)
        self._step_applied = False
        self._boundary_flag: Optional[bool] = None  # set_gradient_accumulation_boundary
        self._pending: Optional[bool] = None  # a backward without its step(): was it a boundary?
        # DeepSpeed's MonitorMaster, as DeepSpeedEngine.monitor (scripts write their own events
        # through it too); StepEvents feeds it what DeepSpeedEngine writes, and our reports (monitor.py)
        self.attach_monitor(None)  # (initialize attaches the config's: build.py)
        self._gc_generation = None
        if ds_config.disable_python_gc:
            from deepspeed.runtime.python_gc import python_gc_manager

            self._gc_generation = python_gc_manager.acquire()
        self._push_hypers()

    def attach_monitor(self, monitor) -> None:
        """DeepSpeed's MonitorMaster (None: no monitor), as DeepSpeedEngine.monitor; StepEvents
        feeds it what DeepSpeedEngine writes each step, and our reports (monitor.py)."""
        self.monitor = monitor
        self._events = StepEvents(
            monitor, rank=self.global_rank, world=self.world_size, fp16=self._config.float16_config.enabled,
            wall_clock=bool(self._config.wall_clock_breakdown),
            sum_over_ranks=self.runtime.dp.sum if self.runtime.dp is not None else None,
        )  # fmt: skip

    # ---- where it runs -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.runtime.device.torch_device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return self.runtime.dp.rank if self.runtime.dp is not None else 0

    @property
    def world_size(self) -> int:
        """Ranks training together, every one data-parallel (no model or sequence parallelism)."""
        return self.runtime.dp.world if self.runtime.dp is not None else 1

    dp_world_size = seq_dp_world_size = world_size
    mp_world_size = 1

    @property
    def is_compiled(self) -> bool:
        return False

    # ---- DeepSpeedEngine's training API -------------------------------------------------
    @property
    def _micro_in_window(self) -> int:
        """Micro-batches of the open window whose step completed: the runtime's count, which a
        rolled-back window resets (one count, so the two never disagree on the next boundary)."""
        return self.runtime.micro_in_window

    @contextlib.contextmanager
    def _window_rolled_back_on_error(self):
        """Whatever raises inside, the runtime's forward, backward or step or this engine's own
        work around them (a Ctrl-C while it pushes the hypers or feeds the monitors), rolls the
        open window back to the last completed step (runtime/transaction.py, abort: the runtime
        has done it already for its own calls, else roll_back does it now), and this engine's
        half of the window goes too: the pending micro-batch and the losses the monitors had
        from it, so that the next window's train_loss is its own (as DeepSpeed's PipelineEngine
        starts each train_batch's loss afresh)."""
        try:
            yield
        except BaseException:
            self.runtime.roll_back()
            self._pending = None
            self._events.discard()
            raise

    def forward(self, *inputs, **kwargs):
        if self._capture is not None:  # a micro-batch of a window: the window's forward runs it
            inputs, kwargs = self._autocast((inputs, kwargs))
            return self.runtime.module(*inputs, **kwargs)
        self._check_stepped()
        with self._window_rolled_back_on_error():
            self._finish_micro()
            inputs, kwargs = self._autocast((inputs, kwargs))
            return self.runtime(*inputs, **kwargs)

    def _autocast(self, obj):
        """`obj`'s floating tensors in fp16 where the config's fp16 block says auto_cast."""
        if self._config.float16_config.enabled and self._config.float16_config.auto_cast:
            return cast_floats(obj, torch.float16)
        return obj

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of one micro-batch. Like DeepSpeed, the loss is divided by the gradient
        accumulation steps unless scale_wrt_gas is False (Trainer scales it itself); returns
        the loss that was passed. Misuse is refused before anything changes; any other error
        rolls the window back (_window_rolled_back_on_error)."""
        if retain_graph:
            raise NotImplementedError(
                "retain_graph: offloadpp releases each unit's weights after its backward; run a new forward instead"
            )
        if self._capture is not None:  # a micro-batch of a window: its loss, for the window's backward
            self._capture.took(loss, scale_wrt_gas)
            return loss
        self._check_stepped()
        with self._window_rolled_back_on_error():
            self._finish_micro()
            self._push_hypers()
            boundary = self.is_gradient_accumulation_boundary()
            self.runtime.set_boundary(boundary)
            self.runtime.backward(loss, scale_wrt_gas=scale_wrt_gas)
            self._events.backward(loss, 1.0 / self.gradient_accumulation_steps() if scale_wrt_gas else 1.0)
            self._pending = boundary
        return loss

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """The next backward ends the accumulation window (True) or not (False), whatever the
        count says; Accelerate calls this before each backward."""
        self._boundary_flag = is_boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_flag is not None:
            return bool(self._boundary_flag)
        return self._micro_in_window + 1 >= self.gradient_accumulation_steps()

    def step(self, lr_kwargs: Optional[dict] = None):
        """Completes the micro-batch whose backward ran. On an accumulation boundary: waits for
        the optimizer (whose updates ran during backward), steps the LR scheduler unless fp16
        skipped the step, advances the counters. Call it after every backward, as with DeepSpeed
        (Accelerate calls it only on boundaries: the other micro-batches complete by themselves).
        A Ctrl-C in the step's end is held until the counters and the scheduler have stepped too
        (runtime/transaction.py's holding_interrupts), then raised."""
        with self._window_rolled_back_on_error(), holding_interrupts() as interrupted:
            self._step(lr_kwargs)
        if interrupted:
            raise interrupted_after_step(self.global_steps)

    def _step(self, lr_kwargs: Optional[dict]) -> None:
        if self._pending is None or self._capture is not None:
            return
        boundary = self._pending
        report = self._complete_micro()
        if boundary:
            self._stepped(report, lr_kwargs)

    def _stepped(self, report, lr_kwargs: Optional[dict]) -> None:
        """An optimizer step ended (its StepReport): counters, the LR scheduler, the log."""
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.last_report = report
        self.reports.append(report)
        skipped = bool(report.skipped)
        self.optimizer.overflow = skipped
        self._step_applied = not skipped
        self.skipped_steps += int(skipped)
        if self.lr_scheduler is not None and not skipped:
            # The update ran inside the engine, not through optimizer.step(): tell torch's
            # schedulers it happened (their order check looks for this mark).
            for opt in (self.optimizer, self.client_optimizer, getattr(self.lr_scheduler, "optimizer", None)):
                if opt is not None:
                    opt._opt_called = True
            self.lr_scheduler.step(**(lr_kwargs or {}))
        if self._events.enabled:  # after the scheduler, as DeepSpeedEngine.step writes them
            scaler = self.runtime.loss_scaler
            self._events.write(samples=self.global_samples, lr=self.get_lr()[0], report=report,
                               loss_scale=scaler.scale if scaler is not None else None)  # fmt: skip
        spp = self.steps_per_print()
        if spp and math.isfinite(spp) and self.global_steps % spp == 0:
            logger.info("offloadpp step %d lr=%s %s", self.global_steps, self.get_lr(), report.summary())

    def _complete_micro(self):
        with self._window_rolled_back_on_error():
            report = self.runtime.step()
            self._pending = None
            self.micro_steps += 1
        return report

    def _check_stepped(self) -> None:
        """A backward that ended the accumulation window must be followed by step()."""
        if self._pending:
            raise RuntimeError(
                "engine.step() was not called after the backward that ended the accumulation window; call "
                "engine.step() after every engine.backward(loss)"
            )

    def _finish_micro(self) -> None:
        """Before a new forward or backward: a micro-batch whose backward ran without step() is
        completed here if it did not end the window (Accelerate's way); a boundary must be."""
        self._check_stepped()
        if self._pending is not None:
            self._complete_micro()

    def was_step_applied(self) -> bool:
        return self._step_applied

    @contextlib.contextmanager
    def no_sync(self):
        """Nothing to hold back: gradients are reduced over the ranks only at the end of the
        window anyway, which is gradient_accumulation_steps (or set_gradient_accumulation_boundary)."""
        yield

    coalesce_grad_reduction = no_sync

    def zero_grad(self, set_to_none: bool = True):
        return None  # gradients leave the parameters as backward produces them

    def train(self, mode: bool = True):
        self.training = mode
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def to(self, *args, **kwargs):
        """No move: the engine places the weights itself. Accepted when it names the engine's
        device and no dtype (a no-op, returning the engine); refused otherwise."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None or (device is not None and torch.device(device) != self.device):
            raise NotImplementedError(
                f"engine.to({args}, {kwargs}): offloadpp places the weights on {self.device} itself and computes in "
                f"{self.runtime.settings.compute_dtype}; set the dtype with the config's fp16/bf16 blocks"
            )
        return self

    # ---- config getters and state the scripts read -----------------------------------------
    def _push_hypers(self) -> None:
        self.runtime.set_hypers(self.optimizer.hypers(), self._groups)
        self._groups = None  # assigned once; later calls only change the values

    def optimizer_name(self) -> Optional[str]:
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        return self._config.optimizer_name

    def _optimizer_param(self, key: str) -> list:
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    def get_lr(self) -> list:
        return self._optimizer_param("lr")

    def get_type(self) -> list:
        return self._optimizer_param("type")

    def get_mom(self) -> list:
        return self._optimizer_param("betas")

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last step, before clipping (computed when clipping or fp16
        needs it; None otherwise)."""
        return None if self.last_report is None else self.last_report.grad_norm

    def get_data_types(self):
        return _DTYPES[self.runtime.settings.compute_dtype], torch.float32

    def get_data_parallel_rank(self) -> int:
        return self.global_rank

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_parallel_rank = get_model_parallel_rank

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return True  # the weights are always exportable, unit by unit

    def zero_nvme_offload_optimizer(self) -> bool:
        return self.runtime.settings.offload_optimizer

    def empty_partition_cache(self) -> None:
        """Nothing to empty: between steps the engine holds only what its plan's budgets allow."""
        return None

    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):  # fmt: skip
        from torch.utils.data import DataLoader, DistributedSampler

        # each rank its part of the data, as DeepSpeed's own deepspeed_io
        sampler = data_sampler or DistributedSampler(
            dataset, num_replicas=self.world_size, rank=self.global_rank
        )
        return DataLoader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            sampler=sampler,
            collate_fn=collate_fn or self.collate_fn,
            pin_memory=pin_memory and self.device.type == "cuda",
            num_workers=num_local_io_workers or 0,
            drop_last=self.dataloader_drop_last(),
        )

    def collect_python_gc(self):
        """Runs Python's cyclic GC now (with disable_python_gc, at a point the script picks)."""
        from deepspeed.runtime.python_gc import python_gc_manager

        return python_gc_manager.collect()

    def peak_device_bytes(self) -> int:
        return self.runtime.peak_device_bytes()

    # ---- weights, checkpoints and export ----------------------------------------------------
    def module_state_dict(
        self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False
    ):
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters(prefix=prefix.rstrip(".")):
                if not p.requires_grad:
                    sd.pop(name, None)
        return sd

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The whole model's weights in the compute precision (fp32 when training in fp32) on
        the CPU, as Accelerate's get_state_dict asks for them, fetched unit by unit; refused
        (WeightsDoNotFitError, naming the streaming calls) where they do not fit in memory."""
        from offloadpp.integrations.deepspeed.export import consolidated_state_dict

        return consolidated_state_dict(
            self, _DTYPES[self.runtime.settings.compute_dtype], exclude_frozen_parameters
        )

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        """The current weights in the compute precision, as `from_pretrained` loads them,
        streamed unit by unit: safetensors when the name ends in .safetensors, else torch.save's
        format; sharded with an index when large (export.py). Tied weights are stored once."""
        from offloadpp.integrations.deepspeed.export import save_weights

        save_weights(self, save_dir, save_filename, exclude_frozen_parameters)
        return True

    save_fp16_model = save_16bit_model

    def save_merged(self, save_dir: str, safe_serialization: bool = True) -> bool:
        """A peft LoRA model's base with its adapters merged, as the base model's own folder,
        streamed unit by unit (export.save_merged; docs/frozen.md)."""
        from offloadpp.integrations.deepspeed.export import save_merged

        save_merged(self, save_dir, safe_serialization)
        return True

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        """A crash-consistent checkpoint (checkpoint.py). Its arrays are whole units, so frozen
        parameters are in it even with exclude_frozen_parameters (they do not change in training;
        loading restores them)."""
        tag = tag or f"global_step{self.global_steps}"
        stage = "before"
        try:
            self._finish_micro()
            t0 = time.perf_counter()
            stage = "saving"  # (an interrupt in there is told by checkpoint.py, with what it left)
            save_engine_checkpoint(self, save_dir, str(tag), client_state or {}, save_latest)
            stage = "saved"
            logger.info("offloadpp: saved checkpoint %s in %.1fs", os.path.join(save_dir, str(tag)),
                        time.perf_counter() - t0)  # fmt: skip
            return True
        except KeyboardInterrupt:
            # A Ctrl-C just before or just after the save must say as clearly as one inside it
            # which checkpoint is the newest whole one.
            if stage == "saved":
                logger.warning("offloadpp: interrupted (KeyboardInterrupt) after checkpoint %r was saved "
                               "whole: it loads as it is", str(tag))  # fmt: skip
            elif stage == "before":
                logger.warning("offloadpp: interrupted (KeyboardInterrupt) before checkpoint %r was begun: "
                               "the checkpoints in %r are as they were", str(tag), save_dir)  # fmt: skip
            raise

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None) -> tuple[Optional[str], Any]:  # fmt: skip
        """Loads a checkpoint save_checkpoint wrote (the weights only with load_module_only or
        load_optimizer_states=False). It must be this model's: load_module_strict=False does not
        relax the check of its units and parameters (a mismatch is named). A DeepSpeed ZeRO-3
        checkpoint folder, or a universal one with `checkpoint.load_universal`, is moved over
        (ds_import.py: master weights, moments, steps, scheduler)."""
        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...): offloadpp loads its own checkpoint format"
            )
        # (checkpoint.py completes a half-done window and pushes the restored hyper-parameters
        # only once it has a checkpoint to load: one that finds none changes nothing, as DeepSpeed)
        return load_checkpoint(
            self, load_dir, tag, load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
        )  # fmt: skip

    def _push_lr(self) -> None:  # checkpoint.py restores the groups' values, then asks for this
        self._push_hypers()

    def destroy(self) -> None:
        """Gives the model its weights back as ordinary tensors (the current ones), then closes
        the runtime; the model can then be trained again, e.g. by a new engine (Accelerate's
        free_memory calls this)."""
        if self.runtime._closed:
            return
        self._finish_micro()
        values = self.module.state_dict()
        params = dict(self.module.named_parameters(remove_duplicate=False))
        self.close()
        with torch.no_grad():
            for name, p in params.items():
                if name in values:
                    p.data = values[name]

    def save_pretrained(self, save_dir: str, safe_serialization: bool = True) -> bool:
        """A Hugging Face model folder (weights, config.json) from_pretrained loads, streamed."""
        from offloadpp.integrations.deepspeed.export import save_pretrained

        save_pretrained(self, save_dir, safe_serialization)
        return True

    def close(self) -> None:
        """Waits for the I/O and frees the runtime's buffers; the model's parameters are left as
        placeholders (destroy() gives them their values back)."""
        if self._gc_generation is not None:
            from deepspeed.runtime.python_gc import python_gc_manager

            python_gc_manager.release(self._gc_generation)
            self._gc_generation = None
        self.runtime.close()

    def __del__(self):
        """Dropped while its model lives on (a Trainer going out of scope): the model gets its
        weights back, as destroy() does, where they fit in half the available memory; a model
        larger than that keeps placeholders (save_16bit_model first), and a warning says so."""
        try:
            if "runtime" not in self.__dict__ or self.runtime._closed:
                return
            import psutil

            seen, nbytes = set(), 0
            for p in self.module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    nbytes += p.numel() * p.element_size()
            if nbytes < psutil.virtual_memory().available // 2:
                self.destroy()
            else:
                logger.warning(
                    "offloadpp: the engine was dropped; the model's %.1f GB of weights do not fit in memory, so its "
                    "parameters stay empty placeholders (export with save_16bit_model before dropping the engine)",
                    nbytes / 1e9,
                )
                self.close()
        except Exception:  # interpreter shutdown: the runtime's own cleanup may be gone already
            pass


surface.complete(OffloadppEngine)
