"""fp16 loss scaling with DeepSpeed's semantics (its DynamicLossScaler).

On overflow the step is skipped; the scale is halved once `hysteresis` overflows were seen since
the hysteresis was last restored, never below min_loss_scale; after `loss_scale_window` steps
without overflow it doubles (the window counts the clean steps before the current one, as
DeepSpeed 0.19.8 does). The hysteresis is restored when the scale grows, or, with
`consecutive_hysteresis`, after every clean step. An overflow at the minimum scale is an error, as in DeepSpeed. A static scale
(loss_scale > 0) never changes.
"""

from __future__ import annotations

from offloadpp.planner.spec import LossScaling


class LossScaler:
    def __init__(self, settings: LossScaling):
        """settings: the run's loss scaling (Settings.loss_scaling), read as it is named there."""
        self.settings = settings
        self.dynamic = settings.loss_scale == 0
        self.scale = float(2**settings.initial_scale_power) if self.dynamic else float(settings.loss_scale)
        self.window = settings.loss_scale_window
        self.hysteresis = settings.hysteresis
        self.min_scale = settings.min_loss_scale
        self.consecutive = settings.consecutive_hysteresis
        self._cur_hysteresis = settings.hysteresis
        self._iter = 0
        self._last_overflow = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self._cur_hysteresis == 1:
                if self.scale == self.min_scale:
                    raise FloatingPointError(
                        f"fp16: the gradients overflow at the minimum loss scale {self.min_scale} "
                        "(fp16.min_loss_scale); the loss diverged (DeepSpeed stops here too)"
                    )
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self._cur_hysteresis -= 1
            self._last_overflow = self._iter
        else:
            if self.consecutive:
                self._cur_hysteresis = self.hysteresis
            clean = self._iter - self._last_overflow - 1  # clean steps before this one
            if clean > 0 and clean % self.window == 0:
                if not self.consecutive:
                    self._cur_hysteresis = self.hysteresis
                self.scale *= 2.0
        self._iter += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "cur_hysteresis": self._cur_hysteresis,
            "iter": self._iter,
            "last_overflow": self._last_overflow,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._cur_hysteresis = int(sd["cur_hysteresis"])
        self._iter = int(sd["iter"])
        self._last_overflow = int(sd["last_overflow"])
