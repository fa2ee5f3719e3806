"""The `"offloadpp"` block of a DeepSpeed JSON config, validated once, here.

Its defaults come from the ZeRO-Infinity settings already in the same file, so an existing
ZeRO-Infinity config becomes an offloadpp one by adding `"offloadpp": {"enabled": true}`:
- `nvme_paths` <- `zero_optimization.offload_optimizer.nvme_path` / `offload_param.nvme_path`
- `io.block_size_bytes`, `io.queue_depth`, `io.num_threads` <- the `aio` block's `block_size`,
  `queue_depth`, `intra_op_parallelism`
Everything DeepSpeed itself defines (batch sizes, optimizer, scheduler, clipping, fp16/bf16,
steps_per_print) is parsed by DeepSpeed's own `DeepSpeedConfig`, so it keeps DeepSpeed's semantics.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip


def parse_bytes(value: Union[int, float, str]) -> int:
    """1073741824, 1e9, "1GiB", "8 GB" -> bytes. Raises ValueError naming the bad value."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"byte count must be >= 0, got {value!r}")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 8589934592, '8GiB' or '8GB'")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class IOBlock(_Frozen):
    backend: Literal["auto", "libaio", "io_uring", "threadpool"] = "auto"
    block_size_bytes: int = Field(1 << 20, gt=0)
    queue_depth: int = Field(8, gt=0)
    num_threads: int = Field(1, gt=0)
    checksum: bool = False


class OffloadppBlock(_Frozen):
    """Every key a user may put under `"offloadpp"` (docs/config.md describes each)."""

    enabled: bool = False
    nvme_paths: Optional[list[str]] = None
    # Bytes, or "auto": on CUDA the free device memory less a safety margin; on the CPU-as-device
    # and for host memory, a share of what the machine has available.
    device_budget: Union[int, str] = "auto"
    host_budget: Union[int, str] = "auto"
    prefetch_depth: Optional[int] = Field(None, ge=1)
    # None: the default placement policy; "auto": the cost-model planner; else a plan JSON path.
    plan: Optional[str] = None
    hardware_profile: Optional[str] = None  # `offloadpp profile --json` output (default: the cached one)
    model_profile: Optional[str] = None  # a measured model profile (default: analytic from the model config)
    seq_len: Optional[int] = Field(None, ge=1)  # tokens per sequence, for the planner's model profile
    io: IOBlock = IOBlock()

    @field_validator("nvme_paths")
    @classmethod
    def _non_empty(cls, v):
        if v is not None and not v:
            raise ValueError("nvme_paths must list at least one directory")
        return v

    @field_validator("device_budget", "host_budget")
    @classmethod
    def _size(cls, v):
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        parse_bytes(v)
        return v


class OffloadppConfigError(ValueError):
    """A bad `offloadpp` block or a DeepSpeed config offloadpp cannot run; names the field."""


def load_ds_config(config: Union[str, os.PathLike, dict, None], args: Any = None) -> dict:
    """The DeepSpeed config as a dict, from a dict, a path, or `args.deepspeed_config` (as DeepSpeed does)."""
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepspeed", None)
        if isinstance(config, bool):
            config = None
    if config is None:
        raise OffloadppConfigError("no DeepSpeed config: pass config=... or args.deepspeed_config")
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise OffloadppConfigError(f"DeepSpeed config file {path!r} does not exist")
    with open(path) as f:
        return json.load(f)


def offloadpp_enabled(ds_config: dict) -> bool:
    block = ds_config.get("offloadpp")
    return isinstance(block, dict) and bool(block.get("enabled", False))


def parse_block(ds_config: dict) -> OffloadppBlock:
    """Validate the `offloadpp` block, filling defaults from the ZeRO-Infinity settings beside it."""
    from pydantic import ValidationError

    raw = dict(ds_config.get("offloadpp") or {})
    zero = ds_config.get("zero_optimization") or {}
    if "nvme_paths" not in raw:
        paths = []
        for key in ("offload_optimizer", "offload_param"):
            path = (zero.get(key) or {}).get("nvme_path")
            if path and str(path) not in paths:
                paths.append(str(path))
        if paths:
            raw["nvme_paths"] = paths
    aio = ds_config.get("aio") or {}
    io = dict(raw.get("io") or {})
    for ours, theirs in (("block_size_bytes", "block_size"), ("queue_depth", "queue_depth"),
                         ("num_threads", "intra_op_parallelism")):  # fmt: skip
        if ours not in io and theirs in aio:
            io[ours] = aio[theirs]
    if io:
        raw["io"] = io
    try:
        block = OffloadppBlock(**raw)
    except ValidationError as e:
        problems = "; ".join(
            f"offloadpp.{'.'.join(str(x) for x in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
            for err in e.errors()
        )
        raise OffloadppConfigError(problems) from None
    if block.enabled and not block.nvme_paths:
        raise OffloadppConfigError(
            "offloadpp.nvme_paths: no directory for swap files; set it, or zero_optimization."
            "offload_optimizer.nvme_path as for ZeRO-Infinity"
        )
    return block
