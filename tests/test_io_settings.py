"""The I/O engine's settings: decided once by the resolve stage (planner/io_settings.py), carried
in the Plan, opened by the runtime's store; DeepSpeed's `aio` block is reported, never applied."""

from __future__ import annotations

import logging

import pytest
from test_planner import cpu_hw

from offloadpp.io import IOConfig
from offloadpp.planner import IOPoint, Machine, Settings, UnitSpec, resolve
from offloadpp.planner.io_settings import applied, io_set_of, with_io

UNITS = tuple(UnitSpec(f"h.{i}", 100_000) for i in range(3))
MACHINE = Machine("cpu", host_available_bytes=16 << 30, cores=2)


def _plan(**kw):
    return resolve(Settings(**kw), UNITS, MACHINE).plan


def test_without_a_profile_the_plan_leaves_them_to_ioconfig():
    plan = _plan()
    assert (plan.io_block_size_bytes, plan.io_queue_depth, plan.io_num_threads) == (None, None, None)
    assert applied(IOConfig(), plan) == IOConfig()
    assert any(n.startswith("I/O: ") and "IOConfig's defaults" in n for n in plan.notes)


def test_the_profile_decides_unless_the_run_sets_them():
    base = IOPoint(1 << 20, 8, 2.0, 2.0)
    better = IOPoint(4 << 20, 32, 3.0, 3.0)
    hw = cpu_hw(io_grid=(base, better), io_block_size_bytes=1 << 20, io_queue_depth=8)
    plan = resolve(Settings(), UNITS, MACHINE, hardware=hw).plan
    assert (plan.io_block_size_bytes, plan.io_queue_depth, plan.io_num_threads) == (4 << 20, 32, None)
    assert "best measured" in plan.notes[-1]
    # no clearly better point: the setting the profile's rates were measured at
    hw = cpu_hw(io_block_size_bytes=512 << 10, io_queue_depth=16)
    plan = resolve(Settings(), UNITS, MACHINE, hardware=hw).plan
    assert (plan.io_block_size_bytes, plan.io_queue_depth) == (512 << 10, 16)
    # what the run sets itself wins, key by key, and the note says whose each is
    own = IOConfig(queue_depth=4, num_threads=2)
    plan = resolve(Settings(), UNITS, MACHINE, hardware=hw, io_set=io_set_of(own)).plan
    assert (plan.io_block_size_bytes, plan.io_queue_depth, plan.io_num_threads) == (512 << 10, 4, 2)
    assert applied(own, plan) == IOConfig(block_size_bytes=512 << 10, queue_depth=4, num_threads=2)
    assert "offloadpp.io (num_threads, queue_depth), else the hardware profile" in plan.notes[-1]
    assert sum(n.startswith("I/O: ") for n in with_io(plan, hw, {}).notes) == 1  # decided again, said once


def test_only_the_settings_the_plan_carries():
    with pytest.raises(ValueError, match="backend"):
        with_io(_plan(), None, {"backend": "libaio"})


def test_initialize_does_not_apply_the_aio_block(tmp_path, caplog):
    pytest.importorskip("deepspeed")
    from test_deepspeed_integration import ds_config, tiny_gpt2

    import offloadpp

    aio = {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": False}
    cfg = ds_config(tmp_path / "nvme", aio=aio)
    with caplog.at_level(logging.WARNING, logger="offloadpp"):  # (seen by default: issue 37)
        engine, *_ = offloadpp.initialize(model=tiny_gpt2(), config=cfg)
    try:
        io = engine.runtime.store.config
        assert (io.block_size_bytes, io.queue_depth, io.num_threads) == (1 << 20, 8, 1)  # IOConfig's
        said = [r.getMessage() for r in caplog.records if "aio block" in r.getMessage()]
        assert len(said) == 1 and "block_size=262144" in said[0] and "not applied" in said[0]
        assert "block 1024 KiB, queue depth 8" in said[0]
    finally:
        engine.close()
    cfg = ds_config(tmp_path / "nvme2", aio=aio)
    cfg["offloadpp"]["io"] = {"queue_depth": 4}  # ours still sets them
    engine, *_ = offloadpp.initialize(model=tiny_gpt2(), config=cfg)
    try:
        io = engine.runtime.store.config
        assert (io.block_size_bytes, io.queue_depth, io.num_threads) == (1 << 20, 4, 1)
    finally:
        engine.close()
