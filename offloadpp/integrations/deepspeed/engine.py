"""OffloadppEngine: DeepSpeedEngine's training API over offloadpp's runtime.

User code written for DeepSpeed keeps working: `engine(batch)`, `engine.backward(loss)`,
`engine.step()` after every micro-batch, `train_batch_size()`, `gradient_accumulation_steps()`,
`get_lr()`, `save_checkpoint`/`load_checkpoint`, `save_16bit_model`. The update itself is the
runtime's (fused CPU Adam during backward); the LR schedule is DeepSpeed's own scheduler classes
acting on `OffloadppOptimizer.param_groups`, read back before each optimizer step.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import torch

from offloadpp.integrations.deepspeed.checkpoint import load_engine_checkpoint, save_engine_checkpoint
from offloadpp.integrations.deepspeed.optimizer import OffloadppOptimizer

logger = logging.getLogger("offloadpp")


class OffloadppEngine:
    def __init__(
        self,
        runtime,
        ds_config,
        optimizer: OffloadppOptimizer,
        lr_scheduler=None,
        training_dataloader=None,
    ):
        self.runtime = runtime
        self._config = ds_config  # deepspeed.runtime.config.DeepSpeedConfig
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.last_report = None
        self.reports: list = []  # StepReports of this process, newest last
        self._push_lr()

    # ---- DeepSpeedEngine's training API -------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.runtime.module

    def __call__(self, *args, **kwargs):
        return self.runtime(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of one micro-batch. Like DeepSpeed, the loss is divided by the gradient
        accumulation steps (the runtime does it); returns the loss that was back-propagated."""
        if retain_graph:
            raise NotImplementedError(
                "offloadpp releases unit weights after backward; retain_graph is not supported"
            )
        if not scale_wrt_gas:
            raise NotImplementedError("scale_wrt_gas=False is not supported by offloadpp")
        return self.runtime.backward(loss)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def step(self, lr_kwargs: Optional[dict] = None):
        """Call after every micro-batch; on an accumulation boundary this completes the optimizer
        step (which ran during backward), advances the LR schedule and the step counters."""
        boundary = self.is_gradient_accumulation_boundary()
        report = self.runtime.step()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.data_parallel_world()
        if not boundary:
            return
        self.global_steps += 1
        self.last_report = report
        if report is not None:
            self.reports.append(report)
        skipped = report is not None and getattr(report, "skipped", False)
        if self.lr_scheduler is not None and not skipped:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self._push_lr()
        spp = self.steps_per_print()
        if spp and self.global_steps % spp == 0:
            logger.info("offloadpp step %d lr=%s %s", self.global_steps, self.get_lr(),
                        report.summary() if report is not None else "")  # fmt: skip

    def zero_grad(self):
        return None

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # ---- config getters -----------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def steps_per_print(self) -> int:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def data_parallel_world(self) -> int:
        """Ranks training together (1: a single process)."""
        return self.runtime.dp.world if self.runtime.dp is not None else 1

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return None if self.last_report is None else self.last_report.grad_norm

    def peak_device_bytes(self) -> int:
        return self.runtime.peak_device_bytes()

    def _push_lr(self):
        self.runtime.set_lr(self.optimizer.param_groups[0]["lr"])

    # ---- checkpoints and export ----------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        tag = tag or f"global_step{self.global_steps}"
        t0 = time.perf_counter()
        save_engine_checkpoint(self, save_dir, str(tag), client_state or {}, save_latest)
        logger.info("offloadpp: saved checkpoint %s in %.1fs", os.path.join(save_dir, str(tag)),
                    time.perf_counter() - t0)  # fmt: skip
        return True

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[Optional[str], Any]:  # fmt: skip
        return load_engine_checkpoint(
            self, load_dir, tag, load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
        )  # fmt: skip

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        """Current weights in the compute precision (bf16/fp16; fp32 when training in fp32, as
        DeepSpeed does), as safetensors that `from_pretrained` loads, streamed unit by unit
        (sharded with an index when large); tied weights are stored once."""
        from offloadpp.integrations.deepspeed.export import save_weights

        save_weights(self, save_dir, save_filename, exclude_frozen_parameters)
        return True

    def save_pretrained(self, save_dir: str) -> bool:
        """A Hugging Face model folder (weights, config.json) from_pretrained loads, streamed."""
        from offloadpp.integrations.deepspeed.export import save_pretrained

        save_pretrained(self, save_dir)
        return True

    def close(self):
        self.runtime.close()
