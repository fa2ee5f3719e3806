"""Backward's fetches (runtime/activations/backward.py): the next units' records come back beside a
piecewise unit's pieces still to recompute, within the budget less what those pieces will hold
(Note on the reserve), as the replay lets them (planner/simulate_act.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_activations import data, one_block_under_budget, run_step, store, tiny_gpt2, tiny_llama

from offloadpp.planner import ActivationSettings
from offloadpp.runtime.activations import recompute, saves, swap
from offloadpp.runtime.activations.manager import ActivationManager

pytest.importorskip("transformers")

__all__ = ["data", "store"]  # (the fixtures, shared with test_activations.py)


def _order(monkeypatch) -> list[tuple[str, str]]:
    """The backward's record fetches and recomputes, in the order they run: ("fetch", the record)
    and ("recompute", the unit)."""
    events: list[tuple[str, object]] = []
    fetch, again = swap.Swapper.fetch, recompute.Segment.recompute

    def fetching(self, rec):
        events.append(("fetch", rec))
        return fetch(self, rec)

    def recomputing(self, *args, **kwargs):
        events.append(("recompute", self.unit))
        return again(self, *args, **kwargs)

    monkeypatch.setattr(swap.Swapper, "fetch", fetching)
    monkeypatch.setattr(recompute.Segment, "recompute", recomputing)
    return events


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["partial_host", "recompute_pieces_host"])
def test_the_next_blocks_records_come_back_beside_a_blocks_pieces(store, data, monkeypatch, kind, policy):
    """With room for them, a block's backward asks for the block before it (backward's next)
    while its own pieces are still to recompute, not once its last piece recomputed: the fetch
    overlaps the block's backward as the replay counts it (random profile 29, Llama 7B b32),
    with the gradients of the run without swapping."""
    ref = tiny_gpt2(dropout=0.0) if kind == "gpt2" else tiny_llama()
    _, want = run_step(copy.deepcopy(ref), data)
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy=policy, overrides={"head": "keep"}, min_swap_bytes=0)
    events = _order(monkeypatch)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        torch.manual_seed(5)  # (run_step's: the same dropout masks)
        with mgr.forward():
            loss = model(input_ids=data, labels=data).loss
        mgr.drain()
        events.clear()
        before, last = mgr.units[-3:-1]  # (the last two blocks: the head follows them)
        # (the block's own records: Llama's rotary tables, saved first by the first block, come
        # back with every block's attention)
        own = [r for r in before.records if r.unit is before and all(r is not x for x in last.records)]
        mgr.backward(loss)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)
    last_recompute = max(i for i, e in enumerate(events) if e == ("recompute", last.name))
    first_fetch = min(i for i, e in enumerate(events) if e[0] == "fetch" and any(e[1] is r for r in own))
    assert first_fetch < last_recompute, events


def test_a_swapped_partial_piece_releases_what_only_its_recompute_read(store, data, monkeypatch):
    """A partial_host Llama block's attention keeps q's and k's projections' outputs for the
    recompute, which reads them (the rotation makes the q and k autograd saves from them), and
    autograd saves them nowhere: released once the piece's recompute ran, while its backward is
    still to run (saves.py `_release_replayed`), not at the next piece's recompute. The planner's
    `partial_extra` of a Llama attention piece (the replay's hold after the recompute:
    simulate_act.py `_hold`) is those bytes; the gradients stay the run's without swapping."""
    from offloadpp.runtime.activations.records import RecState
    from offloadpp.runtime.activations.states import SegState

    ref = tiny_llama()
    _, want = run_step(copy.deepcopy(ref), data)
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy="partial_host", overrides={"head": "keep"}, min_swap_bytes=0)
    early: list[int] = []  # the bytes of records released while their own piece's backward is to run
    release, replayed = swap.Swapper.release, saves.ManagerSaves._release_replayed
    inside = [False]  # (at the recompute: those read after it go once backward is done with them)

    def at_recompute(self, unit, seg):
        inside[0] = True
        try:
            return replayed(self, unit, seg)
        finally:
            inside[0] = False

    def releasing(self, rec):
        u = rec.unit
        if inside[0] and rec.state is not RecState.RELEASED and u.segments:
            bounds = [s.first_record for s in u.segments] + [len(u.records)]
            k = next(i for i in range(len(u.segments)) if bounds[i] <= u.records.index(rec) < bounds[i + 1])
            if u.segments[k].state is SegState.RECOMPUTED:
                early.append(rec.nbytes)
        return release(self, rec)

    monkeypatch.setattr(swap.Swapper, "release", releasing)
    monkeypatch.setattr(saves.ManagerSaves, "_release_replayed", at_recompute)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        _, got = run_step(model, data, mgr)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    q, k = data.numel() * 64 * 4, data.numel() * 32 * 4  # (4 heads and 2 key-value heads of 16, fp32)
    # (2 blocks, each attention's q and k; on the CPU the attention's matmuls' outputs too, where
    # SDPA runs as matmuls and softmax, saving its output, not the scores it is made from)
    assert early.count(q) >= 2 and early.count(k) >= 2, early


def test_a_fetch_beside_the_pieces_takes_the_last_records_first_while_each_fits():
    """backward.py `_fetch_unit` beside a block's pieces (not forced): a unit's records last first,
    each while it fits the budget less the reserve, stopping at the first that does not; the
    rest on a later call, once room came. The replay counts a partial block's first fetch so
    (planner/simulate_fetch.py: at b128 two of a Llama block's three MLP records beside the
    block before's attention piece, where counted piece by piece none came back)."""
    from types import SimpleNamespace

    from offloadpp.runtime.activations.backward import ManagerBackward
    from offloadpp.runtime.activations.records import RecState

    fetched: list[int] = []

    def fetch(rec):
        fetched.append(rec.nbytes)
        sw.device_bytes += rec.nbytes

    sw = SimpleNamespace(device_bytes=600, fetch=fetch)
    mgr = SimpleNamespace(swapper=sw, budget=1000)
    # (pack order: the second norm's checkpoint, then the MLP's two records)
    recs = [SimpleNamespace(state=RecState.HOST, nbytes=n, want_in=False) for n in (100, 200, 100)]
    u = SimpleNamespace(records=recs, fetch_cursor=3)
    assert not ManagerBackward._fetch_unit(mgr, u, force=False, reserve=50)
    assert fetched == [100, 200] and u.fetch_cursor == 1  # (the checkpoint: 1050 of 1000)
    sw.device_bytes -= 200  # (the block before released a piece)
    assert ManagerBackward._fetch_unit(mgr, u, force=False, reserve=50)
    assert fetched == [100, 200, 100] and u.fetch_cursor == 0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["partial_host", "partial_ssd"])
def test_a_swapped_piece_releases_a_storage_once_backward_is_done_with_it(
    store, data, monkeypatch, kind, policy
):
    """On the stand-in (the GPU's copy path: records fetched into storages of their own), a
    swapped partial piece releases each storage its saved tensors are on once the backward nodes
    that read them are done (recompute.py, Note on release within a piece), not at the next
    piece: each block's MLP releases its kept inputs to the activation (c_fc's output; gate's and
    up's) while its own backward still runs and the pieces before it are still to recompute, and
    recomputed bytes leave the account before their piece ends, each storage gone by then. The
    replay's piece_freed (planner/simulate_act.py `_marks`); random profile 8's Llama 7B b128 at
    1.137x the time per token of b64 without it. The gradients stay the run's without swapping,
    the account ends at zero, and under a budget of 90% of what a block saves the peak stays
    within it."""
    from conftest import set_device

    from offloadpp.runtime.activations.records import RecState
    from offloadpp.runtime.activations.states import SegState

    set_device(monkeypatch, "standin")

    ref = tiny_gpt2(dropout=0.0) if kind == "gpt2" else tiny_llama()
    _, want = run_step(copy.deepcopy(ref), data)
    early: dict[str, list[int]] = {}  # block -> its MLP's records released within its backward
    freed: list[int] = []  # recomputed bytes that left the account before their piece ended
    release, sweep = swap.Swapper.release, recompute.Segment.sweep

    def releasing(self, rec):
        segs = rec.unit.segments
        if (
            rec.state is not RecState.RELEASED
            and len(segs) == 4
            and rec.unit.records.index(rec) >= segs[3].first_record
        ):
            if segs[3].state is SegState.RECOMPUTED and all(s.state is SegState.SAVED for s in segs[:3]):
                early.setdefault(rec.unit.name, []).append(rec.nbytes)
        return release(self, rec)

    def sweeping(self):
        ours = {k for k, n in self._bytes.items() if n}  # (its recomputed storages not yet released)
        was, done = self.recomputed_bytes, sweep(self)
        if self.recomputed_bytes < was and not self.finished:
            freed.append(was - self.recomputed_bytes)
        # what left the account is gone: no node is still reading it
        assert all(k.expired() for k in ours - set(self._bytes)), "released while still read"
        return done

    monkeypatch.setattr(swap.Swapper, "release", releasing)
    monkeypatch.setattr(recompute.Segment, "sweep", sweeping)
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy=policy, overrides={"head": "keep"}, min_swap_bytes=0)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        _, got = run_step(model, data, mgr)
        assert mgr.swapper.device_bytes == 0
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    blocks = ref.config.num_hidden_layers
    x, inner = data.numel() * 64 * 4, data.numel() * (256 if kind == "gpt2" else 128) * 4  # (fp32)
    # (c_fc's, or gate's and up's; the projection's output is not kept: partial.py, Note on
    # outputs backward never reads)
    want_early = [inner] if kind == "gpt2" else [inner, inner]
    assert len(early) == blocks and all(sorted(v) == want_early for v in early.values()), early
    assert freed
    # under a budget of 90% of what a block saves: within it, the same gradients
    x, ref, want, _, budget = one_block_under_budget()
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy=policy, budget_bytes=budget, min_swap_bytes=0)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        _, got = run_step(model, x, mgr)
        assert mgr.stats().peak_device_bytes <= budget and mgr.swapper.device_bytes == 0
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
