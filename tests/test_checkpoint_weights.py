"""A checkpoint's weights after the job (runtime/checkpoint_weights.py): `offloadpp export` (the
real command, a process of its own) writes a folder from_pretrained loads with the engine's
logits, without the model's code; get_fp32_state_dict_from_checkpoint gives the engine's master
weights; what would not fit, or is not in the checkpoint, is refused saying what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from test_export import VOCAB, logits, tiny, trained  # noqa: E402  (the same tiny models, 2 steps)

import offloadpp  # noqa: E402
from offloadpp import checkpoint_utils  # noqa: E402
from offloadpp.runtime.checkpoint import CheckpointError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


def export_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "offloadpp", "export", *map(str, args), "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def saved(tmp_path, kind: str):
    """A tiny model trained 2 steps and saved; (the engine, save_dir, its logits on X)."""
    engine = trained(tmp_path, kind)
    engine.save_checkpoint(str(tmp_path / "ck"))
    return engine, tmp_path / "ck", logits(engine, X)


def load(folder, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_offloadpp_export_gives_the_engines_logits_in_fp32_and_bf16(tmp_path, kind):
    engine, ck, want = saved(tmp_path, kind)
    try:
        masters = engine.runtime.trainable_state_dict()
        hf_keys = set(engine.module.state_dict())
    finally:
        engine.close()
    r = export_cli(ck, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert "memory bound" in r.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    model = load(tmp_path / "hf")
    assert torch.equal(logits(model, X), want)  # fp32: the masters themselves
    # the names save_pretrained writes: GPT-2's tied lm_head.weight is not written (from_pretrained ties it)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    tiny(kind).save_pretrained(str(tmp_path / "ref"))
    with safe_open(str(tmp_path / "ref" / "model.safetensors"), "pt") as f:
        assert written == set(f.keys())
    assert ("lm_head.weight" in written) == (kind == "llama") and "lm_head.weight" in hf_keys
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr() or kind != "gpt2"

    r = export_cli(ck, tmp_path / "bf16", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"
    got = logits(load(tmp_path / "bf16"), X)
    rounded = load(tmp_path / "hf")  # the engine's weights rounded to bf16, computed in fp32
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in masters.items()}, strict=False)
    assert torch.equal(got, logits(rounded, X))
    assert not torch.equal(got, want)  # (bf16 rounding is seen: the check above is not vacuous)


def test_export_shards_with_an_index_past_the_shard_size_and_takes_a_tag(tmp_path):
    engine, ck, want = saved(tmp_path, "gpt2")
    engine.save_checkpoint(str(ck), tag="later")  # `latest` now names it; the first stays
    engine.close()
    first = sorted(t for t in os.listdir(ck) if t.startswith("global_step"))[0]
    r = export_cli(ck, tmp_path / "hf", "--tag", first, "--shard-size", "20KB")
    assert r.returncode == 0, r.stderr
    files = sorted(os.listdir(tmp_path / "hf"))
    n = len([f for f in files if f.endswith(".safetensors")])
    assert n > 1 and files == sorted(
        ["config.json", "model.safetensors.index.json"]
        + [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    assert torch.equal(logits(load(tmp_path / "hf"), X), want)


def test_get_fp32_state_dict_from_checkpoint_equals_the_engines_masters(tmp_path):
    engine, ck, _ = saved(tmp_path, "gpt2")
    try:
        want = engine.runtime.trainable_state_dict()
    finally:
        engine.close()
    got = offloadpp.get_fp32_state_dict_from_checkpoint(str(ck))
    assert set(got) == set(want)  # tied names included (as zero_to_fp32's shared_params)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float32 for k in want)
    assert got["lm_head.weight"] is got["transformer.wte.weight"]
    assert (
        checkpoint_utils.get_fp32_state_dict_from_checkpoint is offloadpp.get_fp32_state_dict_from_checkpoint
    )


def test_past_the_memory_bound_the_dict_is_refused_naming_offloadpp_export(tmp_path):
    engine, ck, _ = saved(tmp_path, "gpt2")
    engine.close()
    fp32 = 4 * sum(p.numel() for p in trained(tmp_path / "b", "gpt2").module.parameters())
    with pytest.raises(MemoryError, match=r"offloadpp export .*OUT_DIR"):
        offloadpp.get_fp32_state_dict_from_checkpoint(str(ck), max_bytes=fp32 // 2)
    assert len(offloadpp.get_fp32_state_dict_from_checkpoint(str(ck), max_bytes=4 * fp32)) > 0
    r = export_cli(ck, tmp_path / "hf", "--max-memory", "1MB")  # the export's own bound
    assert r.returncode == 1 and "past the limit of" in r.stderr and not os.path.exists(tmp_path / "hf")


def test_without_config_json_the_weights_are_written_and_the_fix_named(tmp_path, monkeypatch):
    import offloadpp.integrations.deepspeed.checkpoint as ds_ckpt

    monkeypatch.setattr(ds_ckpt, "_hf_config", lambda module, folder: ())  # (a checkpoint of before)
    engine, ck, want = saved(tmp_path, "llama")
    engine.module.config.save_pretrained(str(tmp_path / "cfg"))
    engine.close()
    r = export_cli(ck, tmp_path / "hf")
    assert r.returncode == 0 and "config.json is missing" in r.stderr and "save_pretrained" in r.stderr
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]
    os.replace(tmp_path / "cfg" / "config.json", tmp_path / "hf" / "config.json")  # as the message says
    assert torch.equal(logits(load(tmp_path / "hf"), X), want)


def test_frozen_parameters_not_in_a_one_process_checkpoint_are_refused(tmp_path):
    """One process keeps frozen parameters by reference only (docs/frozen.md): the export is
    refused saying so; the trained parameters come as a dict with exclude_frozen_parameters."""
    from test_export import config

    model = tiny("gpt2")
    model.transformer.wpe.requires_grad_(False)
    engine, *_ = offloadpp.initialize(model=model, config=config(tmp_path / "nvme"))
    x = X
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ck"))
    want = engine.runtime.trainable_state_dict()
    engine.close()
    r = export_cli(tmp_path / "ck", tmp_path / "hf")
    assert r.returncode == 1 and "transformer.wpe.weight" in r.stderr and "by reference" in r.stderr
    with pytest.raises(CheckpointError, match="exclude_frozen_parameters=True"):
        offloadpp.get_fp32_state_dict_from_checkpoint(str(tmp_path / "ck"))
    got = offloadpp.get_fp32_state_dict_from_checkpoint(str(tmp_path / "ck"), exclude_frozen_parameters=True)
    assert "transformer.wpe.weight" not in got and set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_saved_by_two_ranks_exports_the_gathered_weights(tmp_path):
    """The ranks' shards of each unit put together: the export and the dict equal the weights
    the two ranks end with (their gathered state_dict). Frozen parameters (dp_common's: the
    position embeddings, the first block's MLP) are state over several ranks, so they export;
    exclude_frozen_parameters leaves them out by the names the manifest records."""
    from test_distributed import torchrun

    ck = tmp_path / "ck"
    (tmp_path / "nv").mkdir()
    torchrun([str(tmp_path / "out"), "--nvme", str(tmp_path / "nv"), "--steps", "2", "--api", "deepspeed",
              "--freeze", "--save", str(ck)])  # fmt: skip
    want = torch.load(tmp_path / "out" / "weights.pt")
    assert json.load(open(ck / "t" / "manifest.json"))["world_size"] == 2
    got = offloadpp.get_fp32_state_dict_from_checkpoint(str(ck))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    trained_only = offloadpp.get_fp32_state_dict_from_checkpoint(str(ck), exclude_frozen_parameters=True)
    frozen = {"transformer.wpe.weight", *(k for k in want if k.startswith("transformer.h.0.mlp."))}
    assert len(frozen) == 5 and set(trained_only) == set(want) - frozen
    r = export_cli(ck, tmp_path / "hf")
    assert r.returncode == 0 and "2 rank(s)" in r.stderr, r.stderr
    sd = load(tmp_path / "hf").state_dict()
    assert all(torch.equal(sd[k], want[k]) for k in want)


def test_a_peft_checkpoint_is_refused_by_the_export_and_its_adapters_come_as_a_dict(tmp_path):
    from test_export import config
    from test_peft import lora_model

    engine, *_ = offloadpp.initialize(model=lora_model("gpt2"), config=config(tmp_path / "nvme"))
    engine.backward(engine(input_ids=X, labels=X).loss)
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ck"))
    want = engine.runtime.trainable_state_dict()
    engine.close()
    r = export_cli(tmp_path / "ck", tmp_path / "hf")
    assert r.returncode == 1 and "is of a peft model" in r.stderr and "lora_" in r.stderr
    got = offloadpp.get_fp32_state_dict_from_checkpoint(str(tmp_path / "ck"), exclude_frozen_parameters=True)
    assert set(got) == set(want) and all("lora_" in k for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_missing_tag_or_folder_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    r = export_cli(tmp_path / "empty", tmp_path / "hf")
    assert r.returncode == 1 and "neither a 'latest' file" in r.stderr
    r = export_cli(tmp_path / "empty", tmp_path / "hf", "--tag", "nope")
    assert r.returncode == 1 and "checkpoint tag 'nope'" in r.stderr
