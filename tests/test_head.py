"""The fused head (offloadpp/runtime/activations/head.py) around plain models under the
ActivationManager: gradients of Hugging Face's own head and loss, in fp32 and under 16-bit
autocast; no tensor of the whole logits' size made in backward; the head's records as its policy
says; the placeholder logits and when the real ones are given instead. Under the engine:
tests/test_activations_engine.py `test_fused_head_trains_like_torch_adamw`."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from offloadpp.io import TensorStore
from offloadpp.planner import ActivationSettings
from offloadpp.runtime.activations import head as headmod
from offloadpp.runtime.activations.manager import ActivationManager
from offloadpp.runtime.activations.records import ActivationError

transformers = pytest.importorskip("transformers")

VOCAB, WIDTH = 256, 32  # (the logits, 64 x 256, are the largest tensor of a step: 2x the MLP's)


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=64,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    config, model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    cfg = config(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=VOCAB, attention_dropout=0.1)  # fmt: skip
    return model(cfg)


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


def _step(model, x, mgr=None, autocast=None, **kw):
    """(loss, gradients by name, the model's output) of one forward + backward, dropout seeded."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        if mgr is None:
            out = model(input_ids=x, labels=x, **kw)
            out.loss.backward()
        else:
            with mgr.forward():
                out = model(input_ids=x, labels=x, **kw)
            mgr.backward(out.loss)
    return (
        out.loss.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        out,
    )


def _worst(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(
        ((got[n].float() - want[n].float()).abs().max() / want[n].float().abs().max()).item() for n in want
    )


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["keep", "ssd", "recompute", "recompute_host", "partial_ssd"])
# items: None, the mean; 37, the Trainer's sum over num_items_in_batch. device: the stand-in too
@pytest.mark.parametrize("items,device", [(None, "cpu"), (37, "cpu"), (None, "standin")])
def test_gradients_are_hugging_faces(store, x, monkeypatch, kind, policy, items, device):
    from conftest import set_device

    set_device(monkeypatch, device)
    ref = _model(kind)
    kw = {"num_items_in_batch": torch.tensor(items)} if items else {}
    want_loss, want, _ = _step(ref, x, **kw)
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(model, ActivationSettings(policy=policy), store=store) as mgr:
        loss, got, out = _step(model, x, mgr, **kw)
        assert isinstance(out.logits, headmod.LazyLogits)
    assert torch.allclose(loss, want_loss, rtol=1e-6, atol=0)
    assert _worst(got, want) < 1e-5


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_the_other_supported_models(store, x, kind):
    ref = _model(kind)
    want_loss, want, _ = _step(ref, x)
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(model, ActivationSettings(policy="recompute"), store=store) as mgr:
        loss, got, out = _step(model, x, mgr)
    assert isinstance(out.logits, headmod.LazyLogits)
    assert torch.allclose(loss, want_loss, rtol=1e-6, atol=0) and _worst(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_close_to_hugging_faces(store, x, dtype):
    """Under CPU autocast the logits are 16-bit as the linear would make them, and the loss and
    gradients are Hugging Face's within 16-bit rounding: each gradient within 1% of its largest
    element (grad_W sums its chunks in fp32, autograd in one 16-bit matmul; both round to 16 bits)."""
    ref = _model("gpt2")
    want_loss, want, _ = _step(ref, x, autocast=dtype)
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(model, ActivationSettings(policy="keep"), store=store) as mgr:
        loss, got, out = _step(model, x, mgr, autocast=dtype)
    assert out.logits.dtype == dtype and all(g.dtype == torch.float32 for g in got.values())
    assert torch.allclose(loss, want_loss, rtol=1e-3, atol=0)
    assert _worst(got, want) < 1e-2


def test_under_autocast_the_loss_saves_h_as_the_matmul_reads_it(store, x):
    """The norm's output is fp32 under autocast; the fused loss saves it cast to the compute dtype
    (as autocast's linear saves it), the loss input the planner counts: a recomputing head's only
    record is t x width x 2 bytes in bf16, not x 4."""
    model = _model("gpt2")
    with ActivationManager.for_model(model, ActivationSettings(policy="recompute"), store=store) as mgr:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with mgr.forward():
                loss = model(input_ids=x, labels=x).loss
            head = next(u for u in mgr.units if u.name == "head")
            records = [r.nbytes for r in head.records]
            mgr.backward(loss)
    assert records == [x.numel() * WIDTH * 2], records
    assert model.transformer.ln_f.weight.grad is not None and model.lm_head.weight.grad.dtype == torch.float32


class _Largest(TorchDispatchMode):
    """The largest storage an operator allocated while it was active, in bytes (a view of an
    argument, such as unpack rebuilding a saved tensor, allocates none)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            (x.untyped_storage() if isinstance(x, torch.Tensor) else x).data_ptr()
            for x in tree_leaves((args, kwargs))
            if isinstance(x, (torch.Tensor, torch.UntypedStorage))
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("policy", ["keep", "partial", "recompute"])
def test_backward_makes_no_whole_logits_and_the_head_saves_as_its_policy_says(store, x, policy):
    """Hugging Face's path makes the whole logits' gradient in backward (the check sees it); the
    fused head makes nothing larger than a chunk's; the head keeps a logits-sized record only
    where its policy keeps (partial too: the logits are its matmul's output; recompute: h only)."""
    logits = x.numel() * VOCAB * 4
    largest = {}
    for fused in (False, True):
        model = _model("gpt2")
        cfg = ActivationSettings(policy=policy, fused_loss=fused)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            with mgr.forward():
                loss = model(input_ids=x, labels=x).loss
            head = next(u for u in mgr.units if u.name == "head")
            records = sorted(r.nbytes for r in head.records)
            watch = _Largest()
            with watch:
                mgr.backward(loss)
        largest[fused] = watch.nbytes
    assert largest[False] >= logits > largest[True], largest
    if policy in ("keep", "partial"):
        assert records[-1] == logits, records
    else:
        assert records == [x.numel() * WIDTH * 4], records


def test_the_placeholder_refuses_to_be_read(store, x):
    model = _model("gpt2")
    with ActivationManager.for_model(model, ActivationSettings(policy="keep"), store=store) as mgr:
        with mgr.forward():
            out = model(input_ids=x, labels=x)
        lg = out.logits
        assert isinstance(lg, headmod.LazyLogits) and lg.shape == (*x.shape, VOCAB)
        assert "fused_loss" in repr(lg)
        for read in (
            lambda t: t.sum(),
            lambda t: t[0],
            lambda t: t.argmax(-1),
            lambda t: t + 1,
            lambda t: t.max(),
        ):
            with pytest.raises(ActivationError, match=r"fused head \(activations.fused_loss\).*set it false"):
                read(lg)
        # what Accelerate does to outputs without reading them: another placeholder
        assert isinstance(lg.float(), headmod.LazyLogits) and lg.to(torch.bfloat16).dtype == torch.bfloat16
        assert isinstance(lg.detach(), headmod.LazyLogits)
        with pytest.raises(ActivationError, match="twice"):
            model.loss_function(lg, x, VOCAB)
        mgr.backward(out.loss)


@pytest.mark.parametrize("case", ["fused_loss false", "no labels", "eval", "no_grad"])
def test_real_logits_where_the_fused_head_does_not_apply(store, x, case):
    ref = _model("llama")
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy="keep", fused_loss=case != "fused_loss false")
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        if case == "eval":
            model.eval(), ref.eval()
        kw = {} if case == "no labels" else {"labels": x}
        with torch.set_grad_enabled(case != "no_grad"):
            torch.manual_seed(3)
            with mgr.forward():
                out = model(input_ids=x, **kw)
            torch.manual_seed(3)  # (the same dropout)
            want = ref(input_ids=x, **kw)
        assert type(out.logits) is torch.Tensor
        assert torch.equal(out.logits, want.logits)
        assert case == "no labels" or torch.equal(out.loss, want.loss)
        if out.logits.requires_grad:
            mgr.backward(out.logits.sum() if out.loss is None else out.loss)
    assert "forward" not in vars(model.lm_head)  # remove() took the head's forward away


def test_frozen_untied_head_gets_no_weight_gradient(store, x):
    """A LoRA model's lm_head is frozen: the fused backward returns no grad_W (and h's gradient
    is still Hugging Face's)."""
    ref = _model("llama")
    ref.lm_head.weight.requires_grad_(False)
    _, want, _ = _step(ref, x)
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(model, ActivationSettings(policy="recompute"), store=store) as mgr:
        _, got, out = _step(model, x, mgr)
    assert isinstance(out.logits, headmod.LazyLogits)
    assert "lm_head.weight" not in got and model.lm_head.weight.grad is None
    assert _worst(got, want) < 1e-5


def test_labels_given_positionally_are_seen(store, x):
    model = _model("gpt2")
    with ActivationManager.for_model(model, ActivationSettings(policy="keep"), store=store) as mgr:
        names = list(__import__("inspect").signature(model.forward).parameters)
        args = [None] * names.index("labels") + [x]
        args[0] = x
        with mgr.forward():
            out = model(*args)
        assert isinstance(out.logits, headmod.LazyLogits)
        mgr.backward(out.loss)


def test_a_model_type_not_listed_keeps_its_own_head(store, x):
    """Only the listed model types are fused (their forward hands lm_head's output straight to
    the loss): another causal LM keeps its head and its logits."""
    cfg = transformers.GPTNeoXConfig(num_hidden_layers=1, hidden_size=WIDTH, intermediate_size=64,
                                     num_attention_heads=2, vocab_size=VOCAB)  # fmt: skip
    model = transformers.GPTNeoXForCausalLM(cfg)
    assert cfg.model_type not in headmod.SUPPORTED_MODEL_TYPES and headmod.fusable_head(model) is None
    with ActivationManager.for_model(model, ActivationSettings(policy="keep"), store=store) as mgr:
        with mgr.forward():
            out = model(input_ids=x, labels=x)
        assert type(out.logits) is torch.Tensor and mgr._fused is None
        mgr.backward(out.loss)


def test_bf16_compute_under_the_engine_in_many_chunks(tmp_path, monkeypatch):
    """The engine's bf16 compute (bf16 weights, fp32 masters) with the fused head in 11 chunks:
    grad_W summed in fp32 over the chunks and cast to bf16 once, against torch's mixed-precision
    recipe (one bf16 matmul): four steps within 2% of the distance travelled, the bound
    tests/test_runtime_device.py sets for bf16 compute."""
    from test_runtime import batches, global_rel_diff, tiny_gpt2
    from test_runtime_device import LR, WD, config, mixed_precision_reference

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper

    model = tiny_gpt2()
    init = copy.deepcopy(model.state_dict())
    data = batches(4)
    monkeypatch.setattr(headmod, "LOSS_CHUNK_ELEMS", 3 * model.config.vocab_size)  # 32 tokens: 11 chunks
    want = mixed_precision_reference(model, data, "cpu").state_dict()
    eng = assemble_engine(copy.deepcopy(model), config(tmp_path, "cpu", compute_dtype="bf16"),
                          hyper=AdamHyper(lr=LR, weight_decay=WD))  # fmt: skip
    with eng:
        for x in data:
            out = eng(input_ids=x, labels=x)
            assert isinstance(out.logits, headmod.LazyLogits) and out.logits.dtype == torch.bfloat16
            eng.backward(out.loss)
            eng.step()
        got = eng.module.state_dict()
    assert global_rel_diff(got, want) < 0.02 * global_rel_diff(want, init)
