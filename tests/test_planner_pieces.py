"""The planner's recompute_pieces* (planner/activations.py, Note on pieces): each piece of a block
recomputed from its own checkpoint, counted as partial with no kept outputs, for the compute of
a whole recompute; offered where nested is (act_candidates.py, Note on the candidates)."""

from __future__ import annotations

import pytest
from test_planner_activations import every_block_as, resolved_cpu_plan

from offloadpp.planner.act_candidates import ActPlanner
from offloadpp.planner.activations import (
    ActUnit,
    act_units,
    backward_bytes,
    forward_bytes,
    held_bytes,
    need_bytes,
    recompute_fraction,
    split_bytes,
)
from offloadpp.planner.cost import estimate
from offloadpp.planner.model_profile import analytic_profile


def test_replay_of_pieces_moves_two_checkpoints_and_runs_the_forward_once():
    """recompute_pieces_ssd moves each block's two checkpoints (recompute_ssd's one, twice: the
    residual stream before each norm), adds one forward of each block to the compute (nested adds
    two less the MLP's share), and its backward holds one piece's saved bytes beside the
    previous piece's checkpoint: below the whole recompute's peak."""
    m, blocks, est = every_block_as(("keep", "recompute_ssd", "recompute_nested_ssd", "recompute_pieces_ssd"))
    b = next(a for a in act_units(m) if a.name == blocks[0])
    ckpt = len(blocks) * b.inputs
    for kind in ("ssd_write_bytes", "ssd_read_bytes"):
        assert getattr(est["recompute_ssd"], kind) - getattr(est["keep"], kind) == ckpt
        assert getattr(est["recompute_pieces_ssd"], kind) - getattr(est["keep"], kind) == 2 * ckpt
    fwd = sum(u.forward_flops for u in m.units if u.name in blocks) / 100e9
    assert est["recompute_pieces_ssd"].compute_s - est["keep"].compute_s == pytest.approx(fwd, abs=1e-9)
    assert est["recompute_pieces_ssd"].compute_s < est["recompute_nested_ssd"].compute_s
    units = act_units(m)
    need = {p: need_bytes(units, {b: p for b in blocks}) for p in ("recompute_ssd", "recompute_pieces_ssd")}
    assert need["recompute_pieces_ssd"] < need["recompute_ssd"], need
    # (the MLP's saved bytes beside the second norm's checkpoint, its argument made again from it)
    mlp = b.pieces[-1][0]
    assert backward_bytes(b, "recompute_pieces_ssd") == max(b.pieces[1][0] + b.inputs, mlp + b.inputs)
    assert held_bytes(b, "recompute_pieces") == 2 * b.inputs and held_bytes(b, "recompute_pieces_host") == 0
    assert forward_bytes(b, "recompute_pieces_ssd") == b.inputs  # (each checkpoint leaves as its piece opens)
    assert split_bytes(b, "recompute_pieces_host") == {"kept": 0, "host": 2 * b.inputs, "ssd": 0,
                                                       "recomputed": b.saved}  # fmt: skip
    assert (
        recompute_fraction("recompute_pieces_ssd", b) == 1.0 < recompute_fraction("recompute_nested_ssd", b)
    )
    # a unit without pieces (the head) recomputes whole
    head = next(a for a in act_units(m) if a.name == "head")
    assert backward_bytes(head, "recompute_pieces_ssd") == backward_bytes(head, "recompute_ssd")


def test_pieces_are_offered_where_nested_is():
    """Where the whole recompute passes the room, the recomputing choices come again with nested
    and with pieces in place of recompute (each within the room); where it fits, neither."""
    pieces = ((100, 100, 0, 0), (400, 0, 300, 100), (100, 100, 0, 0), (500, 0, 300, 100))
    us = [ActUnit(f"u{i}", 1000, 100, 10_000, True, 600, 200, pieces, last_piece_share=0.6) for i in range(6)]
    assert backward_bytes(us[0], "recompute_pieces_ssd") == 600 < us[0].recomputed() == 1000
    cands = ActPlanner(us, {}, device="cuda").candidates(800)
    got = [c for c in cands if "pieces recompute" in c.label]
    assert got and all(c.need_bytes <= 800 for c in cands), [c.label for c in cands]
    assert any(set(c.as_dict().values()) <= {"recompute_pieces_host", "recompute_pieces"} for c in got)
    assert all(need_bytes(us, c.as_dict()) == c.need_bytes for c in got)
    assert not any("pieces" in c.label for c in ActPlanner(us, {}, device="cuda").candidates(1200))


def test_a_vertical_windows_pieces_replay_per_micro_batch():
    """A vertical window's recompute_pieces_ssd unit (G micro-batches, each piece's checkpoint per
    micro-batch) replays: each micro-batch's two checkpoints a block move (the G = 4 paper window
    raised an IndexError where the replay read the pieces of all micro-batches as one's)."""
    from test_planner import GPT2_CUDA, cuda_hw

    from offloadpp.planner import streaming_plan
    from offloadpp.planner.vertical import as_vertical, window_plan, window_profile

    g = 4
    m = analytic_profile(GPT2_CUDA, micro_batch=1, seq_len=512, compute_dtype="bf16")
    kw = dict(device="cuda", compute_dtype="bf16", prefetch_depth=1, optim_prefetch_depth=1)
    plan = window_plan(as_vertical(streaming_plan(m.unit_specs(), micro_batches=g, **kw), g))
    w = window_profile(m, g)
    blocks = [u.name for u in w.units if u.name.startswith("transformer.h.")]
    est = {p: estimate(plan, cuda_hw(), w, activations={b: p for b in blocks})
           for p in ("keep", "recompute_ssd", "recompute_pieces_ssd")}  # fmt: skip
    one = next(a for a in act_units(w) if a.name == blocks[0]).inputs
    assert est["recompute_ssd"].ssd_write_bytes - est["keep"].ssd_write_bytes == len(blocks) * one
    assert est["recompute_pieces_ssd"].ssd_write_bytes - est["keep"].ssd_write_bytes == 2 * len(blocks) * one


@pytest.mark.parametrize(
    "policy", ["recompute_pieces_ssd", "recompute_pieces_refetch_ssd", "partial_last_ssd"]
)
def test_a_plan_counts_every_checkpoint_a_pieces_block_moves(policy):
    """A plan knows its units by their sizes (act_fill.with_activation_sizes), with no pieces: the
    SSD room (ssd_room.activation_ssd_bytes) and `offloadpp plan`'s split counted one checkpoint a
    block under recompute_pieces_ssd, which moves two (the residual stream before each norm), as
    the replay writes them; now the sizes carry the pieces' checkpoints (activations.sized_split).
    partial_last_ssd moves those and the MLP's kept outputs."""
    from dataclasses import replace

    from offloadpp.planner.activations import sized_split
    from offloadpp.planner.plan import fmt_bytes
    from offloadpp.planner.ssd_room import SWAP_ALIGN_BYTES, SWAP_HEADER_BYTES, activation_ssd_bytes

    m, blocks, est = every_block_as((policy,))
    units = {a.name: a for a in act_units(m)}
    moved = {b: units[b].moved(policy) for b in blocks}
    assert est[policy].ssd_write_bytes >= sum(moved.values())  # (the replay writes them all)
    plan = resolved_cpu_plan(m)
    plan = replace(
        plan,
        activations=tuple(policy if u.name in blocks else a for u, a in zip(plan.units, plan.activations)),
    )
    sizes = dict(zip((u.name for u in plan.units), plan.activation_sizes))
    for b in blocks:
        assert sized_split(sizes[b], policy)["ssd"] == moved[b] == split_bytes(units[b], policy)["ssd"]
    if policy.startswith("recompute_pieces"):
        assert moved[blocks[0]] == 2 * units[blocks[0]].inputs
    want = sum(n + SWAP_HEADER_BYTES + (-n % SWAP_ALIGN_BYTES) for n in moved.values())
    assert activation_ssd_bytes(plan) == want
    # (the printout's row: policy, then saved, kept, host, ssd, recomputed, two words each)
    rows = [ln.split() for ln in plan.describe().splitlines() if policy in ln.split()]
    cols = [r[r.index(policy) + 1 :] for r in rows]
    assert cols and all(" ".join(c[6:8]) == fmt_bytes(moved[blocks[0]]) for c in cols), (cols, moved)
