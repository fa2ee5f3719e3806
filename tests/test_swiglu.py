"""runtime/activations/swiglu.py: Llama-shaped MLPs saving their input and gate's and up's outputs
only, equal to Hugging Face's bit for bit (output and every gradient, in pieces too), falling back
where down_proj or act_fn is not the plain one, swapped in and out by the manager and the
profiler; what they save is what the analytic profile counts."""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from offloadpp.planner.model_profile import analytic_profile  # noqa: E402
from offloadpp.runtime.activations import swiglu  # noqa: E402
from offloadpp.runtime.activations.swiglu import restore_swiglu, substitute_swiglu  # noqa: E402

LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)  # fmt: skip


def _mlp(family: str, dtype=torch.float32, width: int = 64, inner: int = 160, **kw):
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mistral.modeling_mistral import MistralMLP
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    cls, config = {"llama": (LlamaMLP, transformers.LlamaConfig), "mistral": (MistralMLP, transformers.MistralConfig),
                   "qwen2": (Qwen2MLP, transformers.Qwen2Config)}[family]  # fmt: skip
    torch.manual_seed(0)
    return cls(config(hidden_size=width, intermediate_size=inner, **kw)).to(dtype)


def _run(m, x, g):
    """m(x), the gradients of x and of m's parameters, the non-parameter storages saved."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    wrt = [x] + [p for p in m.parameters() if p.requires_grad]
    grads = torch.autograd.grad(y, wrt, g)
    return y, grads, {t.untyped_storage().data_ptr(): t for t in saved}


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "family,kw",
    [("llama", {}), ("llama", {"mlp_bias": True, "hidden_act": "gelu_pytorch_tanh"}), ("mistral", {}),
     ("qwen2", {"hidden_act": "gelu_new"})],
    ids=["llama", "llama-bias-gelu", "mistral", "qwen2-gelu_new"],
)  # fmt: skip
def test_output_and_gradients_bit_identical_and_only_x_gate_and_up_saved(family, kw, dtype):
    m = _mlp(family, dtype, **kw)
    cls = type(m)
    x = torch.randn(3, 7, 64, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 7, 64, dtype=dtype)
    y0, g0, s0 = _run(m, x, g)
    held = substitute_swiglu([m])
    assert held == [m] and isinstance(m, cls) and type(m) is not cls
    y1, g1, s1 = _run(m, x, g)
    assert torch.equal(y0, y1) and _same(g0, g1)
    assert len(s0) >= 5  # x, gate, act_fn's output (and what it saves), up, the product
    shapes = sorted(tuple(t.shape) for t in s1.values())
    assert shapes == [(3, 7, 160), (3, 7, 160), (21, 64)], shapes  # x (the matmuls' view), gate, up
    restore_swiglu(held)
    assert type(m) is cls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_identical_on_cuda_whole_and_within_rounding_in_pieces(monkeypatch, dtype):
    """On a GPU (scripts/gpu_check.sh): the matmuls of the substitute's backward are the calls
    autograd makes (cuBLAS on the same layouts), so the output and gradients equal the plain
    module's bit for bit; in pieces of rows the elementwise gradients are within rounding."""
    m = _mlp("llama", dtype, width=512, inner=1376).cuda()
    x = torch.randn(4, 256, 512, dtype=dtype, device="cuda", requires_grad=True)
    g = torch.randn(4, 256, 512, dtype=dtype, device="cuda")
    y0, g0, _ = _run(m, x, g)
    held = substitute_swiglu([m])
    y1, g1, saved = _run(m, x, g)
    assert torch.equal(y0, y1) and _same(g0, g1) and len(saved) == 3
    monkeypatch.setattr(swiglu, "CHUNK_ELEMS", 100 * 1376)  # pieces of 100 rows, the last one short
    _, g2, _ = _run(m, x, g)
    restore_swiglu(held)
    ulp = torch.finfo(dtype).eps
    for a, b in zip(g0, g2):
        assert (a.float() - b.float()).abs().max() <= 2 * ulp * a.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_in_pieces_of_rows_bit_identical(monkeypatch, dtype):
    m = _mlp("llama", dtype)
    x = torch.randn(5, 9, 64, dtype=dtype, requires_grad=True)
    g = torch.randn(5, 9, 64, dtype=dtype)
    _, want, _ = _run(m, x, g)
    monkeypatch.setattr(swiglu, "CHUNK_ELEMS", 4 * 160 + 7)  # pieces of 4 rows, the last one short
    calls = []
    act = type(m.act_fn).forward
    monkeypatch.setattr(type(m.act_fn), "forward", lambda self, t: calls.append(t.shape[0]) or act(self, t))
    held = substitute_swiglu([m])
    _, got, saved = _run(m, x, g)
    restore_swiglu(held)
    assert _same(want, got) and len(saved) == 3
    # forward's, the product's again (grad_W), then 45 rows in 12 pieces under autograd
    assert calls == [5, 5] + [4] * 11 + [1], calls


def test_falls_back_where_down_proj_or_act_fn_is_not_plain_and_under_autocast():
    """peft's LoRA on down_proj, a hook on act_fn, autocast: everything saved as before, same
    values; LoRA on gate_proj and up_proj only: they run as they are, and of the inner width's
    tensors only gate and up are saved (plain autograd: act_fn's output too; not the product,
    down_proj's weight being frozen)."""
    peft = pytest.importorskip("peft")

    def wrapped(targets):
        class Block(torch.nn.Module):  # (peft wants a model around the MLP)
            def __init__(self):
                super().__init__()
                self.mlp = _mlp("llama")

            def forward(self, x):
                return self.mlp(x)

        cfg = peft.LoraConfig(r=4, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
        return peft.get_peft_model(Block(), cfg)

    x = torch.randn(2, 5, 64, requires_grad=True)
    g = torch.randn(2, 5, 64)
    for model, n in (
        (wrapped(["gate_proj", "up_proj", "down_proj"]), None),
        (wrapped(["gate_proj", "up_proj"]), 2),
    ):
        _, want, plain = _run(model, x, g)
        held = substitute_swiglu([model])
        assert len(held) == 1
        _, got, saved = _run(model, x, g)
        restore_swiglu(held)
        inner = [t for t in saved.values() if t.shape[-1] == 160]
        assert _same(want, got) and len(saved) <= len(plain), (len(saved), len(plain))
        assert len(inner) == (n or len([t for t in plain.values() if t.shape[-1] == 160])) >= 2
    m = _mlp("llama")
    _, want, plain = _run(m, x, g)
    held = substitute_swiglu([m])
    h = m.act_fn.register_forward_hook(lambda *a: None)
    _, got, saved = _run(m, x, g)
    h.remove()
    assert _same(want, got) and len(saved) == len(plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, want, plain = _run(_mlp("llama"), x, g)
        _, got, saved = _run(m, x, g)
    assert _same(want, got) and len(saved) == len(plain)
    restore_swiglu(held)


def test_other_modules_untouched_two_holders_restore_once_and_it_pickles():
    from transformers.models.llama.modeling_llama import LlamaMLP

    m = _mlp("llama")
    seq = torch.nn.Sequential(torch.nn.Linear(64, 64), m)
    first = substitute_swiglu([seq])
    assert first == [m] and type(seq[0]) is torch.nn.Linear
    second = substitute_swiglu([seq])
    restore_swiglu(first)
    assert type(m) is not LlamaMLP  # the second holder still runs it
    back = pickle.loads(pickle.dumps(seq))
    x = torch.ones(1, 64)
    assert torch.equal(back(x), seq(x))
    restore_swiglu(second)
    assert type(m) is LlamaMLP


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_profiler_measures_what_the_analytic_profile_counts_for_the_mlp_piece(dtype):
    """Under the profiler's substitution (what measured profiles count), the MLP saves what the
    analytic profile's MLP piece counts: x, gate and up, x + 2 x inner width a token."""
    from offloadpp.profiling.model import ModelProfiler

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA))
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    ids = torch.randint(0, 128, (2, 16))
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 16, 64, dtype=next(model.parameters()).dtype, requires_grad=True)
    with ModelProfiler(model, {"input_ids": ids, "labels": ids}, compute_dtype=dtype):
        _, _, saved = _run(mlp, x, torch.ones_like(x))
    measured = sum(t.untyped_storage().nbytes() for t in saved.values())
    block = analytic_profile(LLAMA, micro_batch=2, seq_len=16, compute_dtype=dtype).units[1]
    assert measured == block.pieces[3][0]
    _, _, plain = _run(mlp, x, torch.ones_like(x))  # (restored on close: everything saved again)
    assert sum(t.untyped_storage().nbytes() for t in plain.values()) > measured


@pytest.mark.parametrize("device", ["cpu", "standin"])
def test_the_engine_trains_a_llama_like_torch_adamw_and_its_blocks_save_less(tmp_path, monkeypatch, device):
    """Three AdamW steps under the engine, on the CPU and on the stand-in (keep, and partial_host:
    the MLP's forward replayed with its kept matmuls), equal torch's AdamW on the plain model
    within 1e-5; each block's saved bytes are the plain blocks' less two tensors at the inner
    width (the activation's output and the product), as the analytic profile counts; the
    manager's remove restores the class."""
    from conftest import set_device
    from numerics import compare_weights
    from test_activations_engine import _tiny, _torch_adamw, config
    from transformers.models.llama.modeling_llama import LlamaMLP

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper

    set_device(monkeypatch, device)
    lr = 1e-3
    ref = _tiny("llama")
    data = [torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(i))
            for i in range(3)]  # fmt: skip
    want = _torch_adamw(copy_of := _copy(ref), data, lr)
    plain = _blocks_saved_bytes(ref, data[0])
    inner = data[0].numel() * ref.config.intermediate_size * 4
    for policy in ("keep", "partial_host"):
        model = _copy(ref)
        with assemble_engine(
            model, config(tmp_path, policy=policy), hyper=AdamHyper(lr=lr, weight_decay=0.01)
        ) as eng:
            assert all(type(layer.mlp) is not LlamaMLP for layer in model.model.layers)
            got = []
            for i, x in enumerate(data):
                torch.manual_seed(100 + i)
                loss = eng(input_ids=x, labels=x).loss
                if policy == "keep":
                    saved = {u.name: u.saved_bytes for u in eng.activations.units}
                    assert [saved[f"model.layers.{j}"] for j in range(2)] == [n - 2 * inner for n in plain], (
                        plain
                    )
                eng.backward(loss)
                eng.step()
                got.append(loss.item())
            assert got == pytest.approx(want, rel=1e-5), policy
            assert (
                compare_weights(eng.module.state_dict(), copy_of.state_dict(), lr=lr, steps=len(data)) < 1e-5
            )
        assert all(type(layer.mlp) is LlamaMLP for layer in model.model.layers)


def _copy(m):
    import copy

    return copy.deepcopy(m)


def _blocks_saved_bytes(model, ids) -> list[int]:
    """What plain autograd saves in each block's forward (non-parameter storages, charged once,
    to the first block that saves them, as the manager charges them)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, int]] = {}  # storage -> (block, bytes)
    inside: list[int] = []
    handles = []
    for j, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda *a, j=j: inside.append(j)))
        handles.append(layer.register_forward_hook(lambda *a: inside.clear()))

    def pack(t):
        st = t.untyped_storage()
        if inside and st.data_ptr() not in params and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (inside[0], st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    for h in handles:
        h.remove()
    return [sum(n for b, n in seen.values() if b == j) for j in range(len(model.model.layers))]
