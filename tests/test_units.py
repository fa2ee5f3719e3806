"""Splitting models into units (offloadpp/runtime/units.py): tiny Hugging Face models built from
configs (no downloads), a plain torch model, explicit splits and the errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from offloadpp.runtime import UnitDiscoveryError, find_units, layout_units  # noqa: E402


def _hf(kind: str) -> nn.Module:
    t = transformers
    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64)
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(intermediate_size=64, num_key_value_heads=1, **small))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(intermediate_size=64, num_key_value_heads=1, **small))
    if kind == "opt":
        return t.OPTForCausalLM(
            t.OPTConfig(ffn_dim=64, max_position_embeddings=32, word_embed_proj_dim=32, **small)
        )
    if kind == "gpt_neox":
        return t.GPTNeoXForCausalLM(
            t.GPTNeoXConfig(intermediate_size=64, max_position_embeddings=32, **small)
        )
    raise AssertionError(kind)


EXPECTED = {
    # kind: (blocks prefix, embed modules, head modules, head borrows the embeddings)
    "gpt2": ("transformer.h", ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head"), True),
    "llama": ("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), False),
    "qwen2": ("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), False),
    "opt": (
        "model.decoder.layers",
        ("model.decoder.embed_tokens", "model.decoder.embed_positions"),
        ("model.decoder.final_layer_norm", "lm_head"),
        True,
    ),
    "gpt_neox": ("gpt_neox.layers", ("gpt_neox.embed_in",), ("gpt_neox.final_layer_norm", "lm_head"), False),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_hf_models_split_into_embed_blocks_head(kind):
    model = _hf(kind)
    blocks, embed, head, tied = EXPECTED[kind]
    units = find_units(model)
    assert [u.name for u in units] == ["embed", f"{blocks}.0", f"{blocks}.1", "head"]
    assert units[0].modules == embed and units[-1].modules == head
    layouts = layout_units(model, units)
    # every parameter has exactly one owner, tied ones included
    owned = [p for lay in layouts for p, _ in lay.params]
    assert len(owned) == len({id(p) for p in owned}) == len(list(model.parameters()))
    assert sum(lay.numel for lay in layouts) == sum(p.numel() for p in model.parameters())
    assert layouts[-1].borrows == (("embed",) if tied else ())
    assert layouts[0].backward_needs_weights is False  # embedding lookups
    assert all(lay.backward_needs_weights for lay in layouts[1:])
    # a tied parameter carries both of its names
    if tied:
        names = {n for lay in layouts for _, s in lay.params for n in s.names}
        assert "lm_head.weight" in names


def test_layout_is_back_to_back():
    model = _hf("llama")
    lay = layout_units(model, find_units(model))[1]
    offsets = [(s.offset, s.numel) for _, s in lay.params]
    assert offsets[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(offsets, offsets[1:]))
    assert lay.params[0][1].name == "model.layers.0.self_attn.q_proj.weight"


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
        self.small = nn.ModuleList([nn.Linear(16, 16)])  # fewer parameters: not the blocks
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(self.small[0](x))


def test_any_model_with_a_module_list_of_blocks():
    units = find_units(Plain())
    assert [u.name for u in units] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert units[0].modules == ("inp",)
    assert units[-1].modules == ("small", "out")


def test_explicit_split_and_its_errors():
    model = Plain()
    units = find_units(model, (("inp", "blocks.0"), ("blocks.1", "blocks.2"), ("small", "out")))
    assert [u.name for u in units] == ["inp+blocks.0", "blocks.1+blocks.2", "small+out"]
    with pytest.raises(UnitDiscoveryError, match="'nope'"):
        find_units(model, (("nope",),))
    with pytest.raises(UnitDiscoveryError, match=r"parameter 'small.0.weight' belongs to no unit"):
        layout_units(model, find_units(model, (("inp",), ("blocks",), ("out",))))


def test_no_blocks_found():
    with pytest.raises(UnitDiscoveryError, match="no nn.ModuleList of blocks"):
        find_units(nn.Sequential(nn.Linear(2, 2)))


def test_parameter_outside_every_unit():
    model = Plain()
    model.scale = nn.Parameter(torch.ones(1))  # on the root: used by the root's own forward
    with pytest.raises(UnitDiscoveryError, match=r"parameter 'scale' belongs to no unit"):
        layout_units(model, find_units(model))
