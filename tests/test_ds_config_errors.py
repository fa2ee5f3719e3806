"""Configs `offloadpp.initialize` must refuse, each with an error naming the key (never a raw
IndexError, pydantic dump or DeepSpeed assertion), and the ones it must accept as DeepSpeed does."""

from __future__ import annotations

import base64
import json

import pytest
from test_deepspeed_integration import ds_config, tiny_gpt2

import offloadpp
from offloadpp.integrations.deepspeed import OffloadppConfigError

pytest.importorskip("deepspeed")


def _with(cfg: dict, path: str, value) -> dict:
    node = cfg
    parts = path.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    if value is _DELETE:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    return cfg


_DELETE = object()

BAD = [
    ("optimizer.params.betas", [0.9], r"optimizer\.params\.betas: expected two numbers"),
    ("optimizer.params.betas", "0.9,0.99", r"optimizer\.params\.betas: expected two numbers"),
    ("optimizer.params.lr", "1e-3", r"optimizer\.params\.lr: expected a number"),
    ("optimizer.params.eps", -1.0, r"optimizer\.params\.eps: "),
    ("optimizer.params.amsgrad", True, r"optimizer\.params\.amsgrad: not supported"),
    ("optimizer.params.momentum", 0.9, r"optimizer\.params: unknown key\(s\) \['momentum'\]"),
    ("optimizer", "AdamW", r"optimizer: expected an object"),
    (
        "train_micro_batch_size_per_gpu",
        0,
        r"train_micro_batch_size_per_gpu: expected a whole number >= 1, got 0",
    ),
    ("train_micro_batch_size_per_gpu", "2", r"train_micro_batch_size_per_gpu: expected a whole number"),
    ("gradient_accumulation_steps", 0, r"gradient_accumulation_steps: expected a whole number >= 1"),
    ("train_batch_size", 3, r"DeepSpeed's config check: .*train_batch_size is not equal"),
    ("gradient_clipping", "1.0", r"gradient_clipping: expected a number"),
    (
        "zero_optimization.stage",
        2,
        r"zero_optimization\.stage: 2 is not supported by offloadpp: .*set it to 3",
    ),
    ("zero_optimization.stage", 0, r"zero_optimization\.stage: 0 is not supported"),
    ("zero_optimization.offload_optimizer.ratio", 0.3, r"zero_optimization\.offload_optimizer\.ratio"),
    ("fp16.fp16_master_weights_and_grads", True, r"fp16\.fp16_master_weights_and_grads"),
    ("fp16.enabled", "auto", r'fp16\.enabled: "auto" is filled in by Hugging Face Trainer'),
    ("tensorboard.enabled", True, r"tensorboard\.enabled: True is not supported by offloadpp: .*report_to"),
    (
        "gradient_acumulation_steps",
        2,
        r"gradient_acumulation_steps: not a key .*'gradient_accumulation_steps'",
    ),
    ("offloadpp.enabled", "true", r"offloadpp\.enabled: expected true or false"),
    ("offloadpp.nvme_paths", ["/x", "/x"], r"offloadpp\.nvme_paths"),
    ("scheduler.params.warmup_num_stepz", 3, r"scheduler\.params: DeepSpeed's WarmupLR refuses them"),
    ("pipeline", {"stages": 2}, r"pipeline: .* pipeline parallelism is not supported"),
]


@pytest.mark.parametrize("path, value, message", BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_config_is_refused_naming_the_key(tmp_path, path, value, message):
    cfg = _with(ds_config(tmp_path / "nvme"), path, value)
    if path == "offloadpp.nvme_paths":
        (tmp_path / "x").mkdir()
        cfg["offloadpp"]["nvme_paths"] = [str(tmp_path / "x")] * 2
    with pytest.raises(OffloadppConfigError, match=message):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)


def test_model_parameters_that_leave_out_a_trainable_parameter_are_refused(tmp_path):
    model = tiny_gpt2()
    some = [p for n, p in model.named_parameters() if "ln_f" not in n]
    with pytest.raises(
        OffloadppConfigError, match=r"parameter 'transformer\.ln_f\.weight' requires grad .* freeze"
    ):
        offloadpp.initialize(model=model, model_parameters=some, config=ds_config(tmp_path / "nvme"))


def test_other_optimizers_are_refused(tmp_path):
    model = tiny_gpt2()
    with pytest.raises(
        OffloadppConfigError, match=r"offloadpp runs Adam/AdamW only .*torch\.optim\.sgd\.SGD"
    ):
        offloadpp.initialize(model=model, optimizer=__import__("torch").optim.SGD(model.parameters(), lr=0.1),
                             config=ds_config(tmp_path / "nvme"))  # fmt: skip


@pytest.mark.parametrize("name", ["offlodpp", "OffloadPP", "offload_pp", "offloadpp_config"])
def test_a_misspelt_block_is_not_a_silent_zero_infinity_run(tmp_path, name):
    cfg = ds_config(tmp_path / "nvme")
    cfg[name] = cfg.pop("offloadpp")
    with pytest.raises(
        OffloadppConfigError, match=f"'{name}': not a DeepSpeed key, but close to 'offloadpp'"
    ):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)


def test_config_files_that_are_not_json_objects_name_the_file(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([ds_config(tmp_path / "nvme")]))
    with pytest.raises(
        OffloadppConfigError, match=r"list\.json'?: expected a JSON object of keys, got a list"
    ):
        offloadpp.initialize(model=tiny_gpt2(), config=str(listed))
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_micro_batch_size_per_gpu": 2,,}')
    with pytest.raises(OffloadppConfigError, match=r"broken\.json' is not valid JSON: .* line 1"):
        offloadpp.initialize(model=tiny_gpt2(), config=str(broken))
    twice = tmp_path / "twice.json"
    twice.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(
        OffloadppConfigError, match=r"twice\.json'.*'train_micro_batch_size_per_gpu' appears twice"
    ):
        offloadpp.initialize(model=tiny_gpt2(), config=str(twice))
    with pytest.raises(OffloadppConfigError, match="expected a dict, a file path or base64 JSON, got a list"):
        offloadpp.initialize(model=tiny_gpt2(), config=[1])


HJSON = """{
  // comments and trailing commas, as DeepSpeed reads its configs (hjson)
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,},},
  "zero_optimization": {"stage": 3,
    "offload_param": {"device": "nvme", "nvme_path": "NVME"},
    "offload_optimizer": {"device": "nvme", "nvme_path": "NVME"},},
  OFFLOADPP
}"""


@pytest.mark.parametrize("block", [True, False])
def test_hjson_and_base64_configs_are_read_as_deepspeed_reads_them(tmp_path, monkeypatch, block):
    (tmp_path / "nvme").mkdir()
    text = HJSON.replace("NVME", str(tmp_path / "nvme"))
    text = text.replace("OFFLOADPP", '"offloadpp": {"enabled": true},' if block else "")
    path = tmp_path / "ds.json"
    path.write_text(text)
    import deepspeed

    seen = []
    monkeypatch.setattr(
        deepspeed, "initialize", lambda **kw: seen.append(kw) or ("deepspeed", None, None, None)
    )
    for config in (str(path), base64.urlsafe_b64encode(text.encode()).decode()):
        engine, *_ = offloadpp.initialize(model=tiny_gpt2(), config=config)
        if block:
            assert type(engine).__name__ == "OffloadppEngine"
            assert engine.optimizer.param_groups[0]["lr"] == 1e-3
            engine.close()
        else:  # DeepSpeed gets the config exactly as given
            assert engine == "deepspeed" and seen[-1]["config"] == config
