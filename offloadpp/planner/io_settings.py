"""The I/O engine's block size, queue depth and threads a run uses: decided once, here, by the
resolve stage, and carried in the Plan (Plan.io_*); the runtime opens its store with them.

Note: whose settings. In order: what the run sets itself (`offloadpp.io.block_size_bytes`,
`queue_depth`, `num_threads` in the DeepSpeed block, or RuntimeConfig(io=IOConfig(...))); then
the hardware profile's (the measured grid's best setting where it is clearly better, search.
io_choice, else the setting its SSD rates were measured at); then IOConfig's defaults (1 MiB,
queue depth 8, one thread: the best of fio's grid on the development machine, DESIGN.md), which
a plan leaves as None. DeepSpeed's `aio` block is not among them: it is tuned for DeepSpeed's
swapper (its buffer counts and sizes), not for our engine, and honouring it slowed the GPT-2
1.31B step from 37.2 s to 52.6 s (issue 21). The DeepSpeed integration logs it as
not applied (integrations/deepspeed/config.py, aio_not_applied).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

from .hardware import HardwareProfile
from .plan import Plan
from .search import io_choice

# The settings a run may fix itself: IOConfig's field -> the Plan's.
IO_FIELDS = {
    "block_size_bytes": "io_block_size_bytes",
    "queue_depth": "io_queue_depth",
    "num_threads": "io_num_threads",
}


def io_set_of(io_config) -> dict[str, int]:
    """The IO_FIELDS an IOConfig sets itself (its pydantic model_fields_set), with their values:
    what `with_io` lets win."""
    return {k: getattr(io_config, k) for k in IO_FIELDS if k in io_config.model_fields_set}


def applied(io_config, plan: Plan):
    """`io_config` (an IOConfig) with the plan's I/O settings in place of its own: what the
    runtime's store opens with. A plan that leaves one None (made without resolve) keeps the
    config's."""
    chosen = {ours: getattr(plan, theirs) for ours, theirs in IO_FIELDS.items()}
    return io_config.model_copy(update={k: v for k, v in chosen.items() if v is not None})


def with_io(plan: Plan, hardware: Optional[HardwareProfile], io_set: Mapping[str, int]) -> Plan:
    """The plan with its I/O settings decided (see the module Note). `io_set`: the IOConfig
    fields (of IO_FIELDS) the run sets itself, with their values."""
    unknown = set(io_set) - set(IO_FIELDS)
    if unknown:
        raise ValueError(f"io settings {sorted(unknown)}: the plan carries only {sorted(IO_FIELDS)}")
    chosen: dict[str, Optional[int]] = {f: getattr(plan, f) for f in IO_FIELDS.values()}
    source = "a plan file" if any(v is not None for v in chosen.values()) else "IOConfig's defaults"
    if hardware is not None and chosen["io_block_size_bytes"] is None:
        best = io_choice(hardware)
        if best is not None:
            chosen["io_block_size_bytes"], chosen["io_queue_depth"] = best.block_size_bytes, best.queue_depth
            source = "the hardware profile's best measured setting"
        else:
            chosen["io_block_size_bytes"] = hardware.io_block_size_bytes
            chosen["io_queue_depth"] = hardware.io_queue_depth
            source = "the hardware profile"
    for ours, value in io_set.items():
        chosen[IO_FIELDS[ours]] = int(value)
    if io_set:
        source = f"offloadpp.io ({', '.join(sorted(io_set))})" + (
            f", else {source}" if len(io_set) < 3 else ""
        )
    planned = replace(plan, **chosen)
    notes = tuple(n for n in plan.notes if not n.startswith("I/O: "))  # a plan file's, decided again
    return replace(planned, notes=notes + (f"I/O: {describe_io(planned)} from {source}",))


def describe_io(plan: Plan) -> str:
    """`block 1024 KiB, queue depth 8, 2 threads per directory`; a setting the plan leaves to
    IOConfig's default says so (its value lives there only)."""
    b, q, t = plan.io_block_size_bytes, plan.io_queue_depth, plan.io_num_threads
    return ", ".join((
        f"block {b >> 10} KiB" if b is not None else "IOConfig's block size",
        f"queue depth {q}" if q is not None else "IOConfig's queue depth",
        f"{t} thread{'s' * (t > 1)} per directory" if t is not None else "IOConfig's threads",
    ))  # fmt: skip
