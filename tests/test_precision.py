"""fp16 loss scaling: offloadpp's LossScaler against the pinned DeepSpeed's DynamicLossScaler on
random overflow sequences (hysteresis, consecutive_hysteresis, growth window, the minimum)."""

from __future__ import annotations

import random

import pytest
import torch

from offloadpp.planner.spec import LossScaling
from offloadpp.runtime.precision import LossScaler

loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")


class _Rank0:
    @staticmethod
    def get_rank() -> int:
        return 0


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("rate", [0.05, 0.3])
def test_scale_follows_deepspeed(monkeypatch, consecutive, hysteresis, rate):
    monkeypatch.setattr(loss_scaler, "dist", _Rank0)  # its log lines ask for the rank
    ds = loss_scaler.DynamicLossScaler(
        init_scale=2**10, scale_window=3, min_scale=1, delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive, dtype=torch.half,
    )  # fmt: skip
    ours = LossScaler(
        LossScaling(
            loss_scale=0,
            initial_scale_power=10,
            loss_scale_window=3,
            hysteresis=hysteresis,
            min_loss_scale=1,
            consecutive_hysteresis=consecutive,
        )
    )
    rng = random.Random(hysteresis * 10 + int(consecutive))
    for i in range(300):
        overflow = rng.random() < rate
        try:
            ds.update_scale(overflow)
        except Exception:  # DeepSpeed stops at the minimum scale with a bare Exception
            with pytest.raises(FloatingPointError, match="minimum loss scale"):
                ours.update(overflow)
            return
        ours.update(overflow)
        assert ours.scale == ds.cur_scale, (i, overflow)
