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


class _Delete:
    """The key removed from the config (a stable repr: pytest-xdist workers must agree on test ids)."""

    def __repr__(self) -> str:
        return "<deleted>"


_DELETE = _Delete()

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
    ("csv_monitor.job_nam", "run", r"csv_monitor\.job_nam: not a key .*'csv_monitor\.job_name'"),
    (
        "gradient_acumulation_steps",
        2,
        r"gradient_acumulation_steps: not a key .*'gradient_accumulation_steps'",
    ),
    ("offloadpp.enabled", "true", r"offloadpp\.enabled: expected true or false"),
    ("offloadpp.nvme_paths", ["/x", "/x"], r"offloadpp\.nvme_paths"),
    ("scheduler.params.warmup_num_stepz", 3, r"scheduler\.params: DeepSpeed's WarmupLR refuses them"),
    ("pipeline", {"stages": 2}, r"pipeline: .* pipeline parallelism is not supported"),
    (
        "scheduler.type",
        _DELETE,
        r"scheduler\.type: the scheduler block names no type, so no scheduler would run",
    ),
    (
        "offloadpp.device_budget_bytes",
        float("inf"),
        r"offloadpp\.device_budget_bytes: expected a byte count, got inf",
    ),
    (
        "offloadpp.host_budget_bytes",
        "1e999",
        r"offloadpp\.host_budget_bytes: expected a byte count, got '1e999'",
    ),
    ("offloadpp.ssd_read_gbps", float("inf"), r"offloadpp\.ssd_read_gbps: expected a number > 0"),
    # DeepSpeed's aio block is not applied, but a value no engine could run is named (issue 37)
    (
        "aio.queue_depth",
        -1,
        r"aio\.queue_depth: expected a whole number >= 1, got -1; .*offloadpp\.io\.queue_depth",
    ),
    ("aio.block_size", 0, r"aio\.block_size: expected a whole number >= 1, got 0"),
    ("aio.intra_op_parallelism", 1.5, r"aio\.intra_op_parallelism: expected a whole number >= 1, got 1\.5"),
    ("aio.single_submit", "false", r"aio\.single_submit: expected true or false, got 'false'"),
]


@pytest.mark.parametrize("path, value, message", BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_config_is_refused_naming_the_key(tmp_path, path, value, message):
    cfg = _with(ds_config(tmp_path / "nvme"), path, value)
    if path == "offloadpp.nvme_paths":
        (tmp_path / "x").mkdir()
        cfg["offloadpp"]["nvme_paths"] = [str(tmp_path / "x")] * 2
    with pytest.raises(OffloadppConfigError, match=message):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)


# Blocks refused before anything runs, offloadpp's engine or DeepSpeed's: a block that is there is
# validated whole even when it is off (a typo in it must not be a silent DeepSpeed run).
BAD_BLOCKS = [
    ({"Enabled": True}, r"offloadpp\.Enabled: unknown key; did you mean 'enabled'\?"),
    (None, r'offloadpp: null; write \{"enabled": true\} for offloadpp\'s engine'),
    (
        {"enabled": False, "device_budget_bytes": "junk"},
        r"offloadpp\.device_budget_bytes: cannot read 'junk' as a size",
    ),
    (
        {"enabled": False, "prefetch_depth": -1},
        r"offloadpp\.prefetch_depth: Input should be greater than or equal to 0",
    ),
    (
        {"enabled": False, "io": {"queue_dept": 8}},
        r"offloadpp\.io\.queue_dept: unknown key; did you mean 'queue_depth'",
    ),
    # settings without the switch: not DeepSpeed's silent "off" (issue 37; docs/deepspeed.md)
    (
        {"device_budget_bytes": "1GiB", "plan": "auto"},
        r"offloadpp: the block sets 'device_budget_bytes', 'plan' but has no \"enabled\" key.* add "
        r'"enabled": true to train with offloadpp, or "enabled": false for DeepSpeed\'s own engine',
    ),
    ({}, r'offloadpp: the block is empty but has no "enabled" key'),
]


@pytest.mark.parametrize("block, message", BAD_BLOCKS, ids=[repr(b) for b, _ in BAD_BLOCKS])
def test_a_bad_block_is_refused_even_when_it_is_off(tmp_path, monkeypatch, block, message):
    import deepspeed

    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: pytest.fail("ran DeepSpeed on a bad block"))
    cfg = ds_config(tmp_path / "nvme")
    cfg["offloadpp"] = block
    with pytest.raises(OffloadppConfigError, match=message):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)


def test_an_off_block_leaves_the_zero_infinity_settings_to_deepspeed(tmp_path, monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: ("deepspeed", None, None, None))
    cfg = ds_config(tmp_path / "nvme", aio={"block_size": "odd", "queue_depth": 8})
    cfg["offloadpp"] = {"enabled": False, "device_budget_bytes": "1GiB"}
    assert offloadpp.initialize(model=tiny_gpt2(), config=cfg)[0] == "deepspeed"


@pytest.mark.parametrize(
    "key, value, what",
    [
        ("device_budget_bytes", 1e30, r"RAM \(the CPU is the device\)"),
        ("host_budget_bytes", "999TiB", r"RAM"),
        ("activations", {"host_budget_bytes": "999TiB"}, r"RAM"),
    ],
)
def test_a_budget_above_what_the_machine_has_is_refused(tmp_path, key, value, what):
    import psutil

    from offloadpp.planner import PlanError, fmt_bytes

    cfg = ds_config(tmp_path / "nvme")
    cfg["offloadpp"][key] = value
    name = key if key != "activations" else "activations.host_budget_bytes"
    total = fmt_bytes(psutil.virtual_memory().total)
    with pytest.raises(
        PlanError, match=rf"^{name}: \d+ bytes \(.*\) is more than this machine has: {total} of {what}"
    ):
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


@pytest.mark.parametrize(
    "content, message",
    [
        (bytes(range(256)), r"bad\.json' is not a JSON text file: byte 0x80 at offset 128 is not UTF-8"),
        (b"", r"bad\.json' is empty; a DeepSpeed config is a JSON object"),
        (b"  // only a comment\n", r"bad\.json' is empty"),
        (
            b"train_micro_batch_size_per_gpu: 2\noptimizer:\n  type: Adam\n",
            r"bad\.json' is not a JSON object: it starts with 'train_micro_batch_si', not '\{' \(it reads like YAML",
        ),
    ],
    ids=["binary", "empty", "comment only", "yaml"],
)
def test_a_config_file_that_is_no_json_object_is_named_on_either_engine(
    tmp_path, monkeypatch, content, message
):
    import deepspeed

    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: pytest.fail("DeepSpeed got a bad config file"))
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    with pytest.raises(OffloadppConfigError, match=message):
        offloadpp.initialize(model=tiny_gpt2(), config=str(bad))


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


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("block", [True, False])
def test_a_config_json_dump_wrote_with_nan_names_the_key_and_value(tmp_path, monkeypatch, indent, block):
    """json.dump writes float('nan') as NaN, which JSON has not: refused naming the key and the
    value, on either engine (was: a parse position at the end of the line, or with indent the
    text "NaN," read as the value)."""
    import deepspeed

    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: pytest.fail("DeepSpeed got a NaN config"))
    cfg = ds_config(tmp_path / "nvme", gradient_clipping=float("nan"))
    cfg["optimizer"]["params"]["betas"] = [0.9, float("inf")]
    cfg["offloadpp"]["enabled"] = block
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg, indent=indent))
    with pytest.raises(
        OffloadppConfigError,
        match=r"ds\.json': gradient_clipping: NaN, optimizer\.params\.betas\[1\]: Infinity are not numbers JSON "
        r"can hold \(json\.dump writes float\('nan'\)",
    ):
        offloadpp.initialize(model=tiny_gpt2(), config=str(path))


@pytest.mark.parametrize("block", [True, False])
def test_a_dict_config_with_nan_names_the_key_and_value(tmp_path, monkeypatch, block):
    """A dict config goes to DeepSpeed as it is, where a NaN clipping or beta would train on
    without a word: refused naming each key, on either engine; infinity is left alone (the
    Trainer's steps_per_print)."""
    import deepspeed

    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: pytest.fail("DeepSpeed got a NaN config"))
    cfg = ds_config(tmp_path / "nvme", gradient_clipping=float("nan"))
    cfg["optimizer"]["params"]["betas"] = (0.9, float("nan"))
    cfg["steps_per_print"] = float("inf")  # what transformers' Trainer passes: never, a value
    cfg["offloadpp"]["enabled"] = block
    with pytest.raises(
        OffloadppConfigError,
        match=r"^DeepSpeed config \(dict\): gradient_clipping: NaN, optimizer\.params\.betas\[1\]: NaN are not "
        r"numbers; write a number",
    ):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)


def test_a_misspelt_nvme_path_is_named_as_an_unknown_key(tmp_path):
    """ "nvme_pth" in both offload blocks: the unknown key and the right name (was: "no directory
    for swap files")."""
    cfg = ds_config(tmp_path / "nvme")
    for sub in cfg["zero_optimization"].values():
        if isinstance(sub, dict):
            sub["nvme_pth"] = sub.pop("nvme_path")
    with pytest.raises(
        OffloadppConfigError,
        match=r"zero_optimization\.offload_(optimizer|param)\.nvme_pth: not a key of the pinned DeepSpeed's config; "
        r"did you mean 'zero_optimization\.offload_(optimizer|param)\.nvme_path'\?",
    ):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)
