"""partial_host_tail (runtime/activations/policy.py; planner/activations.py, Note on the tail)
around plain torch models, no engine: a block's last TAIL_PIECES pieces keep their records on
the device, the earlier pieces' leave as partial_host's do, with the gradients of the run without
swapping (dropout on). The accounted device peak within a planned budget: tests/test_device_budget.py
(its fast slice runs partial_host_tail on the stand-in)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_activations import data, rel_diff, run_step, store, tiny_gpt2, tiny_llama

from offloadpp.planner import ActivationSettings
from offloadpp.planner.activations import TAIL_PIECES
from offloadpp.runtime.activations.manager import ActivationManager
from offloadpp.runtime.activations.records import RecState

transformers = pytest.importorskip("transformers")

__all__ = ["data", "store"]  # (the fixtures, shared with test_activations.py)


def _blocks(mgr) -> list:
    return [u for u in mgr.units if "layers" in u.name or ".h." in u.name]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tail_keeps_the_last_pieces_and_moves_the_rest(store, data, on_device, kind):
    """Under partial_host_tail each block's records of its last TAIL_PIECES pieces (in call
    order: a Llama block registers its norms after its attention and MLP) are still on the device
    when backward starts, never copied; the earlier pieces' left as under partial_host. So the
    run copies out exactly the tail's bytes less than partial_host, with the same gradients as
    the run without swapping, twice (the second step reuses the host buffers); backward fetches
    the last swapped piece's records first."""
    ref = tiny_gpt2() if kind == "gpt2" else tiny_llama()
    _, want = run_step(ref, data)
    moved, tails = {}, {}
    for policy in ("partial_host", "partial_host_tail"):
        model = copy.deepcopy(ref)
        with ActivationManager.for_model(model, ActivationSettings(policy="keep"), store=store) as mgr:
            names = [u.name for u in _blocks(mgr)]
        cfg = ActivationSettings(policy="keep", overrides={n: policy for n in names}, min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            for _ in range(2):
                mgr.reset_stats()
                model.zero_grad(set_to_none=True)
                torch.manual_seed(5)
                with mgr.forward():
                    loss = model(input_ids=data, labels=data).loss
                mgr.drain()  # (every copy out started is done: what is left on the device stays)
                kept = 0
                for u in _blocks(mgr):
                    assert len(u.segments) > TAIL_PIECES, u.segments
                    first_kept = u.segments[-TAIL_PIECES].first_record
                    for i, rec in enumerate(u.records):
                        if not rec.policy.swaps:  # (kept whatever the policy)
                            continue
                        on_device = rec.state is RecState.DEVICE
                        assert on_device == (policy == "partial_host_tail" and i >= first_kept), (
                            u,
                            i,
                            rec.state,
                        )
                        kept += rec.nbytes if on_device else 0
                    # backward's first fetch of the unit asks for its last piece with swapped
                    # records (a kept piece has nothing to fetch: backward would wait at the next)
                    # and the checkpoint that piece's argument is made from (the norm's before it)
                    swapped = -TAIL_PIECES - 1 if policy == "partial_host_tail" else -1
                    assert u.segments[swapped].derived
                    assert mgr._fetch_floor(u) == u.segments[swapped - 1].first_record
                mgr.backward(loss)
                got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                assert rel_diff(got, want) <= 1e-6, policy
                s = mgr.stats()
                assert s.fetch_misses == 0 and s.h2d_bytes == s.d2h_bytes > 0
                moved[policy], tails[policy] = s.d2h_bytes, kept
    assert tails["partial_host"] == 0 < tails["partial_host_tail"]
    assert moved["partial_host"] - moved["partial_host_tail"] == tails["partial_host_tail"], (moved, tails)
