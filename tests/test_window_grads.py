"""A vertical window's gradients summed in fp32 (runtime/window_grads.py), on plain bf16 layers:
each parameter's gradient over the window is the fp32 sum of each micro-batch's own 16-bit
gradient (a tied parameter's uses within a micro-batch summed in 16 bits first, as that
micro-batch's AccumulateGrad sums them), kept as they arrive until its last edge ran and summed
once (sum_window)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from offloadpp.runtime.window_grads import GradSums, sum_window

G = 4


class Counter:
    """Stands for the executor: which parameters' gradients were counted, and what was summed then."""

    def __init__(self, copies: bool = False) -> None:
        self.summed = frozenset()
        self.done: list = []
        # (the CPU device, its pool charged by the engine tests; copies: an accelerator)
        self.optimizer = SimpleNamespace(grad_pool=None, device=SimpleNamespace(copies=copies))

    def param_grad_done(self, u) -> None:
        self.done.append({i: [t.clone() for t in parts] for i, parts in u.summed.items()})


def model():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(16, 8).bfloat16()
    mid = torch.nn.Linear(8, 8).bfloat16()
    return emb, mid


def loss_of(emb, mid, x):
    h = mid(emb(x))
    return (h @ emb.weight.t()).float().square().mean()  # (the output projection tied to emb)


@pytest.mark.parametrize("copies", [False, True], ids=["cpu", "accelerator"])
def test_window_gradients_are_the_fp32_sum_of_each_micro_batchs_own(copies):
    emb, mid = model()
    xs = [torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(m)) for m in range(G)]
    params = [emb.weight, mid.weight, mid.bias]
    # each micro-batch's gradient as its own backward makes it (16 bits, ties summed in 16 bits)
    alone = [torch.autograd.grad(loss_of(emb, mid, x), params) for x in xs]
    want = [sum(a[i].float() for a in reversed(alone)) for i in range(len(params))]
    unit = SimpleNamespace(
        params=[(p, None) for p in params], summed={}, grads=SimpleNamespace(dtype=torch.bfloat16)
    )
    ex = Counter(copies)
    sums = GradSums(ex, [unit])
    losses = [loss_of(emb, mid, x) for x in xs]
    with sums.summing(losses):
        assert ex.summed == frozenset(map(id, params))
        torch.autograd.backward(losses)
        assert len(ex.done) == len(params) and all(p.grad is None for p in params)
        kept = ex.done[-1]
    if copies:
        # an accelerator: one fp32 sum, added into as each micro-batch's arrived, rounded to the
        # window's gradient dtype as the parameter's last edge delivered (4 bytes a parameter at
        # most: planner/holds.py visit_grad_bytes), so each count saw those done rounded
        assert [sum(parts[0].dtype == torch.bfloat16 for parts in d.values()) for d in ex.done] == [1, 2, 3]
        assert all(
            len(kept[i]) == 1 and torch.equal(kept[i][0], want[i].bfloat16()) for i in range(len(params))
        )
        assert sum_window([kept[0]], torch.bfloat16)[0] is kept[0][0]  # (taken as it is)
        return
    # the CPU: every micro-batch's own 16-bit gradient kept, in the order backward made them
    assert all(
        len(kept[i]) == G and all(t.dtype == torch.bfloat16 for t in kept[i]) for i in range(len(params))
    )
    assert all(torch.equal(a, b[i]) for i in range(len(params)) for a, b in zip(kept[i], reversed(alone)))
    got = sum_window([kept[i] for i in range(len(params))], torch.float32)
    assert all(torch.equal(got[i], want[i]) for i in range(len(params)))
    rounded = sum_window([kept[i] for i in range(len(params))], torch.bfloat16)
    assert all(torch.equal(rounded[i], want[i].bfloat16()) for i in range(len(params)))
    assert unit.summed == {} and ex.summed == frozenset()  # (let go after the backward)
    # what it replaces: autograd's own sum over the window, in 16 bits, is not that sum
    torch.autograd.backward([loss_of(emb, mid, x) for x in xs])
    assert (emb.weight.grad.float() - want[0]).abs().max() > 1e-3 * want[0].abs().max()


def test_the_sum_drops_no_micro_batch_and_adds_in_fp32():
    """sum_window on a gradient kept transposed (a Linear weight's, as TBackward hands it) and on
    contiguous ones: the fp32 sum of every part in order, rounded once, equal to the adds it
    replaced bit for bit; a sum without the last micro-batch, or one made in 16 bits, differs."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(64, 48, generator=g).mul(100).bfloat16() for _ in range(8)]
    for parts in (base, [t.t() for t in base], [t.t().contiguous() for t in base]):
        got = sum_window([parts], torch.bfloat16)[0]
        want = parts[0].float()
        for t in parts[1:]:
            want = want + t.float()
        assert got.shape == parts[0].shape and torch.equal(got, want.bfloat16())
        in_16 = parts[0].clone()
        for t in parts[1:]:
            in_16 += t
        assert not torch.equal(got, in_16)
        assert not torch.equal(got, sum_window([parts[:-1]], torch.bfloat16)[0])


def test_a_stale_extension_sums_with_torch_the_same_bits_and_says_so(monkeypatch, caplog):
    """An offloadpp._C built before sum_parts_ (a tree whose extension was copied from an older
    build): the window's sums run in torch, equal bit for bit, with one warning to rebuild."""
    import offloadpp.runtime.window_grads as wg

    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(33, 7, generator=g).mul(50).bfloat16() for _ in range(G)]
    want = sum_window([parts], torch.bfloat16)[0]
    monkeypatch.setattr(wg, "HAVE_SUM_PARTS", False)
    monkeypatch.setattr(wg, "_warned_stale", False)
    with caplog.at_level("WARNING", logger="offloadpp.runtime"):
        got = [sum_window([parts], torch.bfloat16)[0] for _ in range(2)]
    assert all(torch.equal(x, want) for x in got)
    assert sum("predates sum_parts_" in r.message for r in caplog.records) == 1
