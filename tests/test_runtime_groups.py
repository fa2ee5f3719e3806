"""The runtime's optimizer side as torch.optim sees it: per-param-group hyper-parameters
(lr, weight decay, betas, eps, changed between steps as schedulers do), a loss already scaled by
the caller (scale_wrt_gas=False), and accumulation windows ended by the caller (set_boundary,
what Trainer and Accelerate do at the end of an epoch). Each against torch AdamW in memory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from numerics import compare_weights
from test_runtime import VOCAB, batches, streaming_config, tiny_gpt2

from offloadpp.assemble import assemble_engine
from offloadpp.optim import AdamHyper

LR = 1e-3


def two_groups(model):
    """Trainer's split: weight decay on matrices, none on biases and LayerNorm weights."""
    decay = [n for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [n for n, p in model.named_parameters() if p.ndim < 2]
    return decay, no_decay


def hyper_of(group: dict) -> AdamHyper:
    b1, b2 = group["betas"]
    return AdamHyper(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"])


def push(eng, opt, index_of: dict) -> None:
    eng.set_hypers([hyper_of(g) for g in opt.param_groups], index_of)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_each_group_takes_its_own_hyper_parameters_as_they_change(tmp_path, clip):
    ref = tiny_gpt2()
    eng = assemble_engine(copy.deepcopy(ref), streaming_config(tmp_path, gradient_clipping=clip))
    decay, no_decay = two_groups(ref)
    params = dict(ref.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [params[n] for n in decay], "weight_decay": 0.1},
            {"params": [params[n] for n in no_decay], "weight_decay": 0.0, "lr": 3e-3, "eps": 1e-6},
        ],
        lr=LR,
        betas=(0.9, 0.99),
    )
    index_of = {n: 0 for n in decay} | {n: 1 for n in no_decay}
    data = batches(6)
    for step, x in enumerate(data):
        # what schedulers do between steps: lr warm-up on every group, OneCycle's momentum cycling
        for g in opt.param_groups:
            g["lr"] *= 1.0 + 0.5 * step
            g["betas"] = (0.85 + 0.02 * step, g["betas"][1])
        push(eng, opt, index_of if step == 0 else None)
        ref(input_ids=x, labels=x).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
    assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=3e-3 * 3.5, steps=6) < 1e-5
    assert [h.weight_decay for h in eng.hypers] == [0.1, 0.0]
    eng.close()


def test_groups_must_cover_every_trainable_parameter(tmp_path):
    model = tiny_gpt2()
    with assemble_engine(model, streaming_config(tmp_path)) as eng:
        decay, _ = two_groups(model)
        with pytest.raises(ValueError, match="requires grad but is in no param group"):
            eng.set_hypers([AdamHyper()], {n: 0 for n in decay})
        with pytest.raises(ValueError, match="group 3 is not in 0..1"):
            eng.set_hypers([AdamHyper(), AdamHyper()], {n: 3 for n, _ in model.named_parameters()})


def test_caller_scaled_loss_and_caller_ended_windows(tmp_path):
    """gradient_accumulation_steps 3, but the caller scales the loss itself and ends the second
    window after two micro-batches (an epoch of 5 micro-batches, as Trainer does it)."""
    ref = tiny_gpt2()
    eng = assemble_engine(copy.deepcopy(ref), streaming_config(tmp_path, gradient_accumulation_steps=3))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    eng.set_lr(LR)
    eng.set_hypers([AdamHyper(lr=LR, weight_decay=0.01)])
    data = batches(5)
    windows = [data[:3], data[3:]]
    for window in windows:
        for i, x in enumerate(window):
            last = i == len(window) - 1
            (ref(input_ids=x, labels=x).loss / len(window)).backward()
            loss = eng(input_ids=x, labels=x).loss / len(window)
            eng.set_boundary(last)
            eng.backward(loss, scale_wrt_gas=False)
            assert (eng.step() is not None) == last
        opt.step()
        opt.zero_grad()
    assert eng.global_step == 2
    assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=LR, steps=2) < 1e-5
    with pytest.raises(RuntimeError, match="before backward"):
        x = data[0]
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.set_boundary(True)
    eng.close()


def test_a_window_of_one_cannot_be_kept_open(tmp_path):
    with assemble_engine(tiny_gpt2(), streaming_config(tmp_path)) as eng:
        x = torch.randint(0, VOCAB, (2, 8))
        eng(input_ids=x, labels=x)
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            eng.set_boundary(False)
