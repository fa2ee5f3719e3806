"""runtime/activations/gelu.py: the tanh-form GELU saving only its input, equal to Hugging Face's
formula bit for bit (forward and gradient; within rounding when the backward runs in pieces),
swapped in and out by the manager."""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.activations")

from offloadpp.runtime.activations.gelu import restore_gelu, substitute_gelu  # noqa: E402

FORMS = [
    ("gelu_new", lambda: hf.NewGELUActivation()),
    ("gelu_fast", lambda: hf.FastGELUActivation()),
    ("gelu_python_tanh", lambda: hf.GELUTanh(use_gelu_tanh_python=True)),
]


def _saved(fn, x) -> list:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return y, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,make", FORMS, ids=[f[0] for f in FORMS])
def test_forward_and_gradient_bit_identical_and_only_the_input_saved(name, make, dtype):
    torch.manual_seed(0)
    m = make()
    x = (torch.randn(4, 3000, dtype=dtype) * 3).requires_grad_()
    g = torch.randn(4, 3000, dtype=dtype)
    y0, saved0 = _saved(m, x)
    (gx0,) = torch.autograd.grad(y0, x, g)
    held = substitute_gelu([m])
    assert held == [m] and isinstance(m, type(make()))  # still the Hugging Face class
    y1, saved1 = _saved(m, x)
    (gx1,) = torch.autograd.grad(y1, x, g)
    assert torch.equal(y0, y1)
    assert len(saved0) >= 4 and len(saved1) == 1 and saved1[0] is x
    assert torch.equal(gx0, gx1)
    restore_gelu(held)
    assert type(m) is type(make())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_in_pieces_within_rounding(monkeypatch, dtype):
    from offloadpp.runtime.activations import gelu

    torch.manual_seed(0)
    m = hf.NewGELUActivation()
    x = (torch.randn(7, 1000) * 3).to(dtype).requires_grad_()
    g = torch.randn(7, 1000).to(dtype)
    (want,) = torch.autograd.grad(m(x), x, g)
    monkeypatch.setattr(gelu, "CHUNK_ELEMS", 999)  # 8 pieces, the last one short
    held = substitute_gelu([m])
    (got,) = torch.autograd.grad(m(x), x, g)
    restore_gelu(held)
    ulp = torch.finfo(dtype).eps
    assert got.shape == want.shape and (got - want).abs().max() <= 2 * ulp * want.abs().max()


def test_torch_gelu_and_other_modules_untouched_and_two_holders_restore_once():
    mods = torch.nn.Sequential(
        hf.GELUTanh(), hf.GELUActivation(), torch.nn.Linear(2, 2), hf.NewGELUActivation()
    )
    first = substitute_gelu([mods])
    assert first == [mods[3]]
    assert [type(m) for m in mods[:3]] == [hf.GELUTanh, hf.GELUActivation, torch.nn.Linear]
    second = substitute_gelu([mods])
    restore_gelu(first)
    assert type(mods[3]) is not hf.NewGELUActivation  # the second holder still runs it
    back = pickle.loads(pickle.dumps(mods))  # a model holding the substitute still pickles
    assert torch.equal(back(torch.ones(1, 2)), mods(torch.ones(1, 2)))
    restore_gelu(second)
    assert type(mods[3]) is hf.NewGELUActivation


def test_the_manager_substitutes_inside_its_units_and_remove_restores():
    transformers = pytest.importorskip("transformers")
    from offloadpp.planner import ActivationSettings
    from offloadpp.runtime.activations.manager import ActivationManager

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    act = model.transformer.h[0].mlp.act
    mgr = ActivationManager.for_model(model, ActivationSettings(policy="keep"))
    assert type(act) is not hf.NewGELUActivation and isinstance(act, hf.NewGELUActivation)
    ids = torch.randint(0, 64, (2, 8))
    with mgr.forward():
        loss = model(input_ids=ids, labels=ids).loss
    mgr.backward(loss)
    mgr.close()
    assert type(act) is hf.NewGELUActivation
