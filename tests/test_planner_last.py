"""The planner's partial_last* (planner/activations.py, Note on the last piece): a block's pieces
recomputed from their own checkpoints but the last, which is partial; counted as partial with
kept outputs in the last piece only, for the compute of the other pieces; offered beside pieces'
partial mix where a unit's partial piece holds more than partial_last's (act_candidates.py)."""

from __future__ import annotations

import pytest
from test_planner_activations import every_block_as

from offloadpp.bench.planner_properties import BATCH_SLACK, model_config, plan_point, random_profile
from offloadpp.planner.activations import (
    act_units,
    backward_bytes,
    piece_peaks,
    recompute_fraction,
    split_bytes,
)
from offloadpp.planner.model_profile import analytic_profile
from offloadpp.planner.spec import fmt_bytes


def test_last_counts_the_pieces_attention_and_partials_mlp():
    """A Llama 7B block at b128: under partial_last_ssd the attention's recompute holds what
    recompute_pieces_ssd's does (no q and k from before the rotation), the MLP's what
    partial_ssd's does; it moves the MLP's kept outputs beside the two checkpoints and runs
    again the share of the forward outside the MLP."""
    prof = analytic_profile(model_config("llama-7b"), micro_batch=128, seq_len=1024, compute_dtype="fp16")
    u = next(a for a in act_units(prof) if a.name == "model.layers.1")
    last = piece_peaks(u, "partial_last_ssd")
    pieces = piece_peaks(u, "recompute_pieces_ssd")
    partial = piece_peaks(u, "partial_ssd")
    assert last[:-1] == pieces[:-1] and last[-1] == partial[-1]
    assert backward_bytes(u, "partial_last_ssd") < backward_bytes(u, "partial_ssd")
    mlp = u.pieces[-1][2]
    assert split_bytes(u, "partial_last_ssd")["ssd"] == split_bytes(u, "recompute_pieces_ssd")["ssd"] + mlp
    assert recompute_fraction("partial_last_ssd", u) == pytest.approx(1 - u.last_piece_share)
    assert 0 < recompute_fraction("partial_last_ssd", u) < recompute_fraction("recompute_pieces_ssd", u)


def test_replay_of_last_runs_the_attention_again_and_moves_the_mlps_outputs():
    """partial_last_ssd in the replay: the compute of recompute_pieces_ssd less the MLP's share of
    each block's forward, and the SSD bytes of recompute_pieces_ssd plus each MLP's kept outputs."""
    m, blocks, est = every_block_as(("recompute_pieces_ssd", "partial_last_ssd"))
    units = {a.name: a for a in act_units(m)}
    mlp = sum(units[b].pieces[-1][2] for b in blocks)
    assert est["partial_last_ssd"].ssd_write_bytes - est["recompute_pieces_ssd"].ssd_write_bytes == mlp
    share = sum(u.forward_flops * u.last_piece_share for u in m.units if u.name in blocks) / 100e9
    saved = est["recompute_pieces_ssd"].compute_s - est["partial_last_ssd"].compute_s
    assert saved == pytest.approx(share, rel=1e-9)


def test_no_cliff_where_no_llama_block_fits_partial():
    """Random profile 0, Llama 7B fp16 b128 (a 7.70 GiB room at k = 1): a partial block's
    attention holds 8.02 GiB at its recompute, so no block could be partial; every block
    recomputed piece by piece (75.08 s, 1.104x the time per token of b64: the pieces' second
    forward). Half the blocks partial_last (their MLP's gate and up kept, moved to SSD and host),
    the others pieces: within BATCH_SLACK of b64 (69.26 s, 1.019x; 69.19 s at k = 2 with their
    sources sent back, REFETCH's policies: act_candidates.py, Note on refetch)."""
    hw, dtype = random_profile(0)
    pts = [plan_point(hw, "llama-7b", b, dtype) for b in (64, 128)]
    a, b = pts
    assert b.per_token_s <= a.per_token_s * (1 + BATCH_SLACK), (a.step_s, b.step_s)
    plan = b.resolved.plan
    assert any(p.startswith("partial_last") for p in plan.activations)
    # the printout's split: a partial_last block moves its two checkpoints and the MLP's kept outputs
    u = next(a for a in act_units(b.profile) if a.name == "model.layers.1")
    moved = fmt_bytes(u.pieces[0][1] + u.pieces[2][1] + u.pieces[3][2])
    last = ("partial_last_ssd", "partial_last_refetch_ssd")  # (a source copied up twice is moved once)
    rows = [ln.split() for ln in plan.describe().splitlines() if ln.split()[1:2] and ln.split()[1] in last]
    assert rows and all(" ".join(r[8:10]) == moved for r in rows), (rows[:1], moved)
