"""The `"offloadpp"` block of a DeepSpeed JSON config, validated once, here.

The block is the run's Settings (planner/spec.py) with `"auto"` allowed for every key, plus what
only the runtime needs (`nvme_paths`, the `io` engine, the SSD rates for the step floor). It is
derived from those models, not copied: a field added to Settings or IOConfig is a key here.

    "auto" (or leaving a key out)   Settings' default, which for budgets and depths means the
                                    resolve stage decides (planner/resolve.py)
    "8GiB", 8589934592, 8e9         any key ending in `_bytes`

What DeepSpeed itself defines stays DeepSpeed's (parsed by its own DeepSpeedConfig, so the keys
keep their meaning) and fills the matching settings: `fp16`/`bf16` -> compute_dtype and
loss_scaling, `gradient_accumulation_steps`, `gradient_clipping`, `train_micro_batch_size_per_gpu`
-> micro_batch, `zero_optimization.offload_param/offload_optimizer` device "nvme" ->
offload_params/offload_optimizer, their `nvme_path`s -> nvme_paths. Setting one of those in the
block is refused with the DeepSpeed key to use instead. DeepSpeed's `aio` block is not applied:
it is tuned for ZeRO-Infinity's swapper, and the I/O settings come from the hardware profile
unless `offloadpp.io` sets them (planner/io_settings.py); aio_not_applied is the log line
(a WARNING), and check_aio refuses values no engine could run. The block must say "enabled"
(_refuse_no_switch's Note).
"""

from __future__ import annotations

import base64
import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from offloadpp.io import IOConfig
from offloadpp.planner import Settings

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip

# Settings that DeepSpeed's own keys fill: the block refuses them, naming the key to use.
DS_OWNED = {
    "compute_dtype": '"fp16": {"enabled": true} or "bf16": {"enabled": true}',
    "loss_scaling": 'the "fp16" block (loss_scale, initial_scale_power, ...)',
    "gradient_accumulation_steps": '"gradient_accumulation_steps"',
    "gradient_clipping": '"gradient_clipping"',
    "micro_batch": '"train_micro_batch_size_per_gpu"',
    "offload_params": '"zero_optimization": {"offload_param": {"device": "nvme"}}',
    "offload_optimizer": '"zero_optimization": {"offload_optimizer": {"device": "nvme"}}',
}
# Keys of the block that are not Settings: the switch, and what only the runtime needs.
RUNTIME_KEYS = ("enabled", "nvme_paths", "io", "ssd_read_gbps", "ssd_write_gbps", "keep_swap")
# DeepSpeed's `aio` keys that name our io settings (ours <- theirs): reported as not applied.
AIO_KEYS = {
    "block_size_bytes": "block_size",
    "queue_depth": "queue_depth",
    "num_threads": "intra_op_parallelism",
}


def parse_bytes(value: Union[int, float, str]) -> int:
    """1073741824, 1e9, "1GiB", "8 GB" -> bytes. Raises ValueError naming the bad value."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"byte count must be >= 0, got {value!r}")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 8589934592, '8GiB' or '8GB'")
    number = float(m.group(1))
    if not math.isfinite(number):  # "1e999"
        raise ValueError(f"expected a byte count, got {value!r}")
    return int(number * _UNITS[(m.group(2) or "").lower()])


class OffloadppConfigError(ValueError):
    """A bad `offloadpp` block or a DeepSpeed config offloadpp cannot run; names the field."""


def block_keys() -> dict[str, Any]:
    """Every key the block takes, with its model: Settings' fields (less DeepSpeed's) and the
    runtime's. Nested models (activations, io) take their own fields' keys."""
    keys: dict[str, Any] = {k: None for k in RUNTIME_KEYS}
    keys["io"] = IOConfig
    for name, f in Settings.model_fields.items():
        if name not in DS_OWNED:
            ann = f.annotation
            keys[name] = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return keys


@dataclass(frozen=True)
class OffloadppBlock:
    """The block, validated: what it sets (everything else is "auto")."""

    enabled: bool = False
    nvme_paths: Optional[tuple[str, ...]] = None
    io: IOConfig = IOConfig()  # the block's io keys; those it sets are its model_fields_set
    settings: dict = field(default_factory=dict)  # Settings keys the block sets (JSON values)
    ssd_read_gbps: Optional[float] = None
    ssd_write_gbps: Optional[float] = None
    keep_swap: bool = False  # leave the swap files on disk at close (RuntimeConfig.keep_swap)


def load_ds_config(config: Union[str, os.PathLike, dict, None], args: Any = None) -> dict:
    """The DeepSpeed config as a dict, from what deepspeed.initialize accepts: a dict, the path of
    a JSON file (read as hjson, as DeepSpeed does: comments and trailing commas are fine, a
    duplicate key is not), a base64-encoded JSON string, or `args.deepspeed_config` (or the old
    `args.deepscale_config`). Errors name the file and what is wrong."""
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise OffloadppConfigError(
            "two DeepSpeed configs: args.deepspeed_config and config=...; pass one (DeepSpeed refuses this too)"
        )
    config = config if config is not None else from_args
    if config is None:
        raise OffloadppConfigError("no DeepSpeed config: pass config=... or args.deepspeed_config")
    if isinstance(config, dict):
        _no_nan_in_dict(config)
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise OffloadppConfigError(
            f"DeepSpeed config: expected a dict, a file path or base64 JSON, got a {type(config).__name__}"
        )
    path = os.fspath(config)
    if os.path.exists(path):
        where = f"DeepSpeed config file {path!r}"
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise OffloadppConfigError(f"{where}: cannot read it: {e.strerror}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise OffloadppConfigError(
                f"{where} is not a JSON text file: byte {data[e.start]:#04x} at offset {e.start} is not UTF-8 "
                "(a binary file?)"
            ) from None
    else:
        try:
            text = base64.urlsafe_b64decode(path).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            raise OffloadppConfigError(
                f"DeepSpeed config file {path!r} does not exist (nor is it base64-encoded JSON)"
            ) from None
        where = "DeepSpeed config (base64)"
    return _parse_text(text, where)


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise OffloadppConfigError(f"key {k!r} appears twice")
        seen[k] = v
    return seen


def _parse_text(text: str, where: str) -> dict:
    import hjson

    # hjson takes a text without braces as an object ("key: value" lines), so a YAML file reads
    # as a config of strange keys, and an empty one as {}: DeepSpeed would then fail on
    # something unrelated. DeepSpeed's configs are JSON objects: the text must start with "{".
    body = _without_comments(text)
    if not body:
        raise OffloadppConfigError(f"{where} is empty; a DeepSpeed config is a JSON object {{...}}")
    if body[0] not in "{[":  # a list is refused below, as a list
        yaml = " (it reads like YAML: DeepSpeed takes JSON)" if re.match(r"^[\w.-]+\s*:", body) else ""
        raise OffloadppConfigError(
            f"{where} is not a JSON object: it starts with {body[:20]!r}, not '{{'{yaml}"
        )
    try:
        value = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except OffloadppConfigError as e:
        raise OffloadppConfigError(f"{where}: {e}") from None
    except hjson.HjsonDecodeError as e:
        _no_non_finite(text, None, where)  # (what json.dump writes for nan and inf: named, not a position)
        raise OffloadppConfigError(
            f"{where} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    if not isinstance(value, dict):
        raise OffloadppConfigError(f"{where}: expected a JSON object of keys, got a {type(value).__name__}")
    _no_non_finite(text, value, where)
    return value


# json.dump writes float('nan') and float('inf') as these bare words, which JSON does not have.
_NON_FINITE = re.compile(r"^\s*([-+]?(?:NaN|Infinity))\s*,?\s*$")


def _non_finite(value, parsed: bool) -> list[tuple[str, str]]:
    """(key path, word) of each NaN or infinity in `value`: floats where a parser (or the caller)
    made them, or, where hjson read a bare word as text (`parsed` False), the text "NaN," etc."""
    found: list[tuple[str, str]] = []

    def walk(v, path: str) -> None:
        if isinstance(v, dict):
            for k, sub in v.items():
                walk(sub, f"{path}.{k}" if path else str(k))
        elif isinstance(v, (list, tuple)):
            for i, sub in enumerate(v):
                walk(sub, f"{path}[{i}]")
        elif parsed and isinstance(v, float) and not math.isfinite(v):
            found.append((path, {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[repr(v)]))
        elif not parsed and isinstance(v, str) and _NON_FINITE.match(v):
            found.append((path, _NON_FINITE.match(v).group(1)))

    walk(value, "")
    return found


def _not_numbers(found: list[tuple[str, str]]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in found) + (
        " is not a number" if len(found) == 1 else " are not numbers"
    )


def _no_non_finite(text: str, value: Optional[dict], where: str) -> None:
    """Note: NaN and Infinity. json.dump writes float('nan') as the bare word NaN (Infinity,
    -Infinity), which JSON has no room for; DeepSpeed's parser (hjson) then either fails with a
    position at the end of the line or, where the value ends its line, reads the word as the
    text "NaN," and goes on. Either way the config is refused naming the key and the value:
    Python's json reads them (when the text is plain JSON) for the keys; otherwise each word
    hjson read as text is found in `value`."""
    try:
        found = _non_finite(json.loads(text), True)
    except ValueError:  # not plain JSON (comments, trailing commas): what hjson read as text
        if value is not None:
            found = _non_finite(value, False)
        else:  # neither parser read it: the bare words after a key
            found = re.findall(r'"([^"\n]+)"\s*:\s*([-+]?(?:NaN|Infinity))\b', text)
    if found:
        raise OffloadppConfigError(
            f"{where}: {_not_numbers(found)} JSON can hold (json.dump writes float('nan') and float('inf') so; "
            "DeepSpeed would misread it); write a finite number, or leave the key out for its default"
        )


def _no_nan_in_dict(config: dict) -> None:
    """A config passed as a dict reaches DeepSpeed as it is, where a NaN setting (gradient_clipping,
    lr, a beta) trains on without a word and every weight turns NaN: refused naming each key.
    Infinity is a value here, not a misread word: transformers' Trainer passes steps_per_print
    inf to mean never (a file cannot hold it: _no_non_finite). The offloadpp block's own fields
    say what they expect (validate_settings), so only DeepSpeed's keys are looked at here."""
    found = [(k, v) for k, v in _non_finite({k: v for k, v in config.items() if k != "offloadpp"}, True)
             if v == "NaN"]  # fmt: skip
    if found:
        raise OffloadppConfigError(
            f"DeepSpeed config (dict): {_not_numbers(found)}; write a number, or leave the key out for its default"
        )


def _without_comments(text: str) -> str:
    """The text from its first character that is not blank or in a leading comment (hjson
    allows #, // and /* */ comments, as DeepSpeed reads configs)."""
    body = text.lstrip("\ufeff")
    while True:
        body = body.lstrip()
        if body.startswith("#") or body.startswith("//"):
            body = body.partition("\n")[2]
        elif body.startswith("/*"):
            body = body.partition("*/")[2]
        else:
            return body


def check_block_name(ds_config: dict) -> None:
    """A key close to "offloadpp" at the top level, without an "offloadpp" key, is a misspelt
    block: DeepSpeed ignores unknown top-level keys and would train with ZeRO-Infinity."""
    from offloadpp.integrations.deepspeed.keys import top_level_keys

    if "offloadpp" in ds_config:
        return
    known = top_level_keys()
    for key in ds_config:
        k = str(key)
        if k in known:
            continue
        squashed = re.sub(r"[^a-z]", "", k.lower())
        if (
            squashed.startswith("offloadpp")
            or difflib.SequenceMatcher(None, squashed, "offloadpp").ratio() >= 0.8
        ):
            raise OffloadppConfigError(
                f"{k!r}: not a DeepSpeed key, but close to 'offloadpp'; DeepSpeed would ignore it and train "
                "with ZeRO-Infinity. Name the block 'offloadpp' (or remove it)"
            )


def offloadpp_enabled(ds_config: dict) -> bool:
    """True when the block says `"enabled": true`. A block that is there is validated whole
    even when it is off (a typo in it, `"Enabled": true`, must not be a silent DeepSpeed run, nor
    a bad value wait until the day it is switched on); a value of `enabled` that is not a JSON
    bool is refused (a string "false" must not switch anything on)."""
    if "offloadpp" not in ds_config:
        return False
    block = ds_config["offloadpp"]
    _check_block_object(block)
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        raise OffloadppConfigError(f"offloadpp.enabled: expected true or false, got {enabled!r}")
    if not enabled:
        # the block's own keys only: the ZeRO-Infinity settings beside it are DeepSpeed's to check
        parse_block({"offloadpp": block})
        if "enabled" not in block:
            _refuse_no_switch(block)
    return enabled


def _refuse_no_switch(block: dict) -> None:
    """Note: a block without "enabled". DeepSpeed's own blocks (fp16, bf16, the monitors, ...)
    are off unless they say `"enabled": true`, silently. Followed here, a block written to set
    offloadpp's budgets whose switch was forgotten would train with ZeRO-Infinity without a word:
    the silent fallback the misspelt-name checks exist to prevent, found hours later as a slow
    run or an out-of-memory. Nothing is lost by asking: either value is one line, and an explicit
    `"enabled": false` (a config shared by both engines) keeps DeepSpeed's engine as before."""
    sets = ", ".join(repr(str(k)) for k in block)
    raise OffloadppConfigError(
        f'offloadpp: the block {"sets " + sets if sets else "is empty"} but has no "enabled" key, so it is '
        "not clear which engine you want (DeepSpeed's convention would turn it off and train with ZeRO-Infinity, "
        'ignoring it); add "enabled": true to train with offloadpp, or "enabled": false for DeepSpeed\'s own engine'
    )


def _check_block_object(block) -> None:
    if block is None:
        raise OffloadppConfigError(
            'offloadpp: null; write {"enabled": true} for offloadpp\'s engine, or {"enabled": false} (or no '
            "block) for DeepSpeed's own"
        )
    if not isinstance(block, dict):
        raise OffloadppConfigError(f"offloadpp: expected an object, got {block!r}")


def _unknown(where: str, key: str, known) -> OffloadppConfigError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; the keys are {sorted(known)}"
    return OffloadppConfigError(f"{where}{key}: unknown key{hint}")


def _auto_is_a_value(key: str, annotation) -> bool:
    """True where "auto" means something of its own (plan "auto": the cost-model planner; an
    activation policy "auto"): there it is passed on, not read as "leave the default"."""
    if key == "plan":
        return True
    if get_origin(annotation) is Literal:
        return "auto" in get_args(annotation)
    if get_origin(annotation) is Union:  # Optional[...]
        return any(_auto_is_a_value(key, a) for a in get_args(annotation) if a is not type(None))
    return False


def _clean(where: str, raw: dict, model) -> dict:
    """`raw` without "auto" values, byte sizes read, nested models cleaned; unknown keys refused."""
    known = block_keys() if model is None else model.model_fields
    out = {}
    for key, value in raw.items():
        if key not in known:
            raise _unknown(where, key, known)
        field_info = Settings.model_fields.get(key) if model is None else known[key]
        if isinstance(value, str) and value.strip().lower() == "auto":
            if field_info is None or not _auto_is_a_value(key, field_info.annotation):
                continue
        sub = known[key] if model is None else known[key].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                raise OffloadppConfigError(
                    f"{where}{key}: expected an object of {sorted(sub.model_fields)}, got {value!r}"
                )
            value = _clean(f"{where}{key}.", value, sub)
        elif key.endswith("_bytes") and isinstance(value, (str, float)):
            try:
                value = parse_bytes(value)
            except ValueError as e:
                raise OffloadppConfigError(f"{where}{key}: {e}") from None
        out[key] = value
    return out


def validation_error(prefix: str, e: ValidationError) -> OffloadppConfigError:
    return OffloadppConfigError(
        "; ".join(
            f"{prefix}{'.'.join(str(x) for x in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
            for err in e.errors()
        )
    )


def validate_settings(values: dict, where: str = "offloadpp.") -> Settings:
    """Settings from JSON values, strictly (a string is not a number or a bool), errors named."""
    try:
        return Settings.model_validate_json(json.dumps(values), strict=True)
    except ValidationError as e:
        raise validation_error(where, e) from None


def validate_io(values: dict, where: str = "offloadpp.io.") -> IOConfig:
    try:
        return IOConfig.model_validate_json(json.dumps(values), strict=True)
    except ValidationError as e:
        raise validation_error(where, e) from None


def parse_block(ds_config: dict) -> OffloadppBlock:
    """Validate the `offloadpp` block, filling the nvme paths it leaves "auto" from the
    ZeRO-Infinity settings beside it (never the aio block: aio_not_applied)."""
    raw = ds_config.get("offloadpp", {})
    _check_block_object(raw)
    for key in raw:
        if key in DS_OWNED:
            raise OffloadppConfigError(
                f"offloadpp.{key}: DeepSpeed's own config sets this; use {DS_OWNED[key]} instead"
            )
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise OffloadppConfigError(f"offloadpp.enabled: expected true or false, got {enabled!r}")
    clean = _clean("offloadpp.", raw, None)
    clean.pop("enabled", None)

    paths = clean.pop("nvme_paths", None)
    if paths is not None:
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise OffloadppConfigError(
                f"offloadpp.nvme_paths: expected a non-empty list of directories, got {paths!r}"
            )
    else:
        zero = ds_config.get("zero_optimization") or {}
        found = []
        for key in ("offload_optimizer", "offload_param"):
            sub = zero.get(key) if isinstance(zero, dict) else None
            path = sub.get("nvme_path") if isinstance(sub, dict) else None
            if path and str(path) not in found:
                found.append(str(path))
        paths = found or None
        if enabled and not paths and isinstance(zero, dict):
            _check_offload_keys(zero)  # a misspelt nvme_path is named as that, not as a missing path
    if enabled and not paths:
        raise OffloadppConfigError(
            "offloadpp.nvme_paths: no directory for swap files; set it, or zero_optimization."
            "offload_optimizer.nvme_path as for ZeRO-Infinity"
        )

    io_config = validate_io(clean.pop("io", {}))
    keep_swap = clean.pop("keep_swap", False)
    if not isinstance(keep_swap, bool):
        raise OffloadppConfigError(f"offloadpp.keep_swap: expected true or false, got {keep_swap!r}")
    rates = {k: clean.pop(k) for k in ("ssd_read_gbps", "ssd_write_gbps") if k in clean}
    for k, v in rates.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise OffloadppConfigError(f"offloadpp.{k}: expected a number > 0 (GB/s), got {v!r}")
    validate_settings(clean)  # errors now, at the boundary, naming the key
    return OffloadppBlock(
        enabled=enabled,
        nvme_paths=tuple(paths) if paths else None,
        io=io_config,
        settings=clean,
        keep_swap=keep_swap,
        **{k: float(v) for k, v in rates.items()},
    )


def _check_offload_keys(zero: dict) -> None:
    """The offload blocks' keys, by the key table (keys.py), so that `"nvme_pth"` is refused as
    an unknown key with the right name suggested."""
    from offloadpp.integrations.deepspeed.keys import check_keys

    subs = {k: zero[k] for k in ("offload_optimizer", "offload_param") if k in zero}
    check_keys({"zero_optimization": subs}, OffloadppConfigError)


# DeepSpeed's `aio` keys and what each must be (DeepSpeed reads them unchecked: get_aio_config).
AIO_WHOLE = ("block_size", "queue_depth", "intra_op_parallelism")
AIO_BOOL = ("single_submit", "overlap_events")


def check_aio(aio) -> None:
    """Refuses an `aio` value no engine could run (queue_depth -1, block_size 0, a string for
    a bool), naming the field. offloadpp does not apply the block (aio_not_applied), but a
    nonsense value in it is a mistake in the config, and kept it would break the day the same
    config runs on ZeRO-Infinity."""
    if not isinstance(aio, dict):
        return
    ours = {theirs: mine for mine, theirs in AIO_KEYS.items()}
    for key in AIO_WHOLE:
        v = aio.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise OffloadppConfigError(
                f"aio.{key}: expected a whole number >= 1, got {v!r}; fix it or remove the key (offloadpp does not "
                f"apply the aio block, offloadpp.io.{ours[key]} sets its own)"
            )
    for key in AIO_BOOL:
        v = aio.get(key)
        if v is not None and not isinstance(v, bool):
            raise OffloadppConfigError(f"aio.{key}: expected true or false, got {v!r}")


def aio_not_applied(ds_config: dict, io: IOConfig) -> Optional[str]:
    """The one log line saying that a DeepSpeed `aio` block's settings are not applied, with the
    ones the store runs (`io`), or None when the config has none of those keys."""
    aio = ds_config.get("aio")
    if not isinstance(aio, dict):
        return None
    given = [f"{theirs}={aio[theirs]}" for theirs in AIO_KEYS.values() if theirs in aio]
    if not given:
        return None
    return (
        f"DeepSpeed's aio block ({', '.join(given)}) is not applied: it is tuned for ZeRO-Infinity's swapper. "
        f"offloadpp's I/O runs with block {io.block_size_bytes >> 10} KiB, queue depth {io.queue_depth}, "
        f"{io.num_threads} thread(s) per directory (the hardware profile's, else the defaults; "
        "offloadpp.io.block_size_bytes / queue_depth / num_threads choose them)"
    )
