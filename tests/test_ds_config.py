"""The `offloadpp` block: defaults from the ZeRO-Infinity settings beside it, strict validation."""

import json

import pytest

from offloadpp.integrations.deepspeed.config import (
    DS_OWNED,
    OffloadppConfigError,
    load_ds_config,
    offloadpp_enabled,
    parse_block,
    parse_bytes,
)
from offloadpp.io import IOConfig
from offloadpp.planner.io_settings import io_set_of


def _zero_infinity(nvme="/nvme/a"):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
        "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2},
    }


def test_defaults_come_from_zero_infinity_settings():
    cfg = _zero_infinity()
    cfg["offloadpp"] = {"enabled": True}
    block = parse_block(cfg)
    assert block.enabled
    assert block.nvme_paths == ("/nvme/a",)
    # DeepSpeed's aio block is not applied: it is tuned for ZeRO-Infinity's swapper (issue 21)
    assert block.io == IOConfig() and block.io.model_fields_set == set()


def test_explicit_values_win_over_zero_infinity_ones():
    cfg = _zero_infinity()
    cfg["offloadpp"] = {"enabled": True, "nvme_paths": ["/x", "/y"], "io": {"queue_depth": 4}}
    block = parse_block(cfg)
    assert block.nvme_paths == ("/x", "/y")
    assert block.io.queue_depth == 4
    assert block.io.block_size_bytes == IOConfig().block_size_bytes  # not the aio block's
    assert io_set_of(block.io) == {"queue_depth": 4}  # what the resolve stage lets win


def test_distinct_param_and_optimizer_paths_are_both_used():
    cfg = _zero_infinity()
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = "/nvme/b"
    cfg["offloadpp"] = {"enabled": True}
    assert parse_block(cfg).nvme_paths == ("/nvme/a", "/nvme/b")


@pytest.mark.parametrize(
    "block, field",
    [
        ({"enabled": True, "nvme_pth": ["/x"]}, "offloadpp.nvme_pth"),
        ({"enabled": True, "prefetch_depth": -1}, "offloadpp.prefetch_depth"),
        ({"enabled": True, "prefetch_depth": "2"}, "offloadpp.prefetch_depth"),
        ({"enabled": True, "device_budget_bytes": "lots"}, "offloadpp.device_budget_bytes"),
        ({"enabled": True, "activations": {"budget_bytes": "lots"}}, "offloadpp.activations.budget_bytes"),
        ({"enabled": True, "activations": {"policy": "disk"}}, "offloadpp.activations.policy"),
        ({"enabled": True, "fill_gaps": "yes"}, "offloadpp.fill_gaps"),
        ({"enabled": True, "io": {"backend": "spdk"}}, "offloadpp.io.backend"),
        ({"enabled": True, "nvme_paths": []}, "offloadpp.nvme_paths"),
    ],
)
def test_bad_keys_and_values_name_the_field(block, field):
    cfg = _zero_infinity()
    cfg["offloadpp"] = block
    with pytest.raises(OffloadppConfigError, match=field.replace(".", r"\.")):
        parse_block(cfg)


def test_enabled_without_any_nvme_path_is_an_error():
    with pytest.raises(OffloadppConfigError, match="nvme_paths"):
        parse_block({"train_micro_batch_size_per_gpu": 1, "offloadpp": {"enabled": True}})


def test_enabled_flag():
    assert not offloadpp_enabled(_zero_infinity())
    assert not offloadpp_enabled({**_zero_infinity(), "offloadpp": {"enabled": False}})
    assert offloadpp_enabled({**_zero_infinity(), "offloadpp": {"enabled": True}})
    for bad in ("false", "true", 1, None):  # a string must not switch anything on or off
        with pytest.raises(OffloadppConfigError, match="offloadpp.enabled: expected true or false"):
            offloadpp_enabled({**_zero_infinity(), "offloadpp": {"enabled": bad}})


def test_unknown_keys_suggest_the_close_one():
    cfg = {**_zero_infinity(), "offloadpp": {"enabled": True, "device_budget": "8GiB"}}
    with pytest.raises(
        OffloadppConfigError, match="offloadpp.device_budget: unknown key; did you mean 'device_budget_bytes'"
    ):
        parse_block(cfg)
    cfg = {**_zero_infinity(), "offloadpp": {"enabled": True, "activations": {"polcy": "ssd"}}}
    with pytest.raises(
        OffloadppConfigError, match="offloadpp.activations.polcy: unknown key; did you mean 'policy'"
    ):
        parse_block(cfg)


@pytest.mark.parametrize("key", sorted(DS_OWNED))
def test_keys_deepspeed_owns_are_refused_naming_its_key(key):
    cfg = {**_zero_infinity(), "offloadpp": {"enabled": True, key: 1}}
    with pytest.raises(
        OffloadppConfigError, match=f"offloadpp.{key}: DeepSpeed's own config sets this; use "
    ):
        parse_block(cfg)


def test_every_setting_is_reachable_from_the_block(tmp_path):
    """Each Settings field (less DeepSpeed's) and each IOConfig field set in the block arrives in
    the RuntimeConfig the engine gets; "auto" leaves the default."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from offloadpp.integrations.deepspeed.build import runtime_config_from
    from offloadpp.io import IOConfig
    from offloadpp.planner import Settings

    values = {
        "device_budget_bytes": "1GiB", "host_budget_bytes": 3 << 30, "prefetch_depth": 1, "optim_prefetch_depth": 3,
        "fill_gaps": False, "adam_threads": 1, "units": [["transformer.wte", "transformer.wpe"], ["lm_head"]],
        "plan": "auto", "hardware_profile": "/hw.json", "model_profile": "/m.json", "seq_len": 77, "speculate": "off",
        "defer_updates": True, "collective_gbps": 12.5, "network_gbps": 3.0, "accumulation": "vertical",
        "activations": {"policy": "ssd", "overrides": {"embed": "keep"}, "budget_bytes": "64MiB",
                        "host_budget_bytes": "1GB", "prefetch_units": 1, "min_swap_bytes": "4KiB"},
    }  # fmt: skip
    io = {"backend": "threadpool", "block_size_bytes": "512KiB", "queue_depth": 4, "num_threads": 2,
          "o_direct": False, "checksum": False, "stripe_min_bytes": 0, "pin": False, "bounce_cache_bytes": "1MiB"}  # fmt: skip
    missing = set(Settings.model_fields) - set(values) - set(DS_OWNED)
    assert not missing, f"test does not cover {missing}"
    assert set(io) == set(IOConfig.model_fields)
    cfg = _zero_infinity(str(tmp_path))
    cfg["offloadpp"] = {"enabled": True, **values, "io": io, "ssd_read_gbps": 1.5, "ssd_write_gbps": 2.5}
    block = parse_block(cfg)
    rc = runtime_config_from(DeepSpeedConfig(cfg), block, device="cpu")
    s = rc.settings
    assert s.device_budget_bytes == 1 << 30 and s.host_budget_bytes == 3 << 30 and s.seq_len == 77
    assert (s.prefetch_depth, s.optim_prefetch_depth, s.fill_gaps, s.adam_threads) == (1, 3, False, 1)
    assert s.units == (("transformer.wte", "transformer.wpe"), ("lm_head",)) and s.plan == "auto"
    assert (s.hardware_profile, s.model_profile, s.speculate) == ("/hw.json", "/m.json", "off")
    assert s.accumulation == "vertical"
    assert s.defer_updates and s.deferred_update
    a = s.activations
    assert (a.policy, dict(a.overrides), a.budget_bytes, a.host_budget_bytes) == (
        "ssd",
        {"embed": "keep"},
        64 << 20,
        10**9,
    )
    assert (a.prefetch_units, a.min_swap_bytes) == (1, 4096)
    assert rc.io == IOConfig(backend="threadpool", block_size_bytes=512 << 10, queue_depth=4, num_threads=2,
                             o_direct=False, checksum=False, stripe_min_bytes=0, pin=False, bounce_cache_bytes=1 << 20)  # fmt: skip
    assert (rc.ssd_read_gbps, rc.ssd_write_gbps) == (1.5, 2.5)
    # from DeepSpeed's own keys
    assert s.micro_batch == 2 and s.offload_params and s.offload_optimizer and s.compute_dtype == "fp32"
    # "auto" everywhere: the defaults (never the aio block's io); for `plan`, "auto" is the
    # cost-model planner itself. DeepSpeed's gradient_clipping defaults to 1.0.
    cfg["offloadpp"] = {"enabled": True, **{k: "auto" for k in values}, "io": {k: "auto" for k in io}}
    rc = runtime_config_from(DeepSpeedConfig(cfg), parse_block(cfg), device="cpu")
    assert rc.settings == Settings(micro_batch=2, plan="auto", gradient_clipping=1.0)
    assert rc.io == IOConfig() and rc.io_set() == {}


def test_missing_nvme_path_is_an_error_not_created(tmp_path):
    from offloadpp.integrations.deepspeed.build import swap_dirs

    with pytest.raises(OffloadppConfigError, match="does not exist; create it or mount the SSD"):
        swap_dirs([str(tmp_path / "typo")])
    assert not (tmp_path / "typo").exists()
    assert swap_dirs([str(tmp_path)]) == (str(tmp_path / "offloadpp"),)


@pytest.mark.parametrize(
    "text, expected",
    [(1024, 1024), ("1GiB", 2**30), ("8 GB", 8 * 10**9), ("1.5MiB", 3 * 2**19), (2e9, 2 * 10**9)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["eight", "-1", -5, "3 parsecs", True])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_load_from_path_and_args(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_zero_infinity()))
    assert load_ds_config(str(path))["aio"]["queue_depth"] == 16

    class Args:
        deepspeed_config = str(path)

    assert load_ds_config(None, Args())["train_micro_batch_size_per_gpu"] == 2
    with pytest.raises(OffloadppConfigError, match="does not exist"):
        load_ds_config(str(tmp_path / "missing.json"))


def _as_trainer_fills_it(cfg: dict) -> dict:
    filled = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "enabled": False}  # fmt: skip

    def fill(node):
        for k, v in node.items():
            if isinstance(v, dict):
                fill(v)
            elif v == "auto":
                node[k] = filled[k]
        return node

    return fill(cfg)


def test_shipped_configs_are_valid_pairs():
    import glob
    import os

    from offloadpp.integrations.deepspeed.build import parse_ds_config

    root = os.path.join(os.path.dirname(__file__), "..", "ds_configs")
    pairs = sorted(glob.glob(os.path.join(root, "*.offloadpp.json")))
    assert pairs, "ds_configs/ has no offloadpp configs"
    for ours in pairs:
        theirs = ours.replace(".offloadpp.json", ".zero_infinity.json")
        assert os.path.exists(theirs), f"{ours} has no ZeRO-Infinity twin"
        a, b = json.load(open(ours)), json.load(open(theirs))
        assert offloadpp_enabled(a) and not offloadpp_enabled(b)
        a.pop("offloadpp")
        assert a == b, f"{ours} and {theirs} differ beyond the offloadpp block"
        parse_block(json.load(open(ours)))
        # every DeepSpeed key in it honoured or ignored, once Trainer has filled in its "auto"s
        parse_ds_config(_as_trainer_fills_it(json.load(open(ours))))


def test_every_block_key_is_documented():
    import os

    from offloadpp.integrations.deepspeed.config import block_keys

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "deepspeed.md")).read()
    keys = []
    for key, sub in block_keys().items():
        keys += [f"{key}.{k}" for k in sub.model_fields] if sub is not None else [key]
    missing = [k for k in keys if f"`{k}`" not in doc]
    assert not missing, f"docs/deepspeed.md does not document {missing}"


def test_the_aio_block_is_reported_as_not_applied():
    from offloadpp.integrations.deepspeed.config import aio_not_applied

    line = aio_not_applied(_zero_infinity(), IOConfig(queue_depth=4))
    assert "block_size=262144, queue_depth=16, intra_op_parallelism=2" in line and "not applied" in line
    assert "queue depth 4" in line  # what the store runs instead
    assert aio_not_applied({"aio": {"single_submit": False}}, IOConfig()) is None  # nothing of ours
    assert aio_not_applied({}, IOConfig()) is None
