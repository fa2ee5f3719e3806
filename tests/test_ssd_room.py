"""The free SSD space a plan needs (planner/ssd_room.py): what the run writes at its peak plus a
stated margin, every byte said where it comes from (issue 37: the old rule asked 141 MiB for a
76 MiB peak, a fixed 64 MiB per directory plus 2%, without a word)."""

from __future__ import annotations

import os

import pytest

from offloadpp.planner import Settings, UnitSpec, streaming_plan
from offloadpp.planner.ssd_room import (
    MARGIN_MIN_BYTES,
    SWAP_ALIGN_BYTES,
    SWAP_HEADER_BYTES,
    ssd_need,
    ssd_need_bytes,
)

UNITS = (
    [UnitSpec("embed", 25_800_000, backward_needs_weights=False)]
    + [UnitSpec(f"h.{i}", 3_150_000) for i in range(6)]
    + [UnitSpec("head", 1024, borrows=("embed",))]
)


def test_the_swap_file_constants_are_the_stores():
    from offloadpp.io.config import ALIGNMENT
    from offloadpp.io.format import HEADER_BYTES

    assert (SWAP_HEADER_BYTES, SWAP_ALIGN_BYTES) == (HEADER_BYTES, ALIGNMENT)


@pytest.mark.parametrize(
    "fields",
    [
        dict(deferred_update=False),
        dict(deferred_update=True, speculative=False),
        dict(deferred_update=True, speculative=True),
        dict(deferred_update=False, accumulate_grads=True),
    ],
    ids=["during-backward", "deferred", "speculative", "accumulating"],
)
@pytest.mark.parametrize("paths", [1, 3])
def test_the_need_is_the_footprint_the_files_and_a_stated_margin(fields, paths):
    plan = streaming_plan(UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=1, **fields)
    need = ssd_need(plan, paths)
    assert need.state_bytes + need.second_generation_bytes == plan.ssd_footprint_bytes()
    keys = need.files // paths  # (a bound: every key split over every directory)
    assert need.file_bytes <= need.files * SWAP_HEADER_BYTES + keys * SWAP_ALIGN_BYTES
    written = plan.ssd_footprint_bytes() + need.file_bytes
    assert need.margin_bytes == max(MARGIN_MIN_BYTES, int(written * 0.01))
    assert ssd_need_bytes(plan, paths) == need.total_bytes == written + need.margin_bytes
    said = need.describe()
    assert "swap-file headers and 4 KiB rounding" in said and "a margin of 1% (at least 1.00 MiB)" in said
    assert ("its second generation" in said) == bool(need.second_generation_bytes)


def _allocated(d: str) -> int:
    return sum(os.stat(os.path.join(r, f)).st_blocks * 512 for r, _, fs in os.walk(d) for f in fs)


def test_the_need_matches_what_a_run_writes(tmp_path):
    """Trained a few steps (updates during backward: two generations), the swap directory holds
    at most what the rule counts before its margin, and the rule asks at most the margin and a
    few unwritten second generations more (was: 64 MiB more)."""
    from test_runtime import batches, streaming_config, tiny_gpt2

    from offloadpp.assemble import assemble_engine

    eng = assemble_engine(tiny_gpt2(), streaming_config(tmp_path))
    try:
        for x in batches(3):
            eng.backward(eng(input_ids=x, labels=x).loss)
            eng.step()
        need, asked = ssd_need(eng.plan, 1), ssd_need_bytes(eng.plan, 1)  # (what the preflight asks)
        assert need.second_generation_bytes > 0
        on_disk = _allocated(str(tmp_path))
        assert on_disk <= asked - need.margin_bytes + 4096  # (+ the run's lock file)
        assert asked - on_disk < 2 * MARGIN_MIN_BYTES
    finally:
        eng.close()


def test_settings_that_keep_everything_in_memory_need_no_ssd():
    from offloadpp.planner import Budgets, default_plan

    plan = default_plan(UNITS, device="cpu", settings=Settings(), budgets=Budgets(1 << 40, 1 << 40))
    assert plan.ssd_footprint_bytes() == 0 and ssd_need_bytes(plan, 2) == 0
