"""Every key of the pinned DeepSpeed's config is honoured, ignored on purpose or refused
(offloadpp/integrations/deepspeed/keys.py), has a row in docs/deepspeed.md, and each refused key
gets its own error at initialize.

The keys are not copied from DeepSpeed's documentation: they are read from DeepSpeed itself.
DeepSpeedConfig parses a config dict that records every key looked up in it; each block found
that way is then parsed again with a recording dict inside, so its own keys are recorded too,
and where a block is a pydantic model (zero_optimization, fp16, ...) the model's fields (and
their nested models') are listed. A DeepSpeed upgrade that reads a new key fails this test
until the key is classified.
"""

from __future__ import annotations

import collections.abc
import copy
import re
import typing
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
from pydantic import BaseModel  # noqa: E402

from offloadpp.integrations.deepspeed import OffloadppConfigError  # noqa: E402
from offloadpp.integrations.deepspeed.keys import HONOURED, IGNORED, KEYS, REFUSED, check_keys, entry  # noqa: E402

PROBE = "__offloadpp_probe__"
DOC = Path(__file__).resolve().parent.parent / "docs" / "deepspeed.md"
# Blocks DeepSpeed reads only once a sibling selects them (an optimizer type, a scheduler type).
SELECTED = {"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR"}}


class _Keys(collections.abc.KeysView):
    def __contains__(self, k):
        self._mapping._seen(k)
        return dict.__contains__(self._mapping, k)


class _Recording(dict):
    def __init__(self, path: str, log: set, *args):
        super().__init__(*args)
        self.path, self.log = path, log

    def _seen(self, k):
        if k != PROBE:
            self.log.add(self.path + str(k))

    def get(self, k, default=None):
        self._seen(k)
        return super().get(k, default)

    def __getitem__(self, k):
        self._seen(k)
        return super().__getitem__(k)

    def __contains__(self, k):
        self._seen(k)
        return super().__contains__(k)

    def keys(self):
        return _Keys(self)


def _parse(cfg, models: list) -> None:
    """DeepSpeedConfig(cfg), noting each pydantic model built from a block holding the probe key."""
    from deepspeed.runtime.config import DeepSpeedConfig

    original = BaseModel.__init__

    def spy(self, *args, **kwargs):
        if PROBE in kwargs:
            models.append(type(self))
        return original(self, *args, **kwargs)

    BaseModel.__init__ = spy
    try:
        DeepSpeedConfig(cfg)
    except Exception:
        pass  # removed features raise, a probe key fails validation: what was read is recorded
    finally:
        BaseModel.__init__ = original


def _fields(model, prefix: str) -> set:
    out = set()
    for name, f in model.model_fields.items():
        key = prefix + (f.alias or name)
        out.add(key)
        for t in (f.annotation, *typing.get_args(f.annotation)):
            if isinstance(t, type) and issubclass(t, BaseModel):
                out |= _fields(t, key + ".")
    return out


def deepspeed_keys() -> set:
    """Every key the pinned DeepSpeed's DeepSpeedConfig reads (see the module's docstring)."""
    log: set = set()
    _parse(_Recording("", log, {"train_batch_size": 1}), [])
    keys = set(log)
    for top in sorted(log):
        seen, models = set(), []
        cfg = _Recording("", seen, {"train_batch_size": 1})
        dict.__setitem__(cfg, top, _Recording(top + ".", seen, {PROBE: 1, **SELECTED.get(top, {})}))
        _parse(cfg, models)
        keys |= {k for k in seen if k.startswith(top + ".")}
        if models:
            keys |= _fields(models[0], top + ".")
    return keys


@pytest.fixture(scope="module")
def ds_keys() -> set:
    return deepspeed_keys()


def test_the_enumeration_finds_deepspeeds_blocks(ds_keys):
    # a sanity check of the recording itself: known keys of dict-read and model-read blocks
    for k in ("aio.block_size", "zero_optimization.offload_param.buffer_count", "fp16.consecutive_hysteresis",
              "optimizer.params", "scheduler.params", "flops_profiler.enabled", "train_batch_size"):  # fmt: skip
        assert k in ds_keys, k
    assert len(ds_keys) > 300


def test_every_deepspeed_key_is_classified(ds_keys):
    missing = sorted(k for k in ds_keys if entry(k) is None)
    assert not missing, f"classify these in integrations/deepspeed/keys.py and docs/deepspeed.md: {missing}"
    assert {e.status for e in KEYS.values()} == {HONOURED, IGNORED, REFUSED}


def test_every_classified_key_is_deepspeeds_or_ours(ds_keys):
    extra = sorted(
        k
        for k in KEYS
        if k not in ds_keys
        and not (k.endswith(".*") and (k[:-2] in ds_keys or any(d.startswith(k[:-1]) for d in ds_keys)))
        and k not in ("offloadpp", "sequence_parallel_size")  # ours; read by DeepSpeedConfig before parsing
    )
    assert not extra, f"not keys of the pinned DeepSpeed: {extra}"


def test_every_key_has_a_row_in_the_docs():
    text = DOC.read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_.*]+)` \| (honoured|ignored|refused)", text, flags=re.M))
    for key, e in KEYS.items():
        assert key in rows, f"docs/deepspeed.md has no row for {key!r}"
        assert rows[key] == e.status, f"docs/deepspeed.md says {key!r} is {rows[key]}, keys.py {e.status}"


def _set(cfg: dict, path: str, value) -> dict:
    node = cfg
    parts = path.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return cfg


REFUSED_KEYS = sorted(k for k, e in KEYS.items() if e.status == REFUSED and not k.endswith(".*"))


@pytest.mark.parametrize("key", REFUSED_KEYS)
def test_each_refused_key_gets_its_own_error(key):
    e = KEYS[key]
    bad = (
        {"enabled": True} if e.allowed is None else (7 if not isinstance(e.allowed[0], str) else "something")
    )
    if e.allowed is not None and bad in e.allowed:
        bad = 8
    cfg = _set({"train_batch_size": 2}, key, bad)
    with pytest.raises(OffloadppConfigError, match=re.escape(key) + ": .* not supported by offloadpp"):
        check_keys(cfg, OffloadppConfigError)
    if e.allowed is not None:  # the default passes
        check_keys(_set({"train_batch_size": 2}, key, e.allowed[0]), OffloadppConfigError)


def test_ignored_keys_are_dropped_before_deepspeed_parses():
    cfg = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "offload_param": {"device": "nvme",
                              "nvme_path": "/x", "buffer_count": -1}},
        "autotuning": {"enabled": False, "fast": "whatever"},
    }  # fmt: skip
    out = check_keys(copy.deepcopy(cfg), OffloadppConfigError)
    assert out["zero_optimization"] == {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}
    assert out["autotuning"] == {"enabled": False}


def test_unknown_keys_and_left_over_auto_are_named():
    with pytest.raises(
        OffloadppConfigError, match="gradient_acumulation_steps: not a key .* 'gradient_accumulation_steps'"
    ):
        check_keys({"gradient_acumulation_steps": 2}, OffloadppConfigError)
    with pytest.raises(
        OffloadppConfigError,
        match="zero_optimization.offload_param.nvme_pth: .* 'zero_optimization.offload_param.nvme_path'",
    ):
        check_keys({"zero_optimization": {"offload_param": {"nvme_pth": "/x"}}}, OffloadppConfigError)
    with pytest.raises(OffloadppConfigError, match='train_micro_batch_size_per_gpu: "auto" is filled in by'):
        check_keys({"train_micro_batch_size_per_gpu": "auto"}, OffloadppConfigError)
