"""The planner and Python's cycle collector: a replay and a search leave it nothing, and it waits
while they run (cost.replay's Note: its passes in between only moved their live objects on to the
generation whose pass walks the whole process, torch's and DeepSpeed's objects included)."""

from __future__ import annotations

import gc
import sys

from test_planner import GPT2

from offloadpp.planner import Budgets, Settings, streaming_plan
from offloadpp.planner.cost import _replay, replay
from offloadpp.planner.hardware import HardwareProfile
from offloadpp.planner.model_profile import analytic_profile
from offloadpp.planner.peaks import peak_bytes
from offloadpp.planner.request import Request
from offloadpp.planner.search import remembering, search


def hw() -> HardwareProfile:
    return HardwareProfile(
        device="cpu", device_name="t", cpu_cores=2, ssd_read_gbps=0.3, ssd_write_gbps=0.3, h2d_gbps=10.0,
        d2h_gbps=10.0, memcpy_gbps=10.0, device_flops_per_s={"fp32": 100e9}, adam_params_per_s={1: 1e9},
        host_memory_bytes=1 << 34, device_memory_bytes=1 << 34,
    )  # fmt: skip


def model():
    return analytic_profile(GPT2, micro_batch=1, seq_len=64)


def stream(m):
    return streaming_plan(m.unit_specs(), device="cpu", compute_dtype="fp32", prefetch_depth=2,
                          optim_prefetch_depth=2, budgets=Budgets(1 << 34, 1 << 34))  # fmt: skip


def passes_within(code, run) -> list[int]:
    """The collector's passes that start while `code` is on the stack during run(), at nearly
    every allocation (not those of its call nor of its return)."""
    passes: list[int] = []

    def count(phase, info):
        f = sys._getframe(1)
        while f is not None and f.f_code is not code:
            f = f.f_back
        if phase == "start" and f is not None:
            passes.append(info["generation"])

    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(count)
    try:
        run()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*old)
    return passes


def garbage_of(run) -> int:
    """What the collector finds unreachable after run(), with nothing collected while it ran."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        run()
        return gc.collect()
    finally:
        if was:
            gc.enable()


def test_a_replay_leaves_nothing_for_the_cycle_collector():
    """Each replay's objects (its requests, slots and units: thousands) go when it returns. Kept
    alive by a reference cycle (the activation replay's Sim), they waited for the collector,
    about once per point planned."""
    m = model()
    assert garbage_of(lambda: replay(stream(m), hw(), m, activations={u.name: "ssd" for u in m.units})) == 0


def test_the_cycle_collector_waits_while_a_replay_runs():
    m = model()
    plan, h, acts = stream(m), hw(), {u.name: "ssd" for u in m.units}
    assert passes_within(_replay.__code__, lambda: replay(plan, h, m, activations=acts)) == []
    assert gc.isenabled()


def test_the_cycle_collector_waits_while_a_resolve_searches():
    """A search's candidates and replays live until it returns (search.remembering, resolve's
    scope); nothing of it needs the collector, which runs again after."""
    h, m = hw(), model()
    dev, host = peak_bytes(stream(m))
    req = Request(Budgets(dev, host), Settings())

    def searched():
        with remembering():
            search(h, m, req)

    assert passes_within(search.__code__, searched) == []
    assert gc.isenabled()
    assert garbage_of(lambda: search(h, m, req)) == 0
