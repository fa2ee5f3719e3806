"""The Hugging Face Trainer's accumulation window run whole on an offloadpp engine, unchanged.

Note: how the Trainer's window reaches the engine. The Trainer (transformers 5) fetches each
window's micro-batches up front (`Trainer.get_batch_samples`), then calls `training_step(model,
inputs, num_items_in_batch)` for each: forward through the engine, the loss as `compute_loss`
makes it (label smoothing, `compute_loss_func`, `num_items_in_batch`, its own division by the
window's length), `accelerator.backward(loss)` (engine.backward with scale_wrt_gas=False, then
engine.step() on the window's last micro-batch), the detached loss returned. Run as it stands
that is a per-micro-batch loop, horizontal. `patch_deepspeed()` (and so `python -m offloadpp
run`) wraps two methods of `transformers.Trainer`:

- `get_batch_samples` notes the window it returns, where the model is an offloadpp engine whose
  plan runs windows vertically (Plan.vertical) and the window has more than one micro-batch;
- `training_step`, called with the window's first micro-batch, runs the whole window at once
  (`run_window`): each micro-batch is the Trainer's own `training_step` (the original: its
  loss is exactly the one a per-micro-batch loop computes), run by the window as its forward,
  vertically where the RNG tapes allow (runtime/accumulate.py), with engine.forward running the
  model as the window's, engine.backward handing over the micro-batch's loss for the window's
  one backward and engine.step doing nothing. The step, its gradient norm and the scheduler
  follow as at the end of any window. The calls for the window's other micro-batches then
  return their losses without running anything.

What the Trainer reads after the window is as after a per-micro-batch loop: its clipping asks
the engine's global norm (the window's), `optimizer_step_was_skipped` the fp16 outcome, and the
scheduler has stepped once. Where anything differs (a subclass whose training_step or
get_batch_samples does not call the base one, inputs that are not the noted window's, extra
arguments), the original runs: the window is horizontal, as before. A subclass whose
training_step does call the base one gets the window at its first call: what it adds around the
call runs around each micro-batch's returned loss, not inside the window. Callbacks between the
micro-batches (`on_substep_end`) run after the whole window has.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class _Capture:
    """The loss a micro-batch step handed to engine.backward, until the window takes it."""

    def __init__(self) -> None:
        self.loss: Optional[torch.Tensor] = None
        self.scale_wrt_gas: Optional[bool] = None

    def took(self, loss: torch.Tensor, scale_wrt_gas: bool) -> None:
        if self.loss is not None:
            raise RuntimeError("run_window: a micro-batch step called engine.backward twice")
        if self.scale_wrt_gas is not None and scale_wrt_gas != self.scale_wrt_gas:
            raise ValueError(
                f"run_window: the micro-batch steps disagree on backward's scale_wrt_gas "
                f"({self.scale_wrt_gas} then {scale_wrt_gas})"
            )
        self.loss, self.scale_wrt_gas = loss, scale_wrt_gas

    def take(self) -> torch.Tensor:
        loss, self.loss = self.loss, None
        if loss is None:
            raise RuntimeError("run_window: a micro-batch step ran no engine.backward(loss)")
        return loss


def run_window(engine, batches: list, micro_step: Callable[[Any], Any]):
    """One accumulation window on an OffloadppEngine whose micro-batches `micro_step(batch)` trains
    as a per-micro-batch loop would (forward through the engine, engine.backward(loss), maybe
    engine.step()), run whole: vertically where the plan says (the Note). Returns the runtime's
    WindowResult (each micro-batch's loss as passed to backward, detached)."""
    if engine._pending is not None or engine._micro_in_window:
        raise RuntimeError(
            "run_window: a window of engine.forward/backward/step micro-batches is half done; finish it "
            "(engine.step() after its last backward) first"
        )
    cap = _Capture()

    def forward(batch):
        micro_step(batch)
        return cap.take()

    flag = engine._boundary_flag
    engine._capture = cap
    try:
        with engine._window_rolled_back_on_error():  # (a window that raised leaves the monitors nothing)
            engine._push_hypers()
            return engine.runtime.train_window(
                batches, forward=forward, scale_wrt_gas=lambda: cap.scale_wrt_gas is not False,
                done=engine._window_done,
            )  # fmt: skip
    finally:
        engine._capture = None
        engine._boundary_flag = flag


class _Window:
    """A Trainer's window of micro-batches as get_batch_samples returned it."""

    def __init__(self, batches: list, num_items) -> None:
        self.batches = batches
        self.num_items = num_items
        self.losses: Optional[tuple] = None  # once run

    def index(self, inputs) -> Optional[int]:
        return next((m for m, b in enumerate(self.batches) if b is inputs), None)


def _engine(model):
    from offloadpp.integrations.deepspeed.engine import OffloadppEngine

    return model if isinstance(model, OffloadppEngine) else None


def _get_batch_samples(original: Callable) -> Callable:
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = original(self, epoch_iterator, num_batches, device)
        engine = _engine(getattr(self, "model_wrapped", None))
        vertical = engine is not None and engine.runtime.plan.vertical and len(batches) > 1
        self.__dict__["_offloadpp_window"] = _Window(batches, num_items) if vertical else None
        return batches, num_items

    get_batch_samples.__offloadpp__ = True
    return get_batch_samples


def _training_step(original: Callable) -> Callable:
    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        w = self.__dict__.get("_offloadpp_window")
        engine = _engine(model)
        m = w.index(inputs) if w is not None and engine is not None and not args and not kwargs else None
        if m is None or (w.losses is None and m != 0):
            return original(self, model, inputs, num_items_in_batch, *args, **kwargs)
        if w.losses is None:

            def step(batch):
                return original(self, model, batch, w.num_items)

            w.losses = run_window(engine, w.batches, step).losses
        return w.losses[m]

    training_step.__offloadpp__ = True
    return training_step


def patch(saved: dict) -> None:
    """Wraps Trainer.get_batch_samples and Trainer.training_step (the Note), keeping the
    originals in `saved` (patch.py's)."""
    try:
        import transformers
    except ImportError:
        return
    for name, make in (("get_batch_samples", _get_batch_samples), ("training_step", _training_step)):
        original = transformers.Trainer.__dict__[name]
        saved[f"window:Trainer.{name}"] = original
        setattr(transformers.Trainer, name, make(original))


def unpatch(saved: dict) -> None:
    keys = [k for k in saved if k.startswith("window:")]
    if keys:
        import transformers

        for key in keys:
            setattr(transformers.Trainer, key.split(".", 1)[1], saved.pop(key))
