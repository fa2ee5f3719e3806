"""Staging (runtime/activations/swap.py, Note on staging): where the device has memory of its own,
the next units' SSD records start their read into host memory as backward reaches a unit,
whatever the device room; their copy up still waits for the room. On the stand-in (the GPU's
copy path), partial_ssd blocks under a budget of 90% of what one block saves: reads start ahead
of the room, each record is read once, the accounted peak stays within the budget, and the
gradients are those of the run without swapping, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import set_device
from test_activations import one_block_under_budget, standin_swapped_out, store

from offloadpp.planner import ActivationSettings
from offloadpp.runtime.activations.manager import ActivationManager
from offloadpp.runtime.activations.records import RecState
from offloadpp.runtime.activations.swap import Swapper

pytest.importorskip("transformers")

__all__ = ["store"]  # (the fixture, shared with test_activations.py)


def _run(ref, x, store, budget: int, policy: str, monkeypatch, stage: bool = True, overrides=None,
         backward_only: bool = False):  # fmt: skip
    """One step of `ref`'s copy under `policy` (`overrides`: per unit) with the forward's copies
    drained before backward (so every swapped record is on SSD when backward starts); (gradients,
    stats, of backward alone where `backward_only`, the state of each SSD record when backward
    fetched it)."""
    at_fetch = []
    fetch = Swapper.fetch

    def watched(self, rec):
        if rec.key is not None:
            at_fetch.append(rec.state)
        fetch(self, rec)

    monkeypatch.setattr(Swapper, "fetch", watched)
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy=policy, budget_bytes=budget, min_swap_bytes=0, overrides=overrides or {})
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with mgr.forward():
            loss = model(input_ids=x, labels=x).loss
        mgr.drain()
        if backward_only:
            mgr.reset_stats()
        mgr.start_backward(stage=stage)
        try:
            loss.backward()
        finally:
            mgr.end_backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return grads, mgr.stats(), at_fetch


def test_on_the_standin_ssd_reads_start_ahead_of_the_device_room(store, monkeypatch):
    set_device(monkeypatch, "standin")
    x, ref, want, block, budget = one_block_under_budget()
    got, stats, at_fetch = _run(ref, x, store, budget, "partial_ssd", monkeypatch)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # most records were read (or were being read) into host memory before backward fetched them
    ahead = sum(s in (RecState.STAGING, RecState.HOST) for s in at_fetch)
    assert ahead >= len(at_fetch) // 2 > 0, at_fetch
    assert stats.ssd_read_bytes == stats.ssd_write_bytes > 0  # (each record read once)
    assert stats.peak_device_bytes <= budget


def test_on_the_cpu_device_nothing_is_staged(store, monkeypatch):
    """On the CPU acting as the device host memory is the device's: a read ahead of the budget
    would pass the only bound there is."""
    set_device(monkeypatch, "cpu")
    x, ref, want, block, budget = one_block_under_budget()
    got, stats, at_fetch = _run(ref, x, store, budget, "partial_ssd", monkeypatch)
    assert at_fetch and all(s is RecState.ON_SSD for s in at_fetch), at_fetch
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert stats.peak_device_bytes <= budget


def test_on_the_standin_a_vertical_windows_backward_stages_nothing(store, monkeypatch):
    """The engine's backward over a vertical window's G losses (start_backward(stage=False)):
    a unit's records are then all G micro-batches', and the replay stages none of them either."""
    set_device(monkeypatch, "standin")
    x, ref, want, block, budget = one_block_under_budget()
    got, stats, at_fetch = _run(ref, x, store, budget, "partial_ssd", monkeypatch, stage=False)
    assert at_fetch and all(s is RecState.ON_SSD for s in at_fetch), at_fetch
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("staged", [False, True])
def test_on_the_standin_an_ssd_read_is_copied_up_once_it_ends_not_when_backward_needs_it(store, staged):
    """The runtime half of the replay's copy up at a read's end (planner/simulate_fetch.py
    `_copy_up_read`): a record fetched straight from SSD (READING: a room large enough that the
    prefetch takes it before any stage, the path twice the device memory takes) starts its copy
    up at the first pump after its read ends (swap.py `_advance_in`), not when backward unpacks
    it; a staged one (STAGING, then HOST) at its fetch. The replay copied a read fetched straight
    from SSD up only at its unit's backward, so random profile 4's Llama b128 with twice the
    device memory replayed 1.022x the normal room's step, whose reads were staged
    (test_planner_properties, test_twice_the_device_memory_reads_ahead_as_the_normal_room_stages)."""
    from offloadpp.runtime.activations.policy import ActPolicy

    with standin_swapped_out(store, ActPolicy.SSD) as (_, sw, rec, x):
        sw._finish_write(rec, block=True)
        assert rec.state is RecState.ON_SSD
        if staged:
            sw.stage(rec)
            rec.get.wait()
            sw.pump()
            assert rec.state is RecState.HOST  # (read into host memory, waiting for a fetch)
            sw.fetch(rec)
        else:
            sw.fetch(rec)
            assert rec.state is RecState.READING
            rec.get.wait()  # (the read ends; backward has not reached the unit)
            sw.pump()
        assert rec.state in (RecState.MOVING_IN, RecState.READY)  # (the copy up is under way)
        sw.wait_ready(rec)
        got = torch.empty(4096)
        got.untyped_storage().copy_(rec.storage[rec.base : rec.base + rec.nbytes])
        assert torch.equal(got, x)
        sw.release(rec)
