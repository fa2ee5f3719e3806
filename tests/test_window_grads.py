"""A vertical window's gradients summed in fp32 (runtime/window_grads.py), on plain bf16 layers:
each parameter's gradient over the window is the fp32 sum of each micro-batch's own 16-bit
gradient (a tied parameter's uses within a micro-batch summed in 16 bits first, as that
micro-batch's AccumulateGrad sums them), handed over once when its last edge ran."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from offloadpp.runtime.window_grads import GradSums

G = 4


class Counter:
    """Stands for the executor: which parameters' gradients were counted, and what was summed then."""

    def __init__(self) -> None:
        self.summed = frozenset()
        self.done: list = []

    def param_grad_done(self, u) -> None:
        self.done.append({i: t.clone() for i, t in u.summed.items()})


def model():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(16, 8).bfloat16()
    mid = torch.nn.Linear(8, 8).bfloat16()
    return emb, mid


def loss_of(emb, mid, x):
    h = mid(emb(x))
    return (h @ emb.weight.t()).float().square().mean()  # (the output projection tied to emb)


def test_window_gradients_are_the_fp32_sum_of_each_micro_batchs_own():
    emb, mid = model()
    xs = [torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(m)) for m in range(G)]
    params = [emb.weight, mid.weight, mid.bias]
    # each micro-batch's gradient as its own backward makes it (16 bits, ties summed in 16 bits)
    alone = [torch.autograd.grad(loss_of(emb, mid, x), params) for x in xs]
    want = [sum(a[i].float() for a in reversed(alone)) for i in range(len(params))]
    unit = SimpleNamespace(params=[(p, None) for p in params], summed={})
    ex = Counter()
    sums = GradSums(ex, [unit])
    losses = [loss_of(emb, mid, x) for x in xs]
    with sums.summing(losses):
        assert ex.summed == frozenset(map(id, params))
        torch.autograd.backward(losses)
        assert len(ex.done) == len(params) and all(p.grad is None for p in params)
        got = ex.done[-1]
    assert all(torch.equal(got[i], want[i]) for i in range(len(params)))
    assert unit.summed == {} and ex.summed == frozenset()  # (let go after the backward)
    # what it replaces: autograd's own sum over the window, in 16 bits, is not that sum
    torch.autograd.backward([loss_of(emb, mid, x) for x in xs])
    assert (emb.weight.grad.float() - want[0]).abs().max() > 1e-3 * want[0].abs().max()
