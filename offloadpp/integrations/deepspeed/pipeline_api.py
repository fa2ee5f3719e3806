"""DeepSpeed's PipelineEngine API on OffloadppEngine (a part of its class, split off by seam):
a whole accumulation window per call, `train_batch` and `eval_batch`, pulled from a data
iterator and run by the runtime as one window (vertically where the plan says:
runtime/accumulate.py). The methods use the engine's state (its runtime, config, monitors,
counters) as its own methods do; OffloadppEngine is the only class that mixes them in."""

from __future__ import annotations

from typing import Optional

import torch

from offloadpp.runtime.accumulate import loss_of


class PipelineWindows:
    """train_batch, eval_batch and their data iterator, mixed into OffloadppEngine."""

    def set_dataiterator(self, iterator) -> None:
        """The iterator train_batch() pulls micro-batches from when it is given none."""
        self.data_iterator = iterator

    def _pull(self, data_iter, count: int) -> list:
        """`count` micro-batches from data_iter (else the one set, else the training data given
        to initialize), on the engine's device, floats cast as forward() casts them."""
        it = data_iter if data_iter is not None else getattr(self, "data_iterator", None)
        if it is None:
            if self.training_dataloader is None:
                raise ValueError(
                    "train_batch/eval_batch: no data_iter given, none set with set_dataiterator, and no "
                    "training_data passed to initialize"
                )
            it = self.data_iterator = iter(self.training_dataloader)
        return self._autocast(_to_device([next(it) for _ in range(count)], self.device))

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """DeepSpeed's PipelineEngine.train_batch: pulls gradient_accumulation_steps micro-batches
        from data_iter (each a dict of the model's keyword arguments or a tuple of its positional
        ones), runs the window and the optimizer step, returns the window's mean loss. The window
        runs vertically (offloadpp/runtime/accumulate.py): each unit's weights are read once for
        forward and once for backward, not once per micro-batch."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if self._pending is not None or self._micro_in_window:
            raise RuntimeError(
                "train_batch: a window of engine.forward/backward/step micro-batches is half done; finish it "
                "(engine.step() after its last backward) first"
            )
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        batches = self._pull(None, self.gradient_accumulation_steps())
        with self._window_rolled_back_on_error():
            self._push_hypers()
            self.runtime.train_window(batches, done=self._window_done)
        return self.agg_train_loss

    def _window_done(self, result) -> None:
        """A whole window ran (its WindowResult): the counters, the scheduler, the monitors; the
        runtime calls it inside the step's end (train_window's done), where Ctrl-C is held."""
        for loss in result.losses:  # the monitors' train_loss: the window's mean, as backward() feeds it
            self._events.backward(loss, 1.0 / len(result.losses))
        self.micro_steps += len(result.losses)
        self._stepped(result.report, None)
        self.last_window = result  # (its per-micro-batch losses, whether it ran vertically)
        self.windows_vertical.append(result.vertical)
        self.agg_train_loss = result.mean_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None):  # fmt: skip
        """DeepSpeed's PipelineEngine.eval_batch: the model in eval mode, forward only, over
        num_micro_batches (default gradient_accumulation_steps) micro-batches from data_iter, run
        vertically; returns the mean loss ('avg'), or the list of losses (reduce_output None),
        and with return_logits also the last micro-batch's output, as DeepSpeed does. (bcast_loss:
        one pipeline stage here, nothing to broadcast.)"""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
        self.module.eval()
        batches = self._pull(data_iter, num_micro_batches or self.gradient_accumulation_steps())
        outs = self.runtime.eval_window(batches)
        result = None
        if compute_loss:
            losses = [loss_of(o, None).detach() for o in outs]
            result = torch.stack([x.float() for x in losses]).mean() if reduce_output == "avg" else losses
        if return_logits:
            last = outs[-1]
            return result, getattr(last, "logits", last)
        return result


def _to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def cast_floats(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj
