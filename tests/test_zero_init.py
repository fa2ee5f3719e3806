"""offloadpp.Init: a model built inside holds no weights; offloadpp.initialize gives each unit its
weights (the model's own init, or its safetensors files) one unit at a time."""

from __future__ import annotations

import math
import os

import pytest
import torch

import offloadpp

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
transformers.logging.set_verbosity_error()


def config(nvme):
    os.makedirs(nvme, exist_ok=True)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
        "offloadpp": {"enabled": True},
    }  # fmt: skip


GPT2 = dict(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=512)
LLAMA = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)  # fmt: skip


def losses(engine, n=3):
    out = []
    x = torch.randint(
        0, 512, (2, 16), generator=torch.Generator().manual_seed(0)
    )  # one batch: the loss must fall
    for _ in range(n):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_model_built_inside_has_no_weights_and_gets_its_own_init(tmp_path, kind):
    cfg = config(tmp_path / "nvme")
    with offloadpp.Init(config=cfg):
        if kind == "gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # rotary frequencies are real
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # ties survive
    engine, *_ = offloadpp.initialize(model=model, config=cfg)
    try:
        sd = engine.module.state_dict()
        emb = sd["transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"]
        assert 0.015 < emb.std().item() < 0.025  # the model's own normal(0, 0.02), not zeros or garbage
        got = losses(engine)
        assert abs(got[0] - math.log(512)) < 0.5 and got[-1] < got[0]  # near log(vocab): a real init
    finally:
        engine.close()


def test_from_pretrained_inside_streams_the_safetensors(tmp_path):
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    ref.save_pretrained(str(tmp_path / "hf"), max_shard_size="100KB")  # sharded, with an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    cfg = config(tmp_path / "nvme")
    with offloadpp.Init(config=cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert all(p.is_meta for p in model.parameters())
    engine, *_ = offloadpp.initialize(model=model, config=cfg)
    try:
        got, want = engine.module.state_dict(), ref.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        engine.close()
    original = transformers.PreTrainedModel.__dict__["from_pretrained"]
    with pytest.raises(ValueError, match="local model folder"), offloadpp.Init():
        transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "missing"))
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original  # put back on the way out
    assert torch.nn.Module.register_parameter.__name__ == "register_parameter"


def test_init_checks_the_config_first(tmp_path):
    bad = {**config(tmp_path / "nvme"), "offloadpp": {"enabled": True, "prefetch_depth": "two"}}
    with pytest.raises(offloadpp.integrations.deepspeed.OffloadppConfigError, match="prefetch_depth"):
        offloadpp.Init(config=bad)
