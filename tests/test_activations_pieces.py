"""Each piece recomputed from its own checkpoint (recompute_pieces*, manager.py Note on pieces):
a block's pieces (norms, attention, MLP) each a recompute segment with its own checkpoint (the
attention's and the MLP's made again from the norms'), kept or swapped as recompute*'s; backward
runs each piece again once, from its own checkpoint. Gradients equal the keep policy's bit for
bit (dropout on, GPT-2 and Llama, the CPU and the stand-in, under the engine with G = 2), at one
piece's peak, for the compute of a whole recompute (not nested's second forward)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_activations import (
    VOCAB,
    data,
    matmuls_in_backward,
    one_block_under_budget,
    run_step,
    store,
    tiny_gpt2,
    tiny_llama,
)
from test_planner_engine import hw_path

from offloadpp.planner import ActivationSettings
from offloadpp.runtime.activations.manager import ActivationManager

transformers = pytest.importorskip("transformers")

__all__ = [
    "data",
    "hw_path",
    "store",
]  # (the fixtures, shared with test_activations.py, test_planner_engine.py)

PIECES = ("recompute_pieces", "recompute_pieces_host", "recompute_pieces_ssd")


def _keep_gradients(ref, x, store) -> dict:
    """The gradients of one step under the keep policy (the manager's GELU and loss in place)."""
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(model, ActivationSettings(policy="keep"), store=store) as mgr:
        return run_step(model, x, mgr)[1]


def _equal(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", PIECES)
def test_pieces_gradients_equal_keep_bit_for_bit(policy, kind, store, data, on_device):
    """recompute_pieces* with dropout on: the gradients equal the keep policy's bit for bit
    (each piece replays its RNG state; a derived argument is its norm run again from the norm's
    checkpoint and RNG state), two steps (host buffers and SSD keys reused); the swapped
    variants move the checkpoints only, and nothing is fetched late."""
    ref = tiny_gpt2() if kind == "gpt2" else tiny_llama()
    want = _keep_gradients(ref, data, store)
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy=policy, min_swap_bytes=0)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        for _ in range(2):
            _, got = run_step(model, data, mgr)
            assert _equal(got, want), policy
            s = mgr.stats()
            assert s.fetch_misses == 0 and s.recompute_s > 0
            assert (s.d2h_bytes > 0) == (policy != "recompute_pieces")
            assert (s.ssd_write_bytes > 0) == policy.endswith("_ssd")
            mgr.reset_stats()


def test_pieces_move_two_checkpoints_a_block(store, data):
    """recompute_pieces_host moves a GPT-2 block's two checkpoints (the residual stream before
    each norm; the attention's and the MLP's arguments are made again from the norms'), where
    recompute_host moves one and partial_host its kept outputs besides."""
    moved = {}
    for policy in ("recompute_host", "recompute_pieces_host", "partial_host"):
        model = tiny_gpt2(dropout=0.0)
        cfg = ActivationSettings(policy=policy, overrides={"head": "keep"}, min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            with mgr.forward():
                loss = model(input_ids=data, labels=data).loss
            # (else a swap-out not yet started when backward's prefetch asks for its record is
            # cancelled, swap.py fetch: the bytes never left)
            mgr.drain()
            mgr.backward(loss)
            moved[policy] = mgr.stats().d2h_bytes
    x = data.numel() * 64 * 4  # (one width-sized fp32 tensor: a checkpoint)
    blocks = 4
    assert moved["recompute_pieces_host"] - moved["recompute_host"] == blocks * x, moved
    assert moved["partial_host"] > moved["recompute_pieces_host"], moved


def test_pieces_recompute_each_matmul_once(store, data):
    """Backward under recompute_pieces runs each linear layer once again, as the whole recompute
    does, where nested runs the attention's twice."""
    counts = matmuls_in_backward(store, data, ("keep", "recompute", "recompute_pieces", "recompute_nested"))
    assert counts["recompute_pieces"] == counts["recompute"] == counts["keep"] + 4 * 4 + 1, counts
    assert counts["recompute_nested"] > counts["recompute_pieces"], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_hold_one_piece_at_a_time(store, on_device, dtype):
    """Under a budget of 90% of what one block saves, recompute_pieces_host stays within it where
    recompute_host (the whole block at once) cannot, with the gradients of the run without
    swapping (dropout on)."""
    x, ref, _, block, budget = one_block_under_budget(dtype)
    want = _keep_gradients(ref, x, store)
    peaks = {}
    for policy in ("recompute_host", "recompute_pieces_host"):
        model = copy.deepcopy(ref)
        cfg = ActivationSettings(policy=policy, budget_bytes=budget, min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            _, got = run_step(model, x, mgr)
            assert _equal(got, want), policy
            s = mgr.stats()
            assert s.fetch_misses == 0
            peaks[policy] = s.peak_device_bytes
    assert peaks["recompute_pieces_host"] <= budget < block <= peaks["recompute_host"], (peaks, budget, block)


def engine_window_run(tmp_path, ref, policy: str):
    """(losses, weights, activation bytes copied out) of four micro-batches of `ref` under the
    engine, G = 2, dropout on, activations under `policy` (the head kept), fixed seeds: the run
    each policy's "equals keep under the engine" test compares with keep's (also
    test_activations_last.py)."""
    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(4)]
    path = tmp_path / policy
    path.mkdir()
    settings = Settings(gradient_accumulation_steps=2,
                        activations=ActivationSettings(policy=policy, min_swap_bytes=0, overrides={"head": "keep"}))  # fmt: skip
    cfg = RuntimeConfig(nvme_paths=[str(path)], settings=settings, device="cpu",
                        ssd_read_gbps=2.0, ssd_write_gbps=2.0)  # fmt: skip
    losses, moved = [], 0
    with assemble_engine(copy.deepcopy(ref), cfg, hyper=AdamHyper(lr=1e-3)) as eng:
        for i, x in enumerate(batches):
            torch.manual_seed(100 + i)
            loss = eng(input_ids=x, labels=x).loss
            eng.backward(loss)
            moved += eng.activations.stats().d2h_bytes
            eng.step()
            losses.append(loss.item())
        weights = {k: v.clone() for k, v in eng.module.state_dict().items()}
    return losses, weights, moved


@pytest.mark.parametrize("kind,device", [("gpt2", "cpu"), ("llama", "cpu"), ("gpt2", "standin")])
def test_pieces_under_the_engine_with_accumulation_equal_keep(tmp_path, monkeypatch, kind, device):
    """Under the engine, G = 2, dropout on: recompute_pieces_ssd gives the losses and weights of
    keep bit for bit over two steps, and the StepReport's activation bytes moved are the
    checkpoints'."""
    from conftest import set_device

    set_device(monkeypatch, device)
    ref = tiny_gpt2() if kind == "gpt2" else tiny_llama()
    lk, wk, _ = engine_window_run(tmp_path, ref, "keep")
    lp, wp, moved = engine_window_run(tmp_path, ref, "recompute_pieces_ssd")
    assert lk == lp
    assert _equal(wp, wk)
    assert moved > 0


@pytest.mark.parametrize("policy", ["recompute_pieces_ssd", "recompute_nested_ssd"])
def test_pieces_ssd_bytes_in_the_step_report_are_the_cost_models(tmp_path, hw_path, policy):
    """Under the engine with a model profile (analytic, the hardware profile's), the activation
    bytes a step writes to SSD under recompute_pieces_ssd (each block's two checkpoints) are the
    cost model's for the same plan, as recompute_nested_ssd's (one). (The head kept: the replay
    cancels the copy of the last unit's checkpoint, which backward wants at once, where the
    runtime's worker has often written it already, whatever the policy.)"""
    from test_planner_engine import _config, tiny

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper

    cfg = _config(tmp_path, hardware_profile=hw_path, micro_batch=2, seq_len=16, device_budget_bytes=None,
                  host_budget_bytes=None, activations=ActivationSettings(policy=policy, min_swap_bytes=0, overrides={"head": "keep"}))  # fmt: skip
    with assemble_engine(tiny(), cfg, hyper=AdamHyper(lr=1e-3)) as e:
        assert e.predicted is not None
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randint(0, 256, (2, 16), generator=g)
            loss = e(input_ids=x, labels=x).loss
            # every swap-out of this forward under way before backward: a copy its worker has
            # not started when backward wants the record back is cancelled (swap.py fetch), a
            # race the replay does not model (it writes the last block's checkpoint: about 1 run
            # in 8 here wrote one checkpoint less)
            e.activations.swapper.make_room(0, 0)
            e.backward(loss)
            report = e.step()
    got = {k: w for k, _, w in report.ssd_by_kind}["activations"]
    want = {k: w for k, _, w in report.predicted_ssd_by_kind}["activations"]
    assert got == want > 0
    x = 2 * 16 * 64 * 4  # (a checkpoint: micro-batch 2 x 16 tokens x width 64, fp32)
    assert got == (6 if policy == "recompute_pieces_ssd" else 3) * x


def test_a_pieces_blocks_prefetch_brings_the_checkpoint_its_mlp_is_made_from(store, data):
    """Backward's prefetch of a recompute_pieces_host block brings the second norm's checkpoint:
    the MLP, the piece backward recomputes first, has no record of its own (its argument is made
    again from that checkpoint), so a floor at the MLP's records fetched nothing ahead
    (backward.py `_fetch_floor`)."""
    from offloadpp.runtime.activations.records import RecState

    model = tiny_gpt2(dropout=0.0)
    cfg = ActivationSettings(policy="recompute_pieces_host", overrides={"head": "keep"}, min_swap_bytes=0)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        with mgr.forward():
            loss = model(input_ids=data, labels=data).loss
        mgr.drain()
        last = next(u for u in reversed(mgr.units) if u.name.startswith("transformer.h."))
        own = [r for r in last.records if r.unit is last]  # (not the embedding's, shared by all)
        assert len(own) == 2 and all(r.state is RecState.HOST for r in own)
        mgr.start_backward()  # (the head keeps: the prefetch reaches the last block)
        assert own[1].state is not RecState.HOST  # (asked for: on its way back, or back)
        assert own[0].state is RecState.HOST  # (the first norm's: one piece ahead only)
        loss.backward()
        mgr.end_backward()
