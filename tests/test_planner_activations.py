"""The planner's activation choices (planner/activations.py) and their replay (simulate_act.py):
recompute with the activation checkpoint swapped to host or SSD, chosen where pinning the
checkpoints does not fit, counted in the device need and the step's bytes as the runtime does;
partial (selective) recompute, its bytes and its replay; the per-unit split in the plan printout;
the paper machine's GPT-3 13B sweep planned."""

from __future__ import annotations

import json
import os
from dataclasses import replace as dc_replace

import pytest
from test_planner import GPT2, cpu_hw

from offloadpp.planner import InfeasibleError, Machine, PlanError, Settings, resolve
from offloadpp.planner.act_candidates import HEAD_TWIN_SHARE, ActPlanner
from offloadpp.planner.activations import (
    REFETCH,
    TAIL,
    TAIL_PIECES,
    ActUnit,
    act_units,
    backward_bytes,
    evicted,
    forward_bytes,
    forward_moved,
    held_bytes,
    need_bytes,
    piece_peaks,
    recompute_fraction,
    split_bytes,
)
from offloadpp.planner.cost import estimate
from offloadpp.planner.hardware import HardwareProfile
from offloadpp.planner.model_profile import ModelProfileError, analytic_profile
from offloadpp.planner.spec import ActivationSettings
from offloadpp.planner.vertical import window_profile

PAPER = os.path.join(os.path.dirname(__file__), "..", "docs", "paper")


def _units(n: int = 10, saved: int = 1000, inputs: int = 100) -> list[ActUnit]:
    return [ActUnit(f"u{i}", saved, inputs, 10 * saved, True) for i in range(n)]


def test_swapped_checkpoints_are_offered_where_pinned_ones_do_not_fit():
    us = _units()
    planner = ActPlanner(us, {}, device="cuda")
    room = 1300  # one unit's saved bytes and three checkpoints: pinning all ten (1900) does not fit
    assert need_bytes(us, {u.name: "recompute" for u in us}) == 1900
    cands = planner.candidates(room)
    assert cands and all(c.need_bytes <= room for c in cands)
    ckpt = [c for c in cands if "checkpoints to host" in c.label and "100%" in c.label]
    assert ckpt, [c.label for c in cands]
    pol = ckpt[0].as_dict()
    # every unit recomputes; the checkpoints that fit stay pinned, the others go to host memory
    assert set(pol.values()) <= {"recompute", "recompute_host", "keep"}
    assert "recompute_host" in pol.values() and need_bytes(us, pol) <= room
    # on the CPU acting as the device host memory is the device's: the checkpoints go to SSD
    cpu = ActPlanner(us, {}, device="cpu").candidates(room)
    assert any("recompute_ssd" in c.as_dict().values() for c in cpu)
    assert not any("recompute_host" in c.as_dict().values() for c in cpu)


def test_split_says_where_each_units_bytes_are():
    u = ActUnit("b", 1000, 100, 1, True)
    assert split_bytes(u, "keep") == {"kept": 1000, "host": 0, "ssd": 0, "recomputed": 0}
    assert split_bytes(u, "ssd") == {"kept": 0, "host": 0, "ssd": 1000, "recomputed": 0}
    assert split_bytes(u, "recompute") == {"kept": 100, "host": 0, "ssd": 0, "recomputed": 1000}
    assert split_bytes(u, "recompute_host") == {"kept": 0, "host": 100, "ssd": 0, "recomputed": 1000}
    assert split_bytes(u, "recompute_ssd") == {"kept": 0, "host": 0, "ssd": 100, "recomputed": 1000}


def test_partial_holds_its_kept_outputs_and_recomputes_the_rest():
    u = ActUnit("b", 1000, 100, 1, True, partial=400, partial_extra=50)
    assert split_bytes(u, "partial") == {"kept": 500, "host": 0, "ssd": 0, "recomputed": 650}
    assert split_bytes(u, "partial_host") == {"kept": 0, "host": 500, "ssd": 0, "recomputed": 650}
    assert split_bytes(u, "partial_ssd") == {"kept": 0, "host": 0, "ssd": 500, "recomputed": 650}
    us = [ActUnit(f"u{i}", 1000, 100, 10_000, True, 400, 50) for i in range(4)]
    # three partial units hold their checkpoints and kept outputs; the last one's backward holds all
    # it saved and the kept outputs autograd does not save
    assert need_bytes(us, {x.name: "partial" for x in us}) == 3 * 500 + 1050
    assert need_bytes(us, {x.name: "partial_host" for x in us}) == 1050


def test_need_counts_a_partial_units_forward_when_it_holds_more_than_its_backward():
    """A partial unit kept on the device holds every piece's checkpoint and kept outputs from its
    forward on; with a small last piece that is more than its backward holds piece by piece, and
    the need (so the largest micro-batch) must count it. Swapped, its forward holds one piece's
    at a time (each waits for the earlier ones' copies). The replay's peak stays within the need
    when the budget is the need."""
    from dataclasses import replace

    from offloadpp.planner.activations import backward_bytes, forward_bytes

    pieces = ((10, 100, 0, 0), (300, 100, 250, 50), (10, 100, 0, 0), (20, 100, 150, 0))
    u = ActUnit("b", 340, 100, 1, True, partial=400, partial_extra=50, pieces=pieces)
    assert forward_bytes(u, "partial") == 800 > backward_bytes(u, "partial") == 570
    assert forward_bytes(u, "partial_host") == 350 < backward_bytes(u, "partial_host") == 450
    us = [replace(u, name=f"u{i}") for i in range(3)]
    assert need_bytes(us, {x.name: "partial" for x in us}) == 3 * 800
    assert need_bytes(us, {x.name: "partial_host" for x in us}) == 450
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64)
    r = resolve(Settings(plan="auto"), m.unit_specs(),
                Machine("cpu", host_available_bytes=8 << 30, device_free_bytes=8 << 30, cores=2),
                hardware=cpu_hw(), model=m)  # fmt: skip
    blocks = {u.name: "partial_host" for u in m.units if u.name.startswith("transformer.h.")}
    need = need_bytes(act_units(m), blocks)
    plan = replace(r.plan, budgets=replace(r.plan.budgets, activation_bytes=need))  # a budget that binds
    assert estimate(plan, cpu_hw(), m, activations=blocks).peak_activation_bytes <= need


def test_partial_and_recompute_mixed_are_offered_spread_evenly():
    us = [ActUnit(f"u{i}", 1000, 100, 10_000, True, 400, 50) for i in range(8)]
    room = 1050  # one unit kept (the last), the others' records leave the device
    cands = {c.label: c for c in ActPlanner(us, {}, device="cuda").candidates(room)}
    half = cands["partial 50%, recompute the rest with checkpoints to host"].as_dict()
    want = ["partial_host", "recompute_host"] * 3 + ["partial_host", "keep"]  # every other unit
    assert list(half.values()) == want
    plain = ActPlanner(us, {}, device="cuda", mixes=False).candidates(room)
    assert not any("recompute the rest" in c.label for c in plain)


def test_the_best_mix_is_moved_a_unit_at_a_time_while_it_gets_faster():
    """act_refine.balance: from the best quarter-step mix, one more partial unit at a time while each
    is faster (a stand-in replay whose step is least at a given count of partial units), else one
    fewer at a time, never beyond a quarter of the units either way; a choice that is no mix is
    left alone."""
    from offloadpp.planner.act_refine import balance

    us = [ActUnit(f"u{i}", 1000, 100, 10_000, True, 400, 50) for i in range(8)]
    planner, room = ActPlanner(us, {}, device="cuda"), 1050  # (one unit kept: the last)
    cands = {c.label: c for c in planner.candidates(room)}
    half = cands["partial 50%, recompute the rest with checkpoints to host"]
    assert half.mix is not None and (half.mix.partial, half.mix.of) == (4, 8)

    def partial(c) -> int:
        return sum(p.startswith("partial") for _, p in c.policies)

    def stand_in(target: int):
        return lambda c: 1.0 + (partial(c) - target) ** 2

    tried = balance(planner, half, room, stand_in(5)(half), stand_in(5))
    assert [partial(c) for c in tried] == [5, 6]  # up while faster: one past the balance
    assert all(c.need_bytes <= room and c.mix.partial == partial(c) for c in tried)
    assert [partial(c) for c in balance(planner, half, room, 1.0 + 16, stand_in(8))] == [5, 6]  # (a quarter)
    assert [partial(c) for c in balance(planner, half, room, 1.0 + 9, stand_in(1))] == [
        5,
        3,
        2,
    ]  # up slower: down
    assert balance(planner, cands["swap to host, keep what fits"], room, 1.0, stand_in(6)) == []


def test_partial_is_offered_where_the_profile_knows_its_bytes():
    us = [ActUnit(f"u{i}", 1000, 100, 10_000, True, 400, 50) for i in range(10)]
    room = 2600  # keeping all (10000) or pinning every checkpoint and kept output (5550) does not fit
    cands = ActPlanner(us, {}, device="cuda").candidates(room)
    part = [c for c in cands if c.label.startswith("partial 100%")]
    assert part and part[0].need_bytes <= room, [c.label for c in cands]
    pol = part[0].as_dict()
    assert {"partial", "partial_host"} <= set(pol.values()) <= {"partial", "partial_host", "keep"}
    # a profile that does not know the partial bytes gets no partial candidate
    assert not any("partial" in c.label for c in ActPlanner(_units(), {}, device="cuda").candidates(1300))


def test_replay_of_partial_moves_the_kept_outputs_and_recomputes_no_matmul():
    """CPU device: partial_ssd writes and reads each block's pieces' checkpoints (the inputs of
    its two norms: the attention's and the MLP's are the norms' outputs, derived again) and kept
    outputs once per step, and adds no compute (its recompute runs no matmul)."""
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64)
    r = resolve(Settings(plan="auto"), m.unit_specs(),
                Machine("cpu", host_available_bytes=8 << 30, device_free_bytes=8 << 30, cores=2),
                hardware=cpu_hw(), model=m)  # fmt: skip
    blocks = [u.name for u in m.units if u.name.startswith("transformer.h.")]
    est = {
        p: estimate(r.plan, cpu_hw(), m, activations={b: p for b in blocks}) for p in ("keep", "partial_ssd")
    }
    moved = sum(a.moved("partial_ssd") for a in act_units(m) if a.name in blocks)
    assert moved == sum(a.partial + 2 * a.inputs for a in act_units(m) if a.name in blocks)  # two norms
    assert est["partial_ssd"].ssd_write_bytes - est["keep"].ssd_write_bytes == moved
    assert est["partial_ssd"].ssd_read_bytes - est["keep"].ssd_read_bytes == moved
    assert abs(est["partial_ssd"].compute_s - est["keep"].compute_s) < 1e-9


def resolved_cpu_plan(m):
    """The CPU plan of model profile `m` (plan "auto", 8 GiB each side), its activation sizes in."""
    return resolve(Settings(plan="auto"), m.unit_specs(),
                   Machine("cpu", host_available_bytes=8 << 30, device_free_bytes=8 << 30, cores=2),
                   hardware=cpu_hw(), model=m).plan  # fmt: skip


def every_block_as(policies) -> tuple:
    """GPT-2's analytic profile at micro-batch 4, its CPU plan, and that plan replayed with every
    block under each of `policies`: (profile, the blocks' names, {policy: StepEstimate})."""
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64)
    plan = resolved_cpu_plan(m)
    blocks = [u.name for u in m.units if u.name.startswith("transformer.h.")]
    return m, blocks, {p: estimate(plan, cpu_hw(), m, activations={b: p for b in blocks}) for p in policies}


def test_replay_moves_the_checkpoints_and_runs_the_recompute():
    """CPU device: recompute_ssd writes and reads each block's checkpoint (its inputs) once per
    step on top of what recompute does, and its device peak holds no checkpoint between forward
    and backward; the recompute's FLOPs are in the compute of both."""
    m, blocks, est = every_block_as(("keep", "recompute", "recompute_ssd"))
    ckpt = sum(a.inputs for a in act_units(m) if a.name in blocks)
    assert est["recompute_ssd"].ssd_write_bytes - est["recompute"].ssd_write_bytes == ckpt
    assert est["recompute_ssd"].ssd_read_bytes - est["recompute"].ssd_read_bytes == ckpt
    fwd = sum(u.forward_flops for u in m.units if u.name in blocks) / 100e9
    for p in ("recompute", "recompute_ssd"):
        assert abs(est[p].compute_s - est["keep"].compute_s - fwd) < 1e-9
    assert est["recompute_ssd"].peak_activation_bytes < est["recompute"].peak_activation_bytes


def test_replay_of_nested_recompute_moves_the_checkpoints_and_runs_the_pieces_again():
    """recompute_nested_ssd moves what recompute_ssd moves (each block's checkpoint), adds to the
    compute a forward of each block and one of its pieces but the last (the MLP, whose saved
    tensors the block's recompute keeps: its share of the FLOPs, analytic), and its backward holds
    the block's four pieces' arguments and the largest piece's saved bytes, not all the block
    saves: a lower device peak than recompute_ssd's (ActUnit.nested; runtime: nested.py,
    Note on nested)."""
    m, blocks, est = every_block_as(("keep", "recompute_ssd", "recompute_nested_ssd"))
    for kind in ("ssd_write_bytes", "ssd_read_bytes"):
        assert getattr(est["recompute_nested_ssd"], kind) == getattr(est["recompute_ssd"], kind)
    fwd = sum(u.forward_flops for u in m.units if u.name in blocks) / 100e9
    mlp = sum(u.forward_flops * u.last_piece_share for u in m.units if u.name in blocks) / 100e9
    d, inner, t = (
        256,
        1024,
        4 * 64,
    )  # (test_planner's GPT2: the MLP's two matmuls, 2 x t x d x inner FLOPs each)
    assert mlp == pytest.approx(len(blocks) * 4 * t * d * inner / 100e9) and 0 < mlp < fwd
    assert abs(est["recompute_nested_ssd"].compute_s - est["keep"].compute_s - (2 * fwd - mlp)) < 1e-9
    assert est["recompute_nested_ssd"].peak_activation_bytes < est["recompute_ssd"].peak_activation_bytes
    b = next(a for a in act_units(m) if a.name == blocks[0])
    # (the two norms' arguments held, the attention's and the MLP's made again from them)
    assert b.nested() == 2 * b.inputs + max(p[0] - p[1] for p in b.pieces) < b.recomputed()
    assert (
        backward_bytes(b, "recompute_nested_ssd") == b.nested()
        and held_bytes(b, "recompute_nested") == b.inputs
    )
    split = {"kept": 0, "host": b.inputs, "ssd": 0, "recomputed": b.saved}
    assert split_bytes(b, "recompute_nested_host") == split
    with pytest.raises(ModelProfileError, match="last_piece_share"):
        dc_replace(m.units[1], last_piece_share=1.5)


def test_nested_recompute_is_offered_where_the_whole_recompute_does_not_fit():
    """Blocks whose whole recompute (1000 bytes at its backward) passes the room, where nested
    (the two norms' 100-byte arguments and the largest piece, 500) fits: the
    recomputing choices come again with nested in place of recompute, every one within the room
    (issue 36's cliffs); where the whole recompute fits, nested is not offered."""
    pieces = ((100, 100, 0, 0), (400, 0, 300, 100), (100, 100, 0, 0), (500, 0, 300, 100))
    us = [ActUnit(f"u{i}", 1000, 100, 10_000, True, 600, 200, pieces, last_piece_share=0.6) for i in range(6)]
    assert us[0].nested() == 700 < us[0].recomputed() == 1000
    cands = ActPlanner(us, {}, device="cuda").candidates(800)
    nested = [c for c in cands if "nested recompute" in c.label]
    assert nested and all(c.need_bytes <= 800 for c in cands), [c.label for c in cands]
    assert any(set(c.as_dict().values()) <= {"recompute_nested_host", "recompute_nested"} for c in nested)
    assert not any(
        p in ("recompute", "recompute_host", "recompute_ssd") for c in cands for p in c.as_dict().values()
    )
    assert not any("nested" in c.label for c in ActPlanner(us, {}, device="cuda").candidates(1200))


def test_plan_printout_gives_the_split_per_unit():
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64)
    s = Settings(plan="auto", activations={"policy": "recompute_ssd"})
    r = resolve(s, m.unit_specs(), Machine("cpu", host_available_bytes=8 << 30, device_free_bytes=8 << 30, cores=2),
                hardware=cpu_hw(), model=m)  # fmt: skip
    assert r.plan.activations.count("recompute_ssd") == len(m.units) - 1  # the embeddings cannot
    text = r.plan.describe()
    assert "activations per unit" in text and "recomputed" in text
    row = next(line for line in text.splitlines() if "transformer.h.0 .. " in line)
    assert "recompute_ssd" in row and "(4)" in row


def test_plan_command_takes_partial_and_prints_its_split(tmp_path, capsys):
    """`offloadpp plan --activations partial_ssd`: every block partial, its checkpoint and kept
    outputs on SSD and the rest recomputed, per unit in the printout."""
    from offloadpp.cli.main import main

    model = tmp_path / "gpt2.json"
    model.write_text(json.dumps(GPT2))
    rc = main(["plan", "--config", os.path.join(PAPER, "ds_config.json"), "--model", str(model), "--micro-batch", "4", "--seq-len", "64", "--activations", "partial_ssd",
               "--hardware", os.path.join(PAPER, "rtx4090-12ssd.hardware.json"), "--machine-from-hardware"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64, compute_dtype="fp16")  # (the paper's config)
    blk = next(a for a in act_units(m) if a.name == "transformer.h.0")
    row = next(line for line in out.splitlines() if "transformer.h.0 .. " in line)
    assert "partial_ssd" in row
    from offloadpp.planner.plan import fmt_bytes

    # (moved: both norms' inputs, the attention's and the MLP's being derived again, and the kept outputs)
    moved = blk.moved("partial_ssd")
    moved, again = fmt_bytes(moved), fmt_bytes(blk.saved - (moved - blk.inputs) + blk.partial_extra)
    assert row.rstrip().endswith(f"{moved:>10} {again:>10}"), row


def _paper(name: str):
    with open(os.path.join(PAPER, name)) as f:
        return json.load(f)


def test_paper_13b_sweep_is_planned_b32_b64_partial_with_host_memory():
    """GPT-3 13B on the paper machine's profile: b8-b128 planned; b32 is partial with its kept
    outputs in host memory (recompute alone: 111 TFLOPS), b64 is partial with its kept outputs in host memory (a whole
    block's backward, 17.5 GiB, would leave the buffers no room to prefetch), and b64's
    throughput is at least b32's. Before swapped checkpoints, recompute pinned its inputs, so b32
    recomputed only half its blocks (72 TFLOPS) and b64 swapped whole blocks over the link (50
    TFLOPS); before partial pieces, b64 recomputed every block (90 TFLOPS, below b32). b128 is
    planned (before the GELU saving only its input it was refused), partial with its pieces'
    copies out beside the next pieces' forward (the replay once held a unit's forward until all
    its copies were out: 53 s of forward for 23 s of compute and 29 s of copies)."""
    hw = HardwareProfile.from_json(os.path.join(PAPER, "rtx4090-12ssd.hardware.json"))
    cfg = _paper("gpt3-13b.config.json")
    tflops = {}
    for b in (8, 16, 32, 64, 128):
        m = analytic_profile(cfg, micro_batch=b, seq_len=1024, compute_dtype="fp16")
        machine = Machine("cuda", host_available_bytes=hw.host_memory_bytes, device_free_bytes=hw.device_memory_bytes,
                          cores=hw.cpu_cores)  # fmt: skip
        s = Settings(
            plan="auto", compute_dtype="fp16", offload_params=True, offload_optimizer=True, micro_batch=b
        )
        r = resolve(s, m.unit_specs(), machine, hardware=hw, model=m)
        flops = sum(u.forward_flops + u.backward_flops for u in m.units)
        tflops[b] = flops / r.estimate.step_s / 1e12
        if b == 32:  # partial, its kept outputs in host memory (before partial kept the projections'
            # outputs, which backward never reads, b32 mixed it with recompute_host: the link
            # carried the one, the compute the other, for the same 117.4 TFLOPS)
            assert "partial_host" in r.plan.activations, (b, r.plan.activations)
        if b == 64:  # a whole block's backward fills the budget: partial, piece by piece
            assert "partial_host" in r.plan.activations, (b, r.plan.activations)
        if b >= 32:
            assert not {"host", "ssd"} & set(r.plan.activations), (b, r.plan.activations)
        if b == 128:  # the pieces' copies out run beside the next pieces' forward, not after it
            moved = sum(
                a.moved(p) for a, p in zip(act_units(m), r.plan.activations) if p.startswith("partial_")
            )
            fwd = sum(u.forward_flops for u in m.units) / hw.device_flops_per_s["fp16"]
            assert r.estimate.forward_s < 0.75 * (fwd + moved / (hw.d2h_gbps * 1e9)), r.estimate
        if b == 128:  # the logits (12.3 GiB) leave the room to the blocks: the fused head makes its
            # gradients in forward (was: recomputed its logits, 0.45 s more compute)
            assert r.plan.activations[-1] == "grad_in_forward", r.plan.activations
    assert tflops[32] > 113 and tflops[64] >= tflops[32] and tflops[128] >= tflops[64], tflops
    # the model's own loss: the logits' gradient beside them (27.4 GiB at the head) does not fit
    s = Settings(plan="auto", compute_dtype="fp16", offload_params=True, offload_optimizer=True, micro_batch=128,
                 activations=ActivationSettings(fused_loss=False))  # fmt: skip
    with pytest.raises(InfeasibleError, match=r"the largest, 'head', holds 27\.\d\d GiB at once") as e:
        resolve(s, m.unit_specs(), machine, hardware=hw, model=m)
    assert 64 <= e.value.largest_micro_batch < 128


def test_a_fused_head_recomputes_its_logits_and_a_plain_heads_gradient_is_counted():
    """The head's loss (planner/activations.py, Note on the head's loss): fused, a recomputing
    head holds its checkpoint and the loss's input and its backward never the whole logits;
    the model's own loss holds the logits' gradient beside them in backward."""
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64)
    t, vocab, width = 4 * 64, GPT2["vocab_size"], GPT2["n_embd"]
    head = act_units(m)[-1]
    assert (head.name, head.logits, head.loss_input, head.grad) == ("head", t * vocab * 4, t * width * 4, 0)
    assert held_bytes(head, "recompute") == head.inputs + head.loss_input == 2 * t * width * 4
    assert backward_bytes(head, "recompute") == head.saved - head.logits
    assert backward_bytes(head, "keep") == head.saved and held_bytes(head, "keep") == head.saved
    # partial keeps its matmul's output, the logits: as keep / ssd would
    assert held_bytes(head, "partial") == head.saved and head.moved("partial_ssd") == head.saved
    assert split_bytes(head, "partial_host") == split_bytes(head, "host")
    assert (
        head.moved("recompute_ssd") == head.checkpoint
        and split_bytes(head, "recompute_host")["host"] == head.checkpoint
    )
    # fp32: W's gradient sums in place (out=); 16-bit: in an fp32 sum of W's size beside it
    assert head.workspace == 0 and backward_bytes(head, "keep") == head.saved
    head16 = act_units(analytic_profile(GPT2, micro_batch=4, seq_len=64, compute_dtype="bf16"))[-1]
    assert head16.workspace == vocab * width * 4
    assert backward_bytes(head16, "recompute") == head16.saved - head16.logits + head16.workspace
    plain = act_units(m.with_fused_loss(False))[-1]
    assert (plain.logits, plain.loss_input, plain.grad) == (0, 0, head.logits)
    for p in ("keep", "ssd", "recompute"):
        assert backward_bytes(plain, p) >= plain.saved + head.logits, p
    # the least need: the fused head recomputes (with its checkpoint on SSD), the plain one cannot shed its logits
    fused, own = (
        ActPlanner(act_units(m), {}, device="cuda"),
        ActPlanner(act_units(m.with_fused_loss(False)), {}, device="cuda"),
    )
    assert fused.least.as_dict()["head"] == "recompute_ssd" and own.least.as_dict()["head"] == "ssd"
    assert fused.least.need_bytes < own.least.need_bytes


def test_a_head_making_its_gradients_in_forward_holds_them_and_runs_its_backward_there():
    """grad_in_forward (runtime/activations/head.py, Note on gradients in forward): the head holds
    what keep holds but the logits, plus its weight's fp32 gradient (grad_h takes h's bytes), and
    h beside them in its forward; nothing moves or runs again; its backward's time is counted in
    its forward (the step's compute unchanged, keep's)."""
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64, compute_dtype="bf16")
    t, vocab, width = 4 * 64, GPT2["vocab_size"], GPT2["n_embd"]
    head = act_units(m)[-1]
    held = head.saved - head.logits + vocab * width * 4
    assert held_bytes(head, "grad_in_forward") == backward_bytes(head, "grad_in_forward") == held
    assert forward_bytes(head, "grad_in_forward") == held + t * width * 2
    assert split_bytes(head, "grad_in_forward") == {"kept": held, "host": 0, "ssd": 0, "recomputed": 0}
    assert recompute_fraction("grad_in_forward") == 0 and head.moved("grad_in_forward") == head.saved
    # a vertical window of 2: each micro-batch's forward holds its own weight gradient
    assert act_units(window_profile(m, 2))[-1].weight_grad == 2 * vocab * width * 4
    fwd, bwd = {"head": 1.0, "b": 2.0}, {"head": 3.0, "b": 4.0}
    assert forward_moved(fwd, bwd, {"head": "keep"}) == (fwd, bwd)
    assert forward_moved(fwd, bwd, {"head": "grad_in_forward"}) == (
        {"head": 4.0, "b": 2.0},
        {"head": 0.0, "b": 4.0},
    )
    r = resolve(Settings(plan="auto", compute_dtype="bf16"), m.unit_specs(),
                Machine("cpu", host_available_bytes=8 << 30, device_free_bytes=8 << 30, cores=2),
                hardware=cpu_hw(), model=m)  # fmt: skip
    est = {p: estimate(r.plan, cpu_hw(), m, activations={"head": p}) for p in ("keep", "grad_in_forward")}
    assert abs(est["grad_in_forward"].compute_s - est["keep"].compute_s) < 1e-9
    assert est["grad_in_forward"].ssd_write_bytes == est["keep"].ssd_write_bytes


def test_grad_in_forward_is_a_fused_heads_only():
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64)
    with pytest.raises(PlanError, match=r"\['transformer.h.0'\].*only a fused causal-LM head"):
        ActPlanner(act_units(m), {"transformer.h.0": "grad_in_forward"}, device="cuda")
    with pytest.raises(PlanError, match=r"\['head'\]"):  # the model's own loss: no fused head
        ActPlanner(act_units(m.with_fused_loss(False)), {"head": "grad_in_forward"}, device="cuda")
    assert ActPlanner(act_units(m), {"head": "grad_in_forward"}, device="cuda").keep_all.as_dict()[
        "head"
    ] == ("grad_in_forward")


def test_the_head_twin_makes_its_gradients_in_forward_where_that_fits():
    """Where the head's logits are a large share of the room, the candidates are made again with
    the head out of the way: each making its gradients in forward where that fits (it runs
    nothing again), else recomputing its logits (it holds least)."""
    blocks = [ActUnit(f"b{i}", 1000, 100, 10_000, True) for i in range(4)]
    head = ActUnit("head", 2100, 100, 1000, True, logits=1800, loss_input=100, weight_grad=900)
    units = blocks + [head]
    assert forward_bytes(head, "grad_in_forward") < forward_bytes(head, "keep")
    room = 2500
    assert head.logits >= HEAD_TWIN_SHARE * room
    heads = {c.as_dict()["head"] for c in ActPlanner(units, {}, device="cuda").candidates(room)}
    assert "grad_in_forward" in heads, heads
    # too little room for the gradients and h beside the earlier units' checkpoints: recompute
    tight = need_bytes(units, {**{b.name: "recompute_ssd" for b in blocks}, "head": "recompute"})
    heads = {c.as_dict()["head"] for c in ActPlanner(units, {}, device="cuda").candidates(tight)}
    assert "recompute" in heads and "grad_in_forward" not in heads, heads


def _gpu_plan(m, *, link_gbps: float, flops: float):
    """A test GPU (link both ways at link_gbps, bf16 at `flops`, no slowdowns under Adam) and
    `auto`'s bf16 plan for the model profile m with 8 GiB of device and host memory."""
    hw = cpu_hw(device="cuda", device_name="test gpu", h2d_gbps=link_gbps, d2h_gbps=link_gbps, cpu_cores=16,
                device_flops_per_s={"fp32": flops, "bf16": flops}, compute_slowdown_under_adam=1.0,
                adam_slowdown_under_compute=1.0)  # fmt: skip
    r = resolve(Settings(plan="auto", compute_dtype="bf16"), m.unit_specs(),
                Machine("cuda", host_available_bytes=8 << 30, device_free_bytes=8 << 30, cores=16),
                hardware=hw, model=m)  # fmt: skip
    return hw, r


def test_a_tail_keeps_its_last_pieces_and_moves_the_rest():
    """partial_host_tail (planner/activations.py, Note on the tail): the last TAIL_PIECES pieces'
    checkpoints and kept outputs stay from forward to backward, the others move as partial_host's;
    a piece's records leave once the TAIL_PIECES-th piece after it opens, so its forward holds
    three pieces' at once; its backward holds what partial_host's does. The replay copies out
    the tails' bytes less than partial_host, and its peak stays within the need under a budget
    that binds."""
    from dataclasses import replace

    from offloadpp.planner.spec import fmt_bytes

    pieces = ((10, 100, 0, 0), (300, 100, 250, 50), (10, 100, 0, 0), (20, 100, 150, 0))
    u = ActUnit("b", 340, 100, 1, True, partial=400, partial_extra=50, pieces=pieces)
    assert TAIL_PIECES == 2 and u.tail == 100 + 250
    assert held_bytes(u, TAIL) == 350 and u.moved(TAIL) == u.moved("partial_host") - 350 == 450
    assert forward_bytes(u, TAIL) == 350 + 100 + 250 > forward_bytes(u, "partial_host")
    assert backward_bytes(u, TAIL) == backward_bytes(u, "partial_host")
    assert split_bytes(u, TAIL) == {**split_bytes(u, "partial_host"), "kept": 350, "host": 450}
    m = analytic_profile(GPT2, micro_batch=4, seq_len=64, compute_dtype="bf16")
    # (compute slow beside the link: every copy out is done before backward wants it, none cancelled)
    hw, r = _gpu_plan(m, link_gbps=25.0, flops=1e10)
    blocks = [a for a in act_units(m) if a.name.startswith("transformer.h.")]
    est = {
        p: estimate(r.plan, hw, m, activations={b.name: p for b in blocks}) for p in ("partial_host", TAIL)
    }
    assert est["partial_host"].d2h_bytes - est[TAIL].d2h_bytes == sum(b.tail for b in blocks) > 0
    need = need_bytes(act_units(m), {b.name: TAIL for b in blocks})
    plan = replace(r.plan, budgets=replace(r.plan.budgets, activation_bytes=need))  # a budget that binds
    assert 0 < estimate(plan, hw, m, activations={b.name: TAIL for b in blocks}).peak_activation_bytes <= need
    # the printout's split: the tail kept, the rest in host memory
    s = Settings(plan="auto", compute_dtype="bf16", activations={"overrides": {blocks[-1].name: TAIL}})
    text = resolve(s, m.unit_specs(), Machine("cuda", host_available_bytes=8 << 30, device_free_bytes=8 << 30,
                   cores=16), hardware=hw, model=m).plan.describe()  # fmt: skip
    row = next(line for line in text.splitlines() if line.split()[:2] == [blocks[-1].name, TAIL])
    assert row.split()[4:8] == [
        *fmt_bytes(blocks[-1].tail).split(),
        *fmt_bytes(blocks[-1].moved(TAIL)).split(),
    ]


def test_the_block_before_the_head_keeps_its_last_pieces_where_the_room_cannot_keep_it_whole():
    """Where the head's logits are a large share of the room (the head twin), a choice whose unit
    just before the head is partial_host is offered again with it partial_host_tail, where that
    fits the room and keeping it whole (partial) does not; nowhere else (GPT-3 13B's width, 4
    blocks, micro-batch 128: a block's partial bytes are 15 GiB, the head's logits 12.3 GiB)."""
    cfg = {**_paper("gpt3-13b.config.json"), "n_layer": 4}
    units = act_units(analytic_profile(cfg, micro_batch=128, seq_len=1024, compute_dtype="fp16"))
    blocks = [u.name for u in units if ".h." in u.name]
    base = {**{b: "partial_host" for b in blocks}, "head": "grad_in_forward"}
    room = need_bytes(units, {**base, blocks[-1]: TAIL})
    assert need_bytes(units, {**base, blocks[-1]: "partial"}) > room >= units[-1].logits
    found = [c.as_dict() for c in ActPlanner(units, {}, device="cuda").candidates(room)]
    assert {"embed": "keep", **base, blocks[-1]: TAIL} in found, found
    assert all(c[b] != TAIL for c in found for b in blocks[:-1])
    roomy = need_bytes(units, {**base, blocks[-1]: "partial"})  # keeping it whole fits: no tail
    assert all(
        c[blocks[-1]] != TAIL
        for c in (c.as_dict() for c in ActPlanner(units, {}, device="cuda").candidates(roomy))
    )


def _every_output_read(u):
    """A GPT-2 block as a model whose backward reads its projections' outputs would keep it (its
    kept outputs saved as made: q/k/v at their projection), to replay more records."""
    from dataclasses import replace

    (qkv, x, lse), (inner,) = u.piece_kept[1], u.piece_kept[3]
    pieces = list(u.pieces)
    for i in (1, 3):
        pieces[i] = (pieces[i][0], 0, pieces[i][2] + x, x)
    return replace(u, pieces=tuple(pieces), partial_bytes=sum(p[2] for p in pieces),
                   piece_kept=((), (qkv, x, lse, x), (), (inner, x)),
                   piece_kept_at=((), (0.7, 0.8, 0.8, 1.0), (), (0.5, 1.0)))  # fmt: skip


def test_the_replay_copies_a_swapped_pieces_records_one_by_one_from_their_saves():
    """The runtime copies each record out on its own (a piece's checkpoint, each storage of its
    kept outputs) from when it is saved, and frees its bytes when that copy ends
    (runtime/activations/swap.py); the replay does the same where the profile knows the pieces'
    kept storages (piece_kept) and when each is saved (piece_kept_at): forward, waiting on the
    link under a budget that binds, waits less than with the records freed one by one but
    copied from the piece's end, and that less than with each piece leaving as one, for the same
    bytes moved. A piece_kept (or piece_kept_at) that does not fit the pieces is refused."""
    from dataclasses import replace

    m = analytic_profile(GPT2, micro_batch=4, seq_len=64, compute_dtype="bf16")
    m = replace(m, units=tuple(_every_output_read(u) if u.name.startswith("transformer.h.") else u
                               for u in m.units))  # fmt: skip
    blocks = [u for u in m.units if u.name.startswith("transformer.h.")]
    assert all(len(u.piece_kept) == len(u.pieces) and max(map(len, u.piece_kept)) > 1 for u in blocks)
    # (each piece as one record; its records, freed one by one; and copied out from their saves)
    coarse = replace(m, units=tuple(replace(u, piece_kept=(), piece_kept_at=()) for u in m.units))
    unsaved = replace(m, units=tuple(replace(u, piece_kept_at=()) for u in m.units))
    hw, r = _gpu_plan(m, link_gbps=1.0, flops=1e12)
    acts = {u.name: "partial_host" for u in blocks}
    need = need_bytes(act_units(m), acts)
    plan = replace(r.plan, budgets=replace(r.plan.budgets, activation_bytes=need))
    fine, freed, whole = (estimate(plan, hw, p, activations=acts) for p in (m, unsaved, coarse))
    assert fine.forward_s < freed.forward_s < whole.forward_s, (fine, freed, whole)
    assert fine.d2h_bytes == freed.d2h_bytes == whole.d2h_bytes
    assert fine.peak_activation_bytes <= need
    with pytest.raises(ModelProfileError, match="piece_kept must"):
        replace(blocks[0], piece_kept=((1,),) * len(blocks[0].pieces))
    with pytest.raises(ModelProfileError, match="piece_kept_at must"):
        replace(blocks[0], piece_kept_at=tuple((1.0, 0.5)[: len(k)] for k in blocks[0].piece_kept))


def test_the_host_split_leaves_room_for_the_ssd_reads_backward_stages():
    """Backward reads the next units' SSD bytes into host memory ahead of the device room
    (runtime/activations/swap.py, Note on staging), beside the host bytes of the units before
    them. u0 ranks first (fewest FLOPs per byte) and u2 before u1 (the later among equals): with
    host memory for two units, u0 and u2 went to host and u1 to SSD, so at u2's backward u0's,
    u2's and u1's staged bytes were in host memory at once (3000 of 2000 bytes). Now u2 goes to
    SSD too: u0 and one staged unit at a time. (ActPlanner._swap_to: the split every candidate
    swapping to host takes.)"""
    us = [ActUnit("u0", 1000, 100, 1000, True)] + [ActUnit(f"u{i}", 1000, 100, 10_000, True) for i in (1, 2)]
    swapped = {u.name: "ssd" for u in us}
    got = ActPlanner(us, {}, device="cuda", host_bytes=2000)._swap_to(swapped, "host")
    assert got == {"u0": "host", "u1": "ssd", "u2": "ssd"}
    # with room for all three, all go to host (nothing is staged)
    assert ActPlanner(us, {}, device="cuda", host_bytes=3000)._swap_to(swapped, "host") == {
        "u0": "host", "u1": "host", "u2": "host"
    }  # fmt: skip


def _one_swapped_block(policy: str, budget, piece_kept=(), to_ssd: bool = False):
    """(sim, replay, bytes moved) for one swapped piecewise block "b" (norm, attention, norm,
    MLP: (saved, kept, partial, extra) a piece; piece_kept: its pieces' records, () not known)
    whose copy out is done (to_ssd: and its SSD write), on a stand-in CUDA replay whose link
    moves 100 bytes a second."""
    from types import SimpleNamespace

    from offloadpp.planner.simulate_act import ActReplay, _Out

    h2d = SimpleNamespace(submit=lambda t, n, write: t + n / 100.0)
    costs = SimpleNamespace(
        forward_s={"b": 1.0}, backward_s={"b": 2.0}, forward_visit_s=0.0, backward_visit_s=0.0
    )
    sim = SimpleNamespace(sched=SimpleNamespace(visits=()), t=0.0, cuda=True, h2d=h2d, costs=costs)
    pieces = ((100, 100, 0, 0), (400, 0, 300, 100), (100, 100, 0, 0), (500, 0, 300, 100))
    unit = ActUnit(
        "b", 1100, 100, 1, True, partial=600, partial_extra=200, pieces=pieces, piece_kept=piece_kept
    )
    r = ActReplay(sim, {"b": policy}, {"b": 1100}, 2, budget, {"b": unit})
    moved = r._held_in("b")
    r.out["b"] = _Out("b", moved, to_ssd, started=True, copy_done=0.0, write_done=0.0 if to_ssd else None)
    return sim, r, moved


@pytest.mark.parametrize("policy", ["partial_host", "partial_host_tail", "recompute_pieces_host"])
def test_a_swapped_blocks_first_fetch_brings_the_checkpoint_its_first_recompute_is_made_from(policy):
    """Backward's first fetch of a swapped piecewise block brings the records of the last piece it
    swapped and, where that piece's argument is made again from the piece before it (a block's
    MLP from the second norm's checkpoint; a tail's attention from the first norm's), that piece's
    checkpoint too: the runtime fetches both at once (backward.py `_fetch_floor`) and the recompute
    cannot start without it. The replay's partial block waited for its MLP's records alone."""
    _, r, moved = _one_swapped_block(policy, budget=None)
    assert r._fetch("b", force=True)
    # (the norm's checkpoint and the piece after it; recompute_pieces: the checkpoint alone)
    first = {"partial_host": 100 + 300, "partial_host_tail": 100 + 300, "recompute_pieces_host": 100}[policy]
    assert r.ready["b"][1:] == (False, first)  # (copied up now: no read from SSD first)
    assert r.rest["b"] == moved - first


def test_a_swapped_blocks_last_pieces_come_back_before_the_checkpoint_the_room_cannot_take_yet():
    """A prefetch of a swapped partial block whose first fetch (its MLP's records and the second
    norm's checkpoint) does not fit the room left beside the block running backward: the runtime
    fetches record by record, last first, while they fit (backward.py `_fetch_unit`), so the MLP's
    records come back now and the checkpoint once there is room. The replay fetched nothing until
    all of it fitted: with the checkpoint in the first fetch (s8sheet's faithful floor), random
    profile 29's Llama b64 at k = 2 replayed 39.29 s where 35.76 s with the MLP back early."""
    sim, r, moved = _one_swapped_block("partial_host", budget=1000)
    r.device_bytes = 650  # (the block before it: room for the MLP's 300, not the norm's 100 too)
    assert not r._fetch("b", force=False)  # (stopped by the budget: nothing after it is fetched)
    assert r.ready["b"] == (3.0, False, 300) and r.device_bytes == 950
    assert not r._fetch("b", force=False)  # (no room for the checkpoint yet)
    sim.t, r.device_bytes = 5.0, 600  # (the block before released a piece)
    assert r._fetch("b", force=False)
    assert r.ready["b"] == (6.0, False, 400) and r.device_bytes == 700
    assert r.rest["b"] == moved - 400
    r.ready.clear()
    r.out["b"].back = False
    r.device_bytes = 950  # (room for neither: nothing comes back before its backward's forced fetch)
    assert not r._fetch("b", force=False) and "b" not in r.ready


def test_a_first_fetch_comes_back_record_by_record_as_room_comes():
    """The runtime's `_fetch_unit` takes a unit's records last first, each while it fits the
    budget (backward.py); the replay counted a partial block's first fetch piece by piece, so
    where the block before's attention piece left room for some of the MLP's records but not
    all, none came back until that block's last piece (a norm), and each block's backward
    waited on the link: random profile 4's Llama b128, 0.44 s a block, 1.056x the time per token
    of b64. Now record by record where the profile knows them (ActUnit.piece_kept), pieces where
    it does not (the test above)."""
    sim, r, moved = _one_swapped_block("partial_host", budget=1000, piece_kept=((), (300,), (), (200, 100)))
    r.device_bytes = 850  # (room for the MLP's last record, 100, not its 300)
    assert not r._fetch("b", force=False)  # (stopped by the budget: nothing after it is fetched)
    assert r.ready["b"] == (1.0, False, 100) and r.device_bytes == 950
    sim.t, r.device_bytes = 2.0, 750  # (the block before released a piece: room for the next record)
    assert not r._fetch("b", force=False)
    assert r.ready["b"] == (4.0, False, 300) and r.device_bytes == 950
    sim.t, r.device_bytes = 5.0, 650  # (and for the second norm's checkpoint)
    assert r._fetch("b", force=False)
    assert r.ready["b"] == (6.0, False, 400) and r.device_bytes == 750
    assert r.rest["b"] == moved - 400


def test_a_read_fetched_ahead_is_copied_up_when_it_ends_not_at_its_units_backward():
    """A swapped block fetched while its SSD read (staged into host memory) is still running: the
    runtime's pump starts its copy up once the read is done (swap.py `_advance_in`: READING, then
    `_into_device`); the replay copied it up only at the unit's backward, so a first fetch made
    during the block before's pieces crossed the link only then (random profile 4's Llama b128,
    its partial_ssd blocks: 0.86 s a block where their partial_host ones waited 0.03 s)."""
    from offloadpp.planner.desim import Done

    sim, r, _ = _one_swapped_block("partial_host", budget=None, to_ssd=True)
    read = Done()
    r.staged["b"] = read
    assert r._fetch("b", force=False)
    assert r.ready["b"] == (read, True, 400)  # (bound for the device once its read is in)
    sim.t = 1.0
    r._copy_up_read()  # (the read still running: nothing to copy yet)
    assert r.ready["b"] == (read, True, 400)
    read.t, sim.t = 2.0, 3.0
    r._copy_up_read()  # (the read ended at 2.0: copied up from then, its 400 bytes by 6.0)
    assert r.ready["b"] == (6.0, False, 400) and not r.reading


def _backward_visit(policy: str, copy_running: bool) -> int:
    """The device bytes `_one_swapped_block`'s replay counts once the block's backward visit is
    over (before_backward, then after_backward), its copy out still running at the visit or not."""
    sim, r, _ = _one_swapped_block(policy, budget=None)
    r.backward_order, r.backward_index = ["b"], {"b": 0}
    if copy_running:
        r.out["b"].copy_done = None
    visit = r.before_backward("b")
    for kind, arg in visit:
        if kind == "cond":  # (waiting for the copy out: it ends now)
            r.out["b"].copy_done = sim.t
        elif kind == "until":
            sim.t = max(sim.t, arg)
    r.after_backward("b")
    return r.device_bytes


@pytest.mark.parametrize("policy", ["partial_host", "recompute_pieces_host", "host"])
def test_a_block_fetched_while_its_copy_out_runs_gives_back_what_it_holds(policy):
    """A swapped block whose backward comes while its copy out is still running is fetched once
    the copy ends; the pieces that fetch sets to come back during its backward were not counted
    (taken before the fetch had set them), but its release took them: at random profile 27's
    Llama 7B b64 a candidate's device held -2.69 GB from its first step on, its peaks that much
    too low. Counted now, the visit leaves the device as it found it, as when the copy was done."""
    assert _backward_visit(policy, copy_running=True) == _backward_visit(policy, copy_running=False) == 0


def test_the_least_need_counts_a_block_recomputed_piece_by_piece():
    """A Llama block's attention piece, partial, holds the q and k it kept before the rotation
    beside what its recompute saves; recomputed piece by piece it keeps no output: the least
    need is the pieces' (a room between the two has choices: it had none, and the search tried
    no prefetch depth leaving it). A GPT-2 block keeps no output autograd does not save: there
    the two hold the same, and the least stays partial's. With the sources sent back
    (REFETCH's policies, act_candidates.py Note on refetch) both hold less: the least is the
    pieces' so, and the rooms only it fits have the refetching twin's choices."""
    from offloadpp.bench.planner_properties import model_config

    llama = act_units(
        analytic_profile(model_config("llama-7b@2"), micro_batch=16, seq_len=1024, compute_dtype="fp16")
    )
    acts = ActPlanner(llama, {}, device="cuda")
    blocks = [u for u in llama if u.pieces]
    assert blocks and all(acts.least_held.as_dict()[u.name] == "recompute_pieces_ssd" for u in blocks)
    pieces = acts.least_held.need_bytes
    partial = need_bytes(llama, {**acts.least_held.as_dict(), **{u.name: "partial_ssd" for u in blocks}})
    assert pieces < partial
    got = acts.candidates(pieces)
    assert got and all(c.need_bytes <= pieces for c in got)
    assert all(acts.least.as_dict()[u.name] == "recompute_pieces_refetch_ssd" for u in blocks)
    lean = acts.least.need_bytes
    assert lean < pieces
    got = acts.candidates(lean)  # (only the refetching twin's choices fit)
    assert got and all(c.need_bytes <= lean and set(c.as_dict().values()) & set(REFETCH) for c in got)
    gpt = act_units(
        analytic_profile(model_config("gpt3-13b@2"), micro_batch=2, seq_len=256, compute_dtype="fp16")
    )
    least = ActPlanner(gpt, {}, device="cuda").least_held.as_dict()
    assert all(least[u.name] == "partial_ssd" for u in gpt if u.pieces)


@pytest.mark.parametrize(
    "policy",
    ["partial", "partial_host", "partial_ssd", "partial_host_tail", "recompute_pieces_host", "partial_refetch_host",
     "partial_refetch_ssd"],
)  # fmt: skip
def test_a_refetching_piece_holds_no_source_beside_its_derived_argument(policy):
    """Under partial_refetch_*, a swapped piece whose argument is made again from the previous
    piece's checkpoint (the attention and the MLP, from the norms') sends that checkpoint back to
    host memory once the argument is made (runtime/activations/saves.py `_evict_source`;
    planner/activations.py, Note on the derived argument's source): its recompute holds what it
    makes, not the checkpoint beside it, and the checkpoint crosses the link twice. The other
    policies hold it (and copy it up once)."""
    _, r, moved = _one_swapped_block(policy, budget=None)
    unit = r.units["b"]
    gone = (0, 100, 0, 100) if policy.startswith("partial_refetch") else (0, 0, 0, 0)
    assert evicted(unit, policy) == gone
    # (partial_host: the second norm's checkpoint beside the MLP's 500 saved and 100 extra;
    # partial: all pieces before on the device)
    peaks = {"partial": [100, 600, 500, 1100], "partial_host": [100, 600, 400, 700],
             "partial_ssd": [100, 600, 400, 700], "partial_host_tail": [100, 600, 400, 700],
             "recompute_pieces_host": [100, 500, 100, 600], "partial_refetch_host": [100, 500, 400, 600],
             "partial_refetch_ssd": [100, 500, 400, 600]}  # fmt: skip
    assert piece_peaks(unit, policy) == peaks[policy]
    if policy != "partial":
        assert r._fetch("b", force=True)
        first = 100 + (0 if policy == "recompute_pieces_host" else 300)
        assert r.rest_up.get("b", 0) == moved - first + sum(gone)  # (the sources copied up once more)
