"""The fused head's `grad_in_forward` policy (offloadpp/runtime/activations/head.py, Note on
gradients in forward): its gradients equal the keep policy's (bit for bit in fp32 and bf16 at a
power-of-two incoming gradient: loss scaling, 1/G of accumulation), it holds grad_h and the fp32
grad_W instead of the logits and runs no matmul in backward, it is refused where it does not
apply, and under the engine it trains as the keep policy does (tied and untied heads, fp16 loss
scaling with G = 2, the stand-in device)."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from test_head import VOCAB, WIDTH, _model, _worst
from torch.utils._python_dispatch import TorchDispatchMode

from offloadpp.io import TensorStore
from offloadpp.planner import ActivationSettings
from offloadpp.runtime.activations import head as headmod
from offloadpp.runtime.activations.manager import ActivationManager
from offloadpp.runtime.activations.records import ActivationError

transformers = pytest.importorskip("transformers")

GRAD = {"overrides": {"head": "grad_in_forward"}}


@pytest.fixture
def store(tmp_path):
    s = TensorStore([str(tmp_path / "nvme")])
    yield s
    s.close()


@pytest.fixture(scope="module")
def x():
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(headmod, "LOSS_CHUNK_ELEMS", 5 * VOCAB)  # 5 rows a chunk: 13 chunks, the last short


def _step(model, x, mgr, autocast=None, scale=1.0, **kw):
    """(loss, gradients by name) of one managed forward + backward of loss * scale."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        with mgr.forward():
            out = model(input_ids=x, labels=x, **kw)
        assert isinstance(out.logits, headmod.LazyLogits)
        mgr.backward(out.loss * scale)
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pair(kind, x, store, autocast=None, scale=1.0, **kw):
    """The keep policy's and grad_in_forward's (loss, gradients) from the same model."""
    ref = _model(kind)
    out = []
    for head in ("keep", "grad_in_forward"):
        model = copy.deepcopy(ref)
        cfg = ActivationSettings(policy="keep", overrides={"head": head})
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            out.append(_step(model, x, mgr, autocast, scale, **kw))
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])  # (GPT-2's head tied to the embedding, Llama's not)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
# 2**16: a loss scale; 0.5 with the Trainer's num_items_in_batch: 1/G of accumulation, G = 2
@pytest.mark.parametrize("scale,items", [(2.0**16, None), (0.5, 37)])
def test_gradients_are_the_keep_policys_bit_for_bit(store, x, kind, dtype, scale, items):
    kw = {"num_items_in_batch": torch.tensor(items)} if items else {}
    (want_loss, want), (loss, got) = _pair(kind, x, store, dtype, scale, **kw)
    assert torch.equal(loss, want_loss)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_other_incoming_gradients_round_once_more(store, x):
    """An incoming gradient that is no power of two (G = 3) multiplies the held gradients once
    more than the keep policy rounds: fp32 gradients within 1e-5."""
    (_, want), (_, got) = _pair("gpt2", x, store, None, 1 / 3)
    assert 0 < _worst(got, want) < 1e-5


@pytest.mark.parametrize("scale", [2.0**16, 0.5])
def test_fp16_scales_each_chunk_so_nothing_underflows(store, x, scale):
    """Under fp16 autocast each chunk's logits' gradient is scaled by a power of two before the
    cast (at g = 1 it would underflow where the loss scale lifts it): at a loss scale of 2^16 the
    gradients are the keep policy's within 1e-6 of their largest; at 0.5, where the keep policy's
    own fp16 gradient loses its smallest values, within 1%."""
    (_, want), (_, got) = _pair("gpt2", x, store, torch.float16, scale)
    assert _worst(got, want) < (1e-6 if scale > 1 else 1e-2)


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.out,
                    torch.ops.aten.addmm.out):  # fmt: skip
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_it_holds_the_gradients_not_the_logits(store, x, dtype):
    """The head's records are the keep policy's with grad_h in place of h (tokens x width in the
    compute dtype) and the fp32 grad_W in place of the logits."""
    records = {}
    for head in ("keep", "grad_in_forward"):
        model = _model("gpt2")
        cfg = ActivationSettings(policy="keep", overrides={"head": head})
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                with mgr.forward():
                    loss = model(input_ids=x, labels=x).loss
            records[head] = sorted(r.nbytes for r in next(u for u in mgr.units if u.name == "head").records)
            mgr.backward(loss)
    logits = x.numel() * VOCAB * (2 if dtype is not None else 4)
    keep = list(records["keep"])
    keep.remove(logits)
    assert records["grad_in_forward"] == sorted(keep + [VOCAB * WIDTH * 4]), records


def test_backward_of_the_fused_loss_runs_no_matmul(store, x, monkeypatch):
    """The fused loss's backward only scales what forward made (the keep policy's runs three
    matmuls a chunk there)."""
    fused = headmod.FusedLinearCrossEntropy
    original = fused.backward
    watch = _Matmuls()

    def backward(ctx, g):
        with watch:
            return original(ctx, g)

    monkeypatch.setattr(fused, "backward", staticmethod(backward))
    counts = {}
    for head in ("keep", "grad_in_forward"):
        watch.count = 0
        model = _model("gpt2")
        cfg = ActivationSettings(policy="keep", overrides={"head": head})
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            _step(model, x, mgr)
        counts[head] = watch.count
    assert counts["keep"] > 0 and counts["grad_in_forward"] == 0, counts


def test_refused_where_it_does_not_apply(store):
    with pytest.raises(ValidationError, match="fused head's unit only.*overrides"):
        ActivationSettings(policy="grad_in_forward")
    model = _model("gpt2")
    with pytest.raises(ActivationError, match=r"\['transformer.h.0'\].*only the fused head's unit 'head'"):
        ActivationManager.for_model(model, ActivationSettings(overrides={"transformer.h.0": "grad_in_forward"}),
                                    store=store)  # fmt: skip
    with pytest.raises(ActivationError, match=r"\['head'\].*no head is fused"):
        ActivationManager.for_model(model, ActivationSettings(fused_loss=False, **GRAD), store=store)


@pytest.mark.parametrize("case", ["eval", "no_grad", "no labels"])
def test_where_the_head_is_not_fused_it_keeps(store, x, case):
    """Without a fused loss (eval, no_grad, no labels) the real head runs, nothing is computed
    ahead, and the unit keeps what it saves."""
    ref = _model("llama")
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(model, ActivationSettings(policy="keep", **GRAD), store=store) as mgr:
        if case == "eval":
            model.eval(), ref.eval()
        kw = {} if case == "no labels" else {"labels": x}
        with torch.set_grad_enabled(case != "no_grad"):
            torch.manual_seed(3)
            with mgr.forward():
                out = model(input_ids=x, **kw)
            torch.manual_seed(3)
            want = ref(input_ids=x, **kw)
        assert type(out.logits) is torch.Tensor and torch.equal(out.logits, want.logits)
        if out.logits.requires_grad:
            mgr.backward(out.logits.sum() if out.loss is None else out.loss)


def test_a_forward_without_backward_leaves_nothing_behind(store, x):
    """A loss whose backward never runs: its held gradients are released with the step (the
    next step's end), as every unit's saves are; the device account returns to zero."""
    model = _model("gpt2")
    with ActivationManager.for_model(model, ActivationSettings(policy="keep", **GRAD), store=store) as mgr:
        with mgr.forward():
            loss = model(input_ids=x, labels=x).loss
        del loss  # (no backward)
        assert mgr.swapper.device_bytes >= VOCAB * WIDTH * 4
        _, got = _step(model, x, mgr)
        assert mgr.swapper.device_bytes == 0
    want = _pair("gpt2", x, store)[0][1]
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_frozen_head_makes_no_weight_gradient(store, x):
    ref = _model("llama")
    ref.lm_head.weight.requires_grad_(False)
    out = {}
    for head in ("keep", "grad_in_forward"):
        model = copy.deepcopy(ref)
        with ActivationManager.for_model(model, ActivationSettings(policy="keep", overrides={"head": head}),
                                         store=store) as mgr:  # fmt: skip
            torch.manual_seed(3)  # (the same dropout)
            with mgr.forward():
                loss = model(input_ids=x, labels=x).loss
            sizes = [r.nbytes for r in next(u for u in mgr.units if u.name == "head").records]
            mgr.backward(loss)
        out[head] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert VOCAB * WIDTH * 4 not in sizes and "lm_head.weight" not in out["grad_in_forward"]
    assert all(torch.equal(out["keep"][n], out["grad_in_forward"][n]) for n in out["keep"])


@pytest.mark.parametrize("kind,device", [("gpt2", "cpu"), ("llama", "cpu"), ("gpt2", "standin")])
def test_under_the_engine_fp16_loss_scaling_and_accumulation(tmp_path, monkeypatch, kind, device):
    """The engine's fp16 compute (dynamic loss scale 2^16), two micro-batches a step (1/2 each),
    GPT-2's head tied to the embedding and Llama's not, the stand-in device: the weights after
    two steps are the keep head's bit for bit, and so are the losses."""
    from conftest import set_device
    from test_runtime import batches, streaming_config, tiny_gpt2, tiny_llama

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper

    set_device(monkeypatch, device)
    ref = (tiny_gpt2 if kind == "gpt2" else tiny_llama)()
    monkeypatch.setattr(headmod, "LOSS_CHUNK_ELEMS", 5 * ref.config.vocab_size)  # 32 tokens: 7 chunks
    data = batches(4)
    out = {}
    for head in ("keep", "grad_in_forward"):
        acts = ActivationSettings(policy="keep", overrides={"head": head})
        (tmp_path / head).mkdir()
        cfg = streaming_config(
            tmp_path / head, compute_dtype="fp16", gradient_accumulation_steps=2, activations=acts
        )
        with assemble_engine(copy.deepcopy(ref), cfg, hyper=AdamHyper(lr=1e-3, weight_decay=0.01)) as eng:
            losses = []
            for x in data:
                o = eng(input_ids=x, labels=x)
                assert isinstance(o.logits, headmod.LazyLogits)
                eng.backward(o.loss)
                eng.step()
                losses.append(o.loss.item())
            out[head] = losses, {k: v.clone() for k, v in eng.module.state_dict().items()}
    assert out["keep"][0] == out["grad_in_forward"][0]
    want, got = out["keep"][1], out["grad_in_forward"][1]
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_on_the_users_path_through_initialize(tmp_path):
    """A DeepSpeed script's path: `offloadpp.initialize` with the head's override in the
    `"offloadpp"` block (tiny GPT-2, its head tied to the embedding, G = 2, clipping 1.0): four
    micro-batches give the keep head's losses and weights bit for bit; the policy given as every
    unit's is refused naming the field."""
    from test_deepspeed_integration import batches, ds_config, tiny_gpt2

    import offloadpp

    data = batches(4)
    out = {}
    for head in ("keep", "grad_in_forward"):
        block = {"enabled": True, "activations": {"policy": "keep", "overrides": {"head": head}}}
        cfg = ds_config(
            tmp_path / head, gradient_accumulation_steps=2, gradient_clipping=1.0, offloadpp=block
        )
        engine, *_ = offloadpp.initialize(model=tiny_gpt2(), config=cfg)
        try:
            assert engine.runtime.plan.activations[-1] == head
            losses = []
            for ids in data:
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[head] = losses, {k: v.clone() for k, v in engine.module.state_dict().items()}
        finally:
            engine.close()
    assert out["keep"][0] == out["grad_in_forward"][0]
    assert all(torch.equal(out["grad_in_forward"][1][k], v) for k, v in out["keep"][1].items())
    cfg = ds_config(
        tmp_path / "every", offloadpp={"enabled": True, "activations": {"policy": "grad_in_forward"}}
    )
    with pytest.raises(Exception, match="fused head's unit only"):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)


def test_in_a_vertical_window_it_trains_as_the_keep_head(tmp_path):
    """A vertical window (G = 4 micro-batches, each unit over all of them; dropout on, clipping
    1.0), the head making its gradients in forward, one set a micro-batch: the losses and weights
    of the keep head (which tests/test_window.py holds to torch's AdamW) bit for bit, both
    windows after the first run vertically."""
    from test_window import LR, G, gpt2, run_windows

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig

    g = torch.Generator().manual_seed(1)
    windows = [[torch.randint(0, 128, (2, 32), generator=g) for _ in range(G)] for _ in range(3)]
    ref = gpt2()
    out = {}
    for head in ("keep", "grad_in_forward"):
        s = Settings(gradient_accumulation_steps=G, gradient_clipping=1.0, accumulation="vertical",
                     activations=ActivationSettings(policy="keep", overrides={"head": head}))  # fmt: skip
        (tmp_path / head).mkdir()
        cfg = RuntimeConfig(nvme_paths=[str(tmp_path / head)], settings=s, device="cpu", ssd_read_gbps=2.0,
                            ssd_write_gbps=2.0)  # fmt: skip
        with assemble_engine(copy.deepcopy(ref), cfg, hyper=AdamHyper(lr=LR, weight_decay=0.01)) as eng:
            assert eng.activations.policies()["head"] == head
            losses, results = run_windows(eng, windows)
            assert [r.vertical for r in results] == [False, True, True]
            out[head] = losses, {k: v.clone() for k, v in eng.module.state_dict().items()}
    assert out["keep"][0] == out["grad_in_forward"][0]
    assert all(torch.equal(out["grad_in_forward"][1][k], v) for k, v in out["keep"][1].items())
