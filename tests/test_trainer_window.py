"""run_window (integrations/deepspeed/trainer_window.py): a window whose micro-batches a
per-micro-batch step trains (forward through the engine, engine.backward, engine.step), run
whole on the engine: the same losses and weights as train_batch over the same micro-batches,
vertically from the second window on; a step that hands no loss over is refused. The Trainer's
own route through it is tests/test_hf_trainer.py's."""

from __future__ import annotations

import pytest
import torch
from test_deepspeed_integration import batches, ds_config, tiny_gpt2

import offloadpp
from offloadpp.integrations.deepspeed.trainer_window import run_window

GAS = 4


def engine_for(nvme):
    cfg = ds_config(nvme, gradient_accumulation_steps=GAS, gradient_clipping=1.0,
                    offloadpp={"enabled": True, "accumulation": "vertical"})  # fmt: skip
    engine, *_ = offloadpp.initialize(model=tiny_gpt2(), config=cfg)
    return engine


def test_a_loops_step_run_as_a_window_equals_train_batch(tmp_path):
    data = [{"input_ids": x, "labels": x} for x in batches(2 * GAS)]
    ref = engine_for(tmp_path / "a")
    want = [ref.train_batch(iter(data[w * GAS : (w + 1) * GAS])).item() for w in range(2)]
    want_sd = {k: v.clone() for k, v in ref.module.state_dict().items()}
    ref.close()
    engine = engine_for(tmp_path / "b")

    def step(batch):  # a DeepSpeed loop's body, as a script writes it
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss

    got = []
    for w in range(2):
        r = run_window(engine, data[w * GAS : (w + 1) * GAS], step)
        got.append(r.mean_loss.item())
    assert engine.windows_vertical == [False, True] and engine.global_steps == 2
    assert engine.micro_steps == 2 * GAS and engine.get_global_grad_norm() is not None
    assert got == pytest.approx(want, rel=1e-6)
    for k, v in engine.module.state_dict().items():
        assert torch.allclose(v, want_sd[k], rtol=1e-6, atol=1e-7), k
    with pytest.raises(RuntimeError, match="ran no engine.backward"):
        run_window(engine, data[:GAS], lambda b: engine(**b).loss)
    # (the failed window was dropped: the next one runs)
    assert run_window(engine, data[:GAS], step).report is not None
    engine.close()
