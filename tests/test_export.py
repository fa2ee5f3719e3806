"""Exports (runtime/export.py, integrations/deepspeed/export.py): save_16bit_model streams whatever
the file name, sharded with an index when large; the folders load with from_pretrained and give
the engine's logits; the whole state dict is refused where it would not fit in memory."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import offloadpp
from offloadpp.integrations.deepspeed import export as ds_export
from offloadpp.runtime import export as rt_export

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

VOCAB = 96


def tiny(kind: str, seed: int = 0):
    """A 2-layer GPT-2 or Llama of width 32 (tests/test_peft.py builds its bases with it too)."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def config(nvme) -> dict:
    os.makedirs(nvme, exist_ok=True)
    dev = {"device": "nvme", "nvme_path": str(nvme)}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": dict(dev), "offload_optimizer": dict(dev)},
        "offloadpp": {"enabled": True},
    }


def trained(tmp_path, kind: str):
    engine, *_ = offloadpp.initialize(model=tiny(kind), config=config(tmp_path / "nvme"))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, VOCAB, (2, 16), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    return engine


def logits(model, x) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=x).logits
    model.train()
    return out


X = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("name", [None, "model.safetensors"])
@pytest.mark.parametrize("sharded", [False, True])
def test_save_16bit_model_streams_a_folder_from_pretrained_loads(tmp_path, monkeypatch, kind, name, sharded):
    engine = trained(tmp_path, kind)
    want = logits(engine, X)

    def whole_dict(*a, **k):
        raise AssertionError("the export built the whole state dict")

    monkeypatch.setattr(engine, "_zero3_consolidated_16bit_state_dict", whole_dict)
    monkeypatch.setattr(engine, "module_state_dict", whole_dict)
    if sharded:
        monkeypatch.setattr(rt_export, "DEFAULT_SHARD_BYTES", 40_000)  # "large": more than one shard
    out = tmp_path / "out"
    if name is None:
        engine.save_16bit_model(str(out))  # DeepSpeed's default name, pytorch_model.bin
    else:
        engine.save_16bit_model(str(out), name)
    name = name or "pytorch_model.bin"
    stem, ext = os.path.splitext(name)
    files = set(os.listdir(out))
    if not sharded:
        assert files == {name}
    else:
        index = json.loads((out / f"{name}.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        n = len(shards)
        assert n > 2 and shards == [f"{stem}-{i:05d}-of-{n:05d}{ext}" for i in range(1, n + 1)]
        assert files == {*shards, f"{name}.index.json"}
        assert index["metadata"]["total_size"] == sum((out / s).stat().st_size for s in shards) - sum(
            _overhead(out / s) for s in shards
        )
    engine.module.config.save_pretrained(str(out))
    loaded = type(engine.module).from_pretrained(str(out), local_files_only=True)
    assert torch.equal(logits(loaded, X), want)
    if kind == "gpt2":
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
    engine.close()


def _overhead(path) -> int:
    """A weights file's bytes that are not tensor data (headers, the zip's records and index)."""
    if str(path).endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return path.stat().st_size - sum(
                f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()
            )
    sd = torch.load(str(path), weights_only=True, mmap=True)
    return path.stat().st_size - sum(v.numel() * v.element_size() for v in sd.values())


def test_an_export_replaces_the_earlier_one_of_the_same_name(tmp_path, monkeypatch, on_device):
    """from_pretrained prefers a single file to an index: an old single file beside new shards
    (or old shards beside a new single file) must not survive."""
    engine = trained(tmp_path, "gpt2")
    out = tmp_path / "out"
    (out).mkdir()
    (out / "model.safetensors").write_bytes(b"other format, untouched")
    engine.save_16bit_model(str(out))
    assert set(os.listdir(out)) == {"pytorch_model.bin", "model.safetensors"}
    monkeypatch.setattr(rt_export, "DEFAULT_SHARD_BYTES", 40_000)
    engine.save_16bit_model(str(out))
    sharded = set(os.listdir(out))
    assert "pytorch_model.bin" not in sharded and "pytorch_model.bin.index.json" in sharded
    monkeypatch.setattr(rt_export, "DEFAULT_SHARD_BYTES", 10**9)
    engine.save_16bit_model(str(out))
    assert set(os.listdir(out)) == {"pytorch_model.bin", "model.safetensors"}
    engine.close()


def test_the_whole_state_dict_is_refused_where_it_would_not_fit(tmp_path, monkeypatch):
    engine = trained(tmp_path, "llama")
    sd = engine._zero3_consolidated_16bit_state_dict()  # small: built, unit by unit
    want = {k: v.clone() for k, v in engine.module.state_dict().items()}
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    need = ds_export.weights_bytes(engine.module, torch.float32)
    monkeypatch.setattr(ds_export, "memory_available", lambda: int(need / ds_export.MEMORY_SHARE) - 1)
    with pytest.raises(ds_export.WeightsDoNotFitError, match=r"engine\.save_16bit_model\(dir\)"):
        engine._zero3_consolidated_16bit_state_dict()
    monkeypatch.setattr(ds_export, "memory_available", lambda: int(need / ds_export.MEMORY_SHARE) + 1)
    assert len(engine._zero3_consolidated_16bit_state_dict()) == len(want)
    engine.close()


def test_the_whole_state_dict_is_refused_past_the_host_budget(tmp_path, monkeypatch):
    """Free memory is not the only limit: a host budget below the model's weights is the promise
    that the run holds no more host memory than that, however much the machine has free."""
    monkeypatch.setattr(ds_export, "memory_available", lambda: 1 << 40)
    engine = trained(tmp_path, "gpt2")
    need = ds_export.weights_bytes(engine.module, torch.float32)
    budgets = engine.runtime.plan.budgets
    assert need <= budgets.host_bytes  # the auto budget of a small model holds it: built
    assert len(engine._zero3_consolidated_16bit_state_dict()) == len(engine.module.state_dict())
    engine.runtime.plan = dataclasses.replace(
        engine.runtime.plan, budgets=dataclasses.replace(budgets, host_bytes=need - 1)
    )
    with pytest.raises(ds_export.WeightsDoNotFitError, match=r"host budget.*engine\.save_16bit_model\(dir\)"):
        engine._zero3_consolidated_16bit_state_dict()
    engine.close()
