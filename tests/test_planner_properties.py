"""The planner on machines it was not tuned to (issue 36): the property sweep's pieces
(offloadpp/bench/planner_properties.py), a seeded slice of it, and each violation the sweep found
pinned as a test of its own. The long sweep: `offloadpp bench planner-properties`."""

from __future__ import annotations

import math

import pytest

from offloadpp.bench.planner_properties import (
    RESOURCES,
    batch_violations,
    hand_estimates,
    hand_violation,
    more,
    more_violation,
    plan_point,
    planning_summary,
    random_profile,
    sweep,
)


def test_random_profiles_are_seeded_and_within_the_ranges():
    for seed in range(20):
        hw, dtype = random_profile(seed)
        assert (hw, dtype) == random_profile(seed)
        assert 3 <= hw.ssd_read_gbps <= 100 and 1 <= hw.ssd_write_gbps <= 60 and 1 <= len(hw.ssds) <= 16
        sr, sw = hw.striped_gbps() if len(hw.ssds) > 1 else (math.inf, math.inf)
        assert hw.ssd_read_gbps <= sr and hw.ssd_write_gbps <= sw  # the aggregate within the drives' sum
        assert 8 <= hw.h2d_gbps <= 64 and 8 <= hw.memcpy_gbps <= 80
        assert (
            8 * 2**30 <= hw.device_memory_bytes <= 80 * 2**30
            and 32 * 2**30 <= hw.host_memory_bytes <= 2048 * 2**30
        )
        assert 20e12 <= hw.flops_per_s(dtype) <= 1000e12 and dtype in ("fp16", "bf16")
    assert len({random_profile(s)[0].ssd_read_gbps for s in range(20)}) == 20


def test_more_doubles_one_resource_and_nothing_else():
    hw, _ = random_profile(3)
    for r in RESOURCES:
        rich = more(hw, r)
        changed = {k for k in hw.__dataclass_fields__ if getattr(rich, k) != getattr(hw, k)}
        assert changed and changed <= {"host_memory_bytes", "device_memory_bytes", "ssd_read_gbps", "ssd_write_gbps",
                                       "ssds", "h2d_gbps", "d2h_gbps", "adam_params_per_s"}  # fmt: skip
        assert len(changed) <= 3
    with pytest.raises(ValueError, match="unknown resource"):
        more(hw, "luck")


def test_auto_is_within_5pc_of_the_hand_written_plans_on_profile_1():
    """Profile 1, GPT-3 13B's shape at 8 layers, micro-batch 16: every unit's state fits in host
    memory, but a speculative step cannot speculate such units (their updates wait for the end
    of backward, their gradients' norm taken as absorbed: 3.7 s at 8.5 GB/s memcpy). The lower
    bound counted neither, so two dozen in-memory placements (bound near compute, 0.85 s) used up
    the replays before the streaming one (3.64 s); and the read-ahead fixed by the host budget's
    sizing (every unit) hid q = 0. Auto was 1.35x the hand-written 'all on SSD, k=2 q=2'."""
    hw, dtype = random_profile(1)
    p = plan_point(hw, "gpt3-13b@8", 16, dtype)
    assert hand_violation(hw, p) is None
    best = min(s for _, s in hand_estimates(hw, p))
    assert p.step_s <= 1.01 * best


def test_plan_auto_leaves_the_read_ahead_to_the_search():
    """The resolve stage sizes the host budget for a read-ahead (deferred updates: every unit,
    where that fits) and fixed it in the settings, so the search tried no other; plan "auto"
    leaves it to the search: 0..3 for a speculative step (updates during backward), and every
    unit too where updates are deferred."""
    hw, dtype = random_profile(1)
    p = plan_point(hw, "gpt3-13b@2", 16, dtype)
    assert p.resolved.settings.optim_prefetch_depth is None and p.resolved.plan.speculative
    assert {c.plan.optim_prefetch_depth for c in p.resolved.candidates} == {0, 1, 2, 3}


def test_auto_is_within_5pc_of_the_hand_written_plans_on_profile_1_llama():
    """Profile 1, the 7B Llama shape at 8 layers, b64: with every unit's read-ahead offered to a
    speculative step, the search chose it (12.8 s at full depth) over q = 2 (9.7 s)."""
    hw, dtype = random_profile(1)
    p = plan_point(hw, "llama-7b@8", 64, dtype)
    assert hand_violation(hw, p) is None


def test_auto_keeps_a_units_16_bit_copy_with_its_master_as_the_hand_written_fill_does():
    """Profile 6 (666 GiB host, SSD write 2.9 GB/s), the 7B Llama shape, b32: the hand-written
    "moments first" fill keeps each unit's master and its 16-bit copy in host memory (11.96 s);
    the search's fills kept masters and moments but left every copy on SSD (13.49 s, 1.13x).
    fills.WEIGHTS_FILL is that fill (11.96 s)."""
    hw, dtype = random_profile(6)
    p = plan_point(hw, "llama-7b", 32, dtype)
    assert hand_violation(hw, p) is None


def test_a_seeded_slice_of_the_sweep_holds_every_property():
    """The default run's slice: two profiles, a 7B Llama shape cut to 2 layers, three micro-batches
    (the long sweep is `offloadpp bench planner-properties`)."""
    rep = sweep(seed=0, profiles=2, models=["llama-7b@2"], batches=(16, 32, 64), n_more=2,
                properties=("batch", "more", "hand"))  # fmt: skip
    assert rep.points == 6 and rep.checks["batch"] == 4 and rep.checks["hand"] == rep.planned > 0
    assert rep.violations == []
    # each point's planning time, by what replans it alone (the JSON's "times")
    assert [t[:4] for t in rep.times] == [
        (s, "llama-7b@2", random_profile(s)[1], b) for s in (0, 1) for b in (16, 32, 64)
    ]
    assert all(t[5] > 0 for t in rep.times)
    assert all(t[6] > 0 for t in rep.times if t[4] is not None)
    line = planning_summary(rep.times)
    slow = max(rep.times, key=lambda t: t[5])
    assert (
        f"at most {slow[5]:.2f} s of CPU (profile {slow[0]} llama-7b@2 b{slow[3]}; {slow[6]} replays)" in line
    )
    assert line.endswith(f"{sum(t[6] for t in rep.times)} replays in all")


def test_a_points_replays_count_the_planners_work_whatever_the_machine():
    """Each point reports the replays its planning made (cost.replays_made): every candidate the
    search kept was replayed, the slow SSD's replays come on top, and planning the point again
    makes the same number (CPU seconds are the machine's; the count is the planner's)."""
    hw, dtype = random_profile(1)
    a = plan_point(hw, "llama-7b@2", 32, dtype)
    b = plan_point(hw, "llama-7b@2", 32, dtype)
    assert a.step_s is not None and a.replays == b.replays
    assert a.replays >= len(a.resolved.candidates) > 0


_REPLAY_LOG = """
import hashlib, sys
import offloadpp.planner.cost as cost
search = sys.modules["offloadpp.planner.search"]
from offloadpp.bench.planner_properties import plan_point, random_profile
times, replay = [], cost.replay
def logged(*a, **k):
    got = replay(*a, **k)
    times.append(got[0].step_s)
    return got
cost.replay = search.replay = logged
hw, dtype = random_profile(14)
p = plan_point(hw, "gpt3-13b", 64, dtype)
print(p.step_s, p.replays, hashlib.sha256(repr(times).encode()).hexdigest())
"""


def test_the_search_replays_the_same_under_any_hash_seed():
    """Every replay of a search gives the same time in any process: nothing in the replay follows
    a set's order, which the interpreter's hash seed sets. (Profile 14 13B b64: the fetched units
    whose SSD read had ended took the link in a set's order, so the same plan replayed at 77.8 or
    78.7 s by the seed, and the search made 59, 75 or 77 replays to the same pick.)"""
    import os
    import subprocess
    import sys

    def run(seed: str) -> str:
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run(
            [sys.executable, "-c", _REPLAY_LOG], env=env, capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip().splitlines()[-1]

    assert run("1") == run("2") == run("3")


def test_no_cliff_where_a_whole_block_recompute_stops_fitting():
    """Profile 1 (21.7 GiB device, link 10 GB/s), 13B's shape at 8 layers. b64 recomputes every
    block from checkpoints on the host; at b128 a block's recompute passes the activation room.
    Every block went partial and moved 6x the bytes over the link (3.2x the time per token); the
    blocks then recomputed nested from their one checkpoint (recompute_nested*, 1.087x: the
    attention's forward a third time, the head's too); with the head's gradients made in its
    forward (grad_in_forward) and the replay's partial pieces fetched one ahead, 1.039x
    (9.348 against 2 x 4.499 s)."""
    hw, dtype = random_profile(1)
    pts = [plan_point(hw, "gpt3-13b@8", b, dtype) for b in (64, 128)]
    assert batch_violations(pts) == []


@pytest.mark.xfail(
    strict=True, reason="keep.py blind to a speculative plan's lost overlap (docs/performance.md, issue 36)"
)
def test_more_device_memory_is_never_slower():
    """Found, not fixed: profile 0, 13B's shape at 8 layers, b32: twice the device memory keeps
    more compute weights on the device, whose units then cannot speculate (updates after
    backward): 1.056x the step."""
    hw, dtype = random_profile(0)
    base = plan_point(hw, "gpt3-13b@8", 32, dtype)
    assert (
        more_violation(base, plan_point(more(hw, "device memory"), "gpt3-13b@8", 32, dtype), "device memory")
        is None
    )


def test_a_13b_block_too_large_to_recompute_whole_recomputes_nested_not_partial():
    """Profile 0 (11 GiB device, SSD write 5.6 GB/s), 13B's shape at 24 layers: at b64 a block's
    whole recompute (11.26 GiB) passes the activation room, and every block went partial, moving
    12x the checkpoint's bytes to the SSD: 1.108x the time per token of b32 (1.165x at 40
    layers). The blocks recompute nested from their one checkpoint instead (recompute_nested*):
    0.895x; since recompute_pieces*, each piece from its own checkpoint (the attention not run a
    second time), half the blocks partial: 0.772x (0.726x since partial keeps no output backward
    never reads: runtime/activations/partial.py)."""
    hw, dtype = random_profile(0)
    pts = [plan_point(hw, "gpt3-13b@24", b, dtype) for b in (32, 64)]
    assert batch_violations(pts) == []
    got = pts[1].resolved.plan.activations
    assert any(p.startswith(("recompute_nested", "recompute_pieces")) for p in got)
    assert sum(p.startswith("partial") for p in got) <= len(got) // 2


def test_the_robust_pick_gives_up_at_most_nominal_give_of_the_nominal_estimate():
    """Profile 7 (10 GiB device, SSD write 5.0 GB/s), the 7B Llama shape, b32 -> b64: the robust
    pick's tie-break (means within 1% go to fewer SSD bytes) took a nested plan at 110.06 s
    against the best's 102.46 s (17% fewer SSD bytes): 1.111x the time per token of b32. It now
    chooses only among candidates within NOMINAL_GIVE of the best estimate. (The whole model:
    cut to 4-28 layers, no candidate with fewer SSD bytes comes within the tie.)"""
    from offloadpp.planner.search import NOMINAL_GIVE

    hw, dtype = random_profile(7)
    pts = [plan_point(hw, "llama-7b", b, dtype) for b in (32, 64)]
    assert batch_violations(pts) == []
    best = min(c.estimate.step_s for c in pts[1].resolved.candidates)
    assert pts[1].step_s <= best * (1 + NOMINAL_GIVE)


def test_twice_the_link_never_makes_the_robust_pick_slower():
    """Profile 2 (bf16), the 7B Llama shape, b128: with twice the link the best estimate is 41.82 s
    (41.88 s without), and the robust pick took a plan at 42.44 s within its 2% window (its mean
    on the slow SSD within 1% of the best's, 1.2% fewer SSD bytes): 1.013x the step, over the
    1% that more of a resource may cost. The pick now gives up at most NOMINAL_GIVE, within
    MORE_SLACK (the paper's 13B b8 x 4 window, which the 2% kept vertical, stays vertical through
    decide.loop_candidates: tests/test_resolve.py)."""
    from offloadpp.bench.planner_properties import MORE_SLACK
    from offloadpp.planner.search import NOMINAL_GIVE

    assert NOMINAL_GIVE <= MORE_SLACK
    hw, dtype = random_profile(2)
    base = plan_point(hw, "llama-7b", 128, dtype)
    assert more_violation(base, plan_point(more(hw, "link"), "llama-7b", 128, dtype), "link") is None


def test_undominated_leaves_out_a_candidate_another_beats_on_every_measure():
    from offloadpp.planner.dominance import undominated

    times = {"a": (1.0, 1.0), "b": (1.1, 1.2), "c": (1.05, 0.9), "d": (1.0, 1.0), "e": (1.0, 1.3)}
    assert undominated(list(times), times.get) == ["a", "c", "d"]  # (equal ones both stay)


def test_the_robust_pick_never_takes_a_plan_slower_on_both_ssds():
    """docs/paper's data-sheet profile, GPT-3 13B b128: the robust pick's tie-break (means within
    TIE_FRAC go to fewer SSD bytes) took a plan at 73.193 s nominal and 73.353 s on the slow SSD,
    0.5% fewer SSD bytes, over the best's 72.550 s on both: 0.991x b64's model TFLOPS (issue 36's
    data-sheet bar). A candidate another beats on both SSDs is now out of the tie-break
    (dominance.undominated): no candidate within the pick's NOMINAL_GIVE beats the pick on both,
    and b128's step per token is within 0.1% of b64's."""
    import sys

    import offloadpp.planner.search  # noqa: F401  (the module, not the function planner exports)
    from offloadpp.bench.planner_properties import CONFIG, SEQ_LEN, model_config
    from offloadpp.bench.planner_scale import _settings
    from offloadpp.planner import HardwareProfile, analytic_profile, resolve
    from offloadpp.planner.dominance import undominated
    from offloadpp.planner.resolve import machine_for

    search_mod = sys.modules["offloadpp.planner.search"]
    hw = HardwareProfile.from_json("docs/paper/rtx4090-datasheet.hardware.json")
    picks, pick = [], search_mod.robust_pick

    def robust_pick(cands, *a, **k):
        picks.append((cands, a, k, pick(cands, *a, **k)))
        return picks[-1][-1]

    steps = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search_mod, "robust_pick", robust_pick)
        for b in (64, 128):
            prof = analytic_profile(
                model_config("gpt3-13b"), micro_batch=b, seq_len=SEQ_LEN, compute_dtype="fp16"
            )
            r = resolve(
                _settings(CONFIG, "fp16", b), prof.unit_specs(), machine_for(hw), hardware=hw, model=prof
            )
            steps[b] = r.estimate.step_s
    cands, (_, _, _, _, on_slow), _, got = picks[-1]
    best = cands[0].estimate.step_s
    near = [c for c in cands if c.estimate.step_s <= best * (1 + search_mod.NOMINAL_GIVE)]
    assert len(near) > 1  # (a tie-break to make)
    both = {id(c): (c.estimate.step_s, on_slow(c.plan, dict(c.activations)).step_s) for c in near}
    assert got in undominated(near, lambda c: both[id(c)])  # (none beats it on both SSDs)
    assert steps[128] / 128 <= 1.001 * steps[64] / 64, steps


def test_a_partial_units_later_pieces_do_not_hold_the_link_ahead_of_the_weights():
    """Profile 29 (9.7 GiB device, link 23 GB/s), the 7B Llama shape at 4 layers, b32 -> b64:
    every block partial_host, and at b64 no room for a second weight buffer (k = 0: each unit's
    weights are fetched at its visit). The replay queued a prefetched unit's other pieces on the
    link with its last one, so the next unit's weights waited behind them: 1.128x the time per
    token of b32. The runtime fetches them one piece ahead of their recompute (backward.py), and
    the replay now copies them up from the unit's backward on: 1.043x. (At 32 layers the rest is
    k = 0's exposed weight fetches: docs/performance.md, issue 36.)"""
    hw, dtype = random_profile(29)
    pts = [plan_point(hw, "llama-7b@4", b, dtype) for b in (32, 64)]
    assert set(pts[1].resolved.plan.activations) >= {"partial_host"}
    assert batch_violations(pts) == []


def test_a_partial_pieces_kept_outputs_read_by_its_recompute_only_make_room_for_the_next_block():
    """Profile 29 (9.7 GiB device, 7.79 GiB budget, link 23 GB/s), the 7B Llama shape, b32 -> b64:
    every block partial_host. At b64 the next block's MLP records (3.19 GiB) came back beside a
    block's pieces only where its largest piece left room: the attention's 4.51 GiB (its
    records, and q/k's projections and o_proj's output, which its recompute reads and its
    backward does not) left none in any room the device gives (at most 7.04 GiB, every weight
    streamed): 1.069x the time per token of b32 (38.99 s against 18.24). Those outputs are now
    released once the piece's recompute ran (runtime/activations/saves.py `_release_replayed`),
    so the attention's backward holds 3.01 GiB and the next block comes back during it, beside
    a streamed placement (room 6.66 GiB): 1.006x. (Cut to 4-8 layers no cliff shows.)"""
    hw, dtype = random_profile(29)
    pts = [plan_point(hw, "llama-7b", b, dtype) for b in (32, 64)]
    assert set(pts[1].resolved.plan.activations) >= {"partial_host"}
    assert batch_violations(pts) == []


def test_the_next_blocks_records_come_back_within_a_pieces_backward():
    """Profile 8 (12.5 GiB device, link 8.8 GB/s), the 7B Llama shape at 8 layers, b64 -> b128:
    every block partial_host, k = 0, a 9.21 GiB activation room at b128. A block's attention
    held 6.02 GiB until its backward ended, so the next block's MLP records (7.38 GiB) were
    copied up only during the block's first norm and after it, in series with the compute:
    1.138x the time per token of b64 (the whole model, its host spilling to SSD: 1.137x). A
    swapped piece now releases what its backward's nodes are done with (the attention's rotated
    q/k, v, output and statistics a third of the way in: runtime/activations/recompute.py, Note
    on release within a piece; the replay's piece_freed): 1.031x (whole model 1.030x)."""
    hw, dtype = random_profile(8)
    pts = [plan_point(hw, "llama-7b@8", b, dtype) for b in (64, 128)]
    assert set(pts[1].resolved.plan.activations) >= {"partial_host"}
    assert batch_violations(pts) == []


def test_a_partial_unit_read_from_ssd_waits_for_its_first_piece_only():
    """Profile 8 (12.5 GiB device, link 8.8 GB/s, SSD write 4.7 GB/s), 13B's shape at 8 layers
    with 60 GiB of host memory (the full sweep's 250 GiB at 40 layers: the host takes the partial
    outputs of 29 blocks, the other 11 go to SSD): at b64 4 blocks partial_ssd. The replay waited
    for all of a partial_ssd block's pieces to be copied up before its backward (0.92 s of 8.8
    GB/s a block at 40 layers), where the host's blocks wait for their first piece: 1.089x the
    time per token of b32 (1.065x at 40 layers). The runtime fetches a block's pieces one ahead
    of their recompute, read or not: now 1.037x (40 layers: 1.030x)."""
    from dataclasses import replace

    hw, dtype = random_profile(8)
    hw = replace(hw, host_memory_bytes=60 * 2**30)
    pts = [plan_point(hw, "gpt3-13b@8", b, dtype) for b in (32, 64)]
    assert "partial_ssd" in pts[1].resolved.plan.activations
    assert batch_violations(pts) == []


def test_the_best_activation_choice_is_tried_on_the_other_fills():
    """Profile 1 (21.7 GiB device, 198 GiB host budget, link 10 GB/s), 13B's shape at 16 layers,
    b128: each placement is replayed first with its activation choice of least bound, partial_host
    (the bound leaves out the activations' link traffic), so the placements holding the state in
    host memory were replayed only with it and lost to SSD-streaming ones recomputing nested:
    1.058x the hand-written 'last units first, k=1 q=1' (40 layers: 43.97 against 40.72 s). The
    best's choice is now replayed on other fills too (search.py, Note on step 3)."""
    hw, dtype = random_profile(1)
    p = plan_point(hw, "gpt3-13b@16", 128, dtype)
    assert hand_violation(hw, p) is None


def test_the_best_activation_choice_is_tried_at_its_fills_other_weights_prefetch_depth():
    """docs/paper's data-sheet profile, GPT-3 13B b48: streaming every unit, k = 2 with every
    block partial_host is the best plan (27.17 s), and k = 1 with the same choice 28.21 s. Once
    a partial piece's kept outputs read only by its recompute made room for the next block
    (simulate_act.py `_hold`), placements leaving the activations less room replayed faster,
    and k = 2's placement, replayed first with its choice of least bound (swapping whole
    units, 55.5 s), fell out of step 2's few: 28.21 s, 1.038x. The best's choice (with or
    without its head twin) is now replayed on its own fill at the other weights' prefetch depth
    of least bound too (search.py, Note on step 3)."""
    from offloadpp.bench.planner_properties import CONFIG, SEQ_LEN, model_config
    from offloadpp.bench.planner_scale import _settings
    from offloadpp.planner import HardwareProfile, analytic_profile, resolve
    from offloadpp.planner.resolve import machine_for

    hw = HardwareProfile.from_json("docs/paper/rtx4090-datasheet.hardware.json")
    prof = analytic_profile(model_config("gpt3-13b"), micro_batch=48, seq_len=SEQ_LEN, compute_dtype="fp16")
    r = resolve(_settings(CONFIG, "fp16", 48), prof.unit_specs(), machine_for(hw), hardware=hw, model=prof)
    k1 = min(c.estimate.step_s for c in r.candidates if c.plan.prefetch_depth == 1)
    assert r.plan.prefetch_depth == 2 and r.estimate.step_s < k1, (
        r.plan.prefetch_depth,
        r.estimate.step_s,
        k1,
    )


@pytest.mark.parametrize("model", ["llama-7b", "gpt3-13b"])
def test_no_cliff_where_nested_runs_the_attention_again(model):
    """Profile 9 (19.1 GiB device, SSD write 3.0 GB/s, compute-bound at b128): b128's blocks
    recomputed nested from their one checkpoint, whose second attention forward made the step
    1.115x (Llama 7B) and 1.087x (13B) the time per token of b64. Each piece from its own
    checkpoint (recompute_pieces*: one forward, two checkpoints a block): 1.030x (97.17 against
    47.17 s) and 1.013x (191.62 against 94.58 s; 1.035x, 185.59 against 89.65 s, once partial kept
    no output backward never reads: b64 mixes it in, b128's room cannot). (Both whole: at 16 layers b64 gains more than
    b128 from what came later, the Llama's smaller MLP and, for 13B, SSD reads staged ahead of
    the device room with a recompute releasing piece by piece: 1.061x and 1.056x.)"""
    hw, dtype = random_profile(9)
    pts = [plan_point(hw, model, b, dtype) for b in (64, 128)]
    assert batch_violations(pts) == []
    assert any(p.startswith("recompute_pieces") for p in pts[1].resolved.plan.activations)


def test_no_cliff_where_a_whole_recompute_fills_the_room():
    """Profile 1 (21.7 GiB device, link 10 GB/s), Llama 7B's shape at 16 layers, b128: a block's
    whole recompute (15.4 GiB) fills the activation room, and a recompute held all of it until
    the block's backward ended, so the next block's checkpoint came back only then, in series
    with the compute (or, leaving the weights no room to prefetch, the weights did): 1.124x the
    time per token of b64 (whole model 1.155x). A recompute now releases each piece's bytes as
    its backward ends (runtime/activations/recompute.py, Note on release; the replay as the
    runtime): 0.974x, every block recomputing whole."""
    hw, dtype = random_profile(1)
    pts = [plan_point(hw, "llama-7b@16", b, dtype) for b in (64, 128)]
    assert batch_violations(pts) == []
    assert "recompute_host" in pts[1].resolved.plan.activations


def test_no_cliff_where_pieces_wait_on_the_link_and_nested_on_the_compute():
    """Profile 1, GPT-3 13B, b128: every block recomputed piece by piece (recompute_pieces*), its
    forward waiting on the link for two checkpoints a block: 1.064x the time per token of b64
    (39.49 against 18.55 s); nested alone, releasing its pieces' bytes as their backward ends,
    1.054x. Half the blocks nested, half pieces, spread evenly (act_candidates._pieces): 1.025x
    (38.03 s)."""
    hw, dtype = random_profile(1)
    pts = [plan_point(hw, "gpt3-13b", b, dtype) for b in (64, 128)]
    assert batch_violations(pts) == []
    got = pts[1].resolved.plan.activations
    assert any(p.startswith("recompute_nested") for p in got) and any(
        p.startswith("recompute_pieces") for p in got
    )


def test_ssd_reads_run_ahead_of_a_device_room_that_holds_one_block():
    """Profile 15 (18.2 GiB device, SSD read 3.1 GB/s, 21 TFLOP/s), the 7B Llama shape at 8 layers
    with 80 GiB of host memory: at b128 a block's partial records (13.4 GiB) fill the activation
    room, and the host takes only some blocks' records. A read bound for the device counts there
    from its start, so each partial_ssd block's read ran between two blocks' backward, and the
    search recomputed instead: 1.142x the time per token of b64 (32 layers: 1.179x). The next
    blocks' SSD reads now start into host memory as backward reaches a block, their copy up
    waiting for the room (runtime/activations/swap.py, Note on staging): 0.996x (32 layers:
    1.021x)."""
    from dataclasses import replace

    hw, dtype = random_profile(15)
    hw = replace(hw, host_memory_bytes=80 * 2**30)
    pts = [plan_point(hw, "llama-7b@8", b, dtype) for b in (64, 128)]
    assert "partial_ssd" in pts[1].resolved.plan.activations
    assert batch_violations(pts) == []


def test_a_staged_read_is_copied_up_when_its_unit_is_fetched():
    """Profile 4 (15.1 GiB device, link 9.6 GB/s, SSD read 8.7 GB/s), the 7B Llama shape at 16
    layers with 150 GiB of host memory: at b128 a third of the blocks partial_ssd. Read into host
    memory ahead (see the test above), a block's first piece was still copied up only when
    backward reached it, behind the link's weights, where the runtime copies a staged record up
    as it is fetched (swap.py fetch: HOST, _into_device): 1.051x the time per token of b64
    (main: 1.119x; 32 layers 1.120x). Copied up at the fetch: 1.041x (32 layers: 1.048x). With
    the faithful first fetch (the MLP's records and the second norm's checkpoint, 7.4 GiB) that
    fetch did not fit beside the block before's attention piece (6.0 GiB of a 10.6 GiB room), and
    counted piece by piece none of it came back before that block's last piece, a norm: 1.055x
    (the whole point below: 1.056x). Counted record by record, as the runtime's `_fetch_unit`
    takes them, with a read that ends before the unit's backward copied up then (swap.py
    `_advance_in`; planner/simulate_fetch.py): 1.007x; a swapped piece releasing what its
    backward is done with (the attention's 6 GiB a third of the way in:
    test_the_next_blocks_records_come_back_within_a_pieces_backward) alone gave 1.004x."""
    from dataclasses import replace

    hw, dtype = random_profile(4)
    hw = replace(hw, host_memory_bytes=150 * 2**30)
    pts = [plan_point(hw, "llama-7b@16", b, dtype) for b in (64, 128)]
    assert "partial_ssd" in pts[1].resolved.plan.activations
    assert batch_violations(pts) == []


def test_no_cliff_where_a_first_fetch_fits_beside_the_attention_piece_only_in_part():
    """The sweep's point of the test above: profile 4 (its own 298 GiB of host memory), the whole
    Llama 7B, b128 (21 blocks partial_host, 11 partial_ssd): each block's backward waited 0.44 s
    for its first fetch, 1.056x the time per token of b64 (264.960 against 125.441 s); 1.005x
    (252.238 s: 0.03 s a block) with that fetch taken record by record."""
    hw, dtype = random_profile(4)
    pts = [plan_point(hw, "llama-7b", b, dtype) for b in (64, 128)]
    assert "partial_ssd" in pts[1].resolved.plan.activations
    assert batch_violations(pts) == []


def _profile_4_llama_8_layers():
    """Random profile 4 (fp16, 15.1 GiB device, link 9.6 GB/s, SSD read 8.7 GB/s) with the host
    memory cut as the model is (60 GiB for 8 of the 7B Llama's 32 layers): at b128 five blocks
    partial_ssd, as a third of the whole model's."""
    from dataclasses import replace

    hw, dtype = random_profile(4)
    return replace(hw, host_memory_bytes=60 * 2**30), dtype


def test_twice_the_device_memory_reads_ahead_as_the_normal_room_stages():
    """Found by session 9's `--more 5` (profile 4, the whole Llama b128: 258.453 s with twice the
    device memory against 252.825 s, 1.022x; here 69.210 against 67.289 s, 1.029x). In the normal
    room the next partial_ssd blocks' reads were staged into host memory as backward reached a
    block (swap.py, Note on staging) and copied up when fetched; in twice the room the prefetch
    took them first, straight from SSD, and the replay copied such a read up only at its unit's
    backward, behind the link's weights, where the runtime's pump starts the copy once the read
    ends (swap.py `_advance_in`, pinned on the stand-in by test_activations_staging). Copied up
    at the read's end (planner/simulate_fetch.py `_copy_up_read`): 66.469 against 67.289 s."""
    hw, dtype = _profile_4_llama_8_layers()
    base = plan_point(hw, "llama-7b@8", 128, dtype)
    assert "partial_ssd" in base.resolved.plan.activations
    rich = plan_point(more(hw, "device memory"), "llama-7b@8", 128, dtype)
    assert more_violation(base, rich, "device memory") is None


def test_a_larger_activation_room_never_slows_the_same_plan():
    """The cause of the test above, in the replay alone: the normal room's plan replayed with half
    as much room again (its reads then fetched straight from SSD, not staged) took 70.740 s
    against 67.289 s; the same now."""
    from dataclasses import replace

    from offloadpp.planner.cost import estimate
    from offloadpp.planner.spec import Budgets

    hw, dtype = _profile_4_llama_8_layers()
    p = plan_point(hw, "llama-7b@8", 128, dtype)
    r, b = p.resolved, p.resolved.plan.budgets
    for extra in (b.activation_bytes // 2, b.activation_bytes):
        plan = replace(r.plan, budgets=Budgets(b.device_bytes + extra, b.host_bytes,
                                               activation_bytes=b.activation_bytes + extra))  # fmt: skip
        e = estimate(plan, more(hw, "device memory"), p.profile, adam_threads=r.settings.adam_threads,
                     micro_batches=r.settings.gradient_accumulation_steps,
                     act_prefetch_units=r.settings.activations.prefetch_units)  # fmt: skip
        assert e.step_s <= p.step_s * (1 + 1e-9), (extra, e.step_s, p.step_s)


def test_the_best_mix_of_partial_and_recompute_is_moved_to_the_balance():
    """Profile 17 (bf16), the 7B Llama shape, b32 -> b64: compute-bound; the room leaves 20 blocks
    recomputing or partial, and the mixes' quarter steps put 10 of them partial (10.374 s, 1.052x the
    time per token of b32) where the link and the compute balance at 12 (10.249 s). The best mix's
    split is now moved a unit at a time while it gets faster (act_refine.py): a few replays."""
    hw, dtype = random_profile(17)
    pts = [plan_point(hw, "llama-7b", b, dtype) for b in (32, 64)]
    assert batch_violations(pts) == []


def test_the_data_sheet_b128_is_no_slower_per_token_than_b64():
    """docs/paper's data-sheet profile, GPT-3 13B: b128's step per token is no slower than b64's
    (issue 36's data-sheet bar). Both forwards were bound by the device-to-host link, and the
    fixed activation room absorbs one micro-batch's link deficit whatever its size, so b64 drained
    one room more per 128 samples (72.550 s against 2 x 36.254 s: 0.9994x). A partial block kept
    and moved its two projections' outputs, which backward never reads (runtime/activations/
    partial.py, Note on outputs backward never reads): without them it moves 10 x width a token,
    not 12, both forwards run at their compute floor, and b128 gains its halved fixed costs."""
    from offloadpp.bench.planner_properties import CONFIG, SEQ_LEN, model_config
    from offloadpp.bench.planner_scale import _settings
    from offloadpp.planner import HardwareProfile, analytic_profile, resolve
    from offloadpp.planner.activations import act_units
    from offloadpp.planner.resolve import machine_for

    hw = HardwareProfile.from_json("docs/paper/rtx4090-datasheet.hardware.json")
    steps = {}
    for b in (64, 128):
        prof = analytic_profile(
            model_config("gpt3-13b"), micro_batch=b, seq_len=SEQ_LEN, compute_dtype="fp16"
        )
        blk, x = act_units(prof)[1], b * SEQ_LEN * 5120 * 2  # (a width-sized tensor)
        assert (
            blk.moved("partial_host") == 10 * x + 2 * b * SEQ_LEN * 40 * 2
        )  # (and the attention's statistics)
        r = resolve(_settings(CONFIG, "fp16", b), prof.unit_specs(), machine_for(hw), hardware=hw, model=prof)
        steps[b] = r.estimate.step_s
    assert steps[128] / 128 <= steps[64] / 64, steps


def test_a_room_only_pieces_fit_is_tried_at_every_prefetch_depth():
    """Random profile 0, Llama 7B fp16 b128: a partial block's attention piece holds 8.02 GiB (the
    q and k kept before the rotation), recomputed piece by piece 7.38 GiB. The search tried only
    the prefetch depths whose room the least need fits, and the least counted partial, not
    pieces: only k = 0 (8.07 GiB), every unit's weights fetched at its visit (77.54 s, 1.141x the
    time per token of b64). Pieces fit k = 1's room too: weights fetched a visit ahead (75.08 s,
    1.104x: the pieces' second forward is what is left, partial's bytes would go to an SSD
    writing at 5.6 GB/s beside a 10 GiB host budget)."""
    hw, dtype = random_profile(0)
    pt = plan_point(hw, "llama-7b", 128, dtype)
    plan = pt.resolved.plan
    assert plan.prefetch_depth >= 1
    assert any(p.startswith("recompute_pieces") for p in plan.activations)
    slower = [c.estimate.step_s for c in pt.resolved.candidates if c.plan.prefetch_depth == 0]
    assert slower and pt.step_s < min(slower)


def test_partials_least_room_is_still_set_aside_beside_pieces():
    """Random profile 29, Llama 7B fp16 b32: the fills made leaving the activations only the least
    they need keep more weights on the device. Partial's least (2.00 GiB) let every block be
    partial_host beside two weights buffers in flight (k = 2: 18.146 s); with the least counting
    pieces (less), that room was no longer set aside, and the pick fell to k = 1 (18.240 s)."""
    hw, dtype = random_profile(29)
    plan = plan_point(hw, "llama-7b", 32, dtype).resolved.plan
    assert plan.prefetch_depth == 2
    assert all(
        p == "partial_host" for u, p in zip(plan.units, plan.activations) if u.name.startswith("model.layers")
    )


def test_a_13b_blocks_mlp_recompute_leaves_room_for_a_second_weights_buffer():
    """Random profile 29 (9.7 GiB device), GPT-3 13B bf16, b32 -> b64: a partial_host block's MLP
    recompute held 6.25 GiB (the second norm's checkpoint beside its output, c_fc's and the GELU's),
    which k = 1's room (6.03 GiB beside two weights buffers) does not take: k = 0, each unit's
    weights fetched at its visit, 80.33 s, 1.121x the time per token of b32. partial_refetch_host
    sends the checkpoint back to host memory once the MLP's argument is made from it (runtime/
    activations/saves.py `_evict_source`), fetched again for the norm's backward: the MLP holds
    5.625 GiB, and the search offers it at the room partial_host's least does not fit
    (act_candidates.py, Note on refetch): k = 1."""
    hw, dtype = random_profile(29)
    pts = [plan_point(hw, "gpt3-13b", b, dtype) for b in (32, 64)]
    plan = pts[1].resolved.plan
    assert plan.prefetch_depth >= 1
    assert "partial_refetch_host" in plan.activations
    assert "partial_refetch_host" not in pts[0].resolved.plan.activations  # (its room holds the sources)
    assert batch_violations(pts) == []
    assert pts[1].per_token_s <= 1.0 * pts[0].per_token_s


def test_refetch_deepens_the_prefetch_of_a_point_that_fits_but_fits_no_point_alone():
    """Random profile 29, Llama 7B bf16 b128: no prefetch depth leaves the room for the least need
    with the sources held; the refetching twin's would fit k = 0, each unit's weights fetched at
    its visit, 1.08-1.15x b64's time per token. search.least_need refuses it, as before the
    refetch policies, and the message names the largest micro-batch that fits (from the held
    least: infeasible.py)."""
    hw, dtype = random_profile(29)
    pt = plan_point(hw, "llama-7b", 128, dtype)
    assert pt.step_s is None and "largest micro-batch that fits is" in pt.refused, pt.refused
