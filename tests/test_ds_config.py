"""The `offloadpp` block: defaults from the ZeRO-Infinity settings beside it, strict validation."""

import json

import pytest

from offloadpp.integrations.deepspeed.config import (
    OffloadppConfigError,
    load_ds_config,
    offloadpp_enabled,
    parse_block,
    parse_bytes,
)


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
    assert block.nvme_paths == ["/nvme/a"]
    assert block.io.block_size_bytes == 262144
    assert block.io.queue_depth == 16
    assert block.io.num_threads == 2


def test_explicit_values_win_over_zero_infinity_ones():
    cfg = _zero_infinity()
    cfg["offloadpp"] = {"enabled": True, "nvme_paths": ["/x", "/y"], "io": {"queue_depth": 4}}
    block = parse_block(cfg)
    assert block.nvme_paths == ["/x", "/y"]
    assert block.io.queue_depth == 4
    assert block.io.block_size_bytes == 262144


def test_distinct_param_and_optimizer_paths_are_both_used():
    cfg = _zero_infinity()
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = "/nvme/b"
    cfg["offloadpp"] = {"enabled": True}
    assert parse_block(cfg).nvme_paths == ["/nvme/a", "/nvme/b"]


@pytest.mark.parametrize(
    "block, field",
    [
        ({"enabled": True, "nvme_pth": ["/x"]}, "offloadpp.nvme_pth"),
        ({"enabled": True, "prefetch_depth": 0}, "offloadpp.prefetch_depth"),
        ({"enabled": True, "device_budget": "lots"}, "offloadpp.device_budget"),
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


def test_shipped_configs_are_valid_pairs():
    import glob
    import os

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
