"""partial_last* (policy.py; planner/activations.py, Note on the last piece): a block's pieces
recomputed from their own checkpoints as recompute_pieces*'s, but the last one (the MLP) partial:
its matmuls' outputs kept, or swapped with the checkpoints. Gradients equal the keep policy's bit
for bit (dropout on, GPT-2 and Llama, the CPU and the stand-in); backward runs the attention's
matmuls again and not the MLP's; a Llama block's attention holds no q and k from before the
rotation at its recompute, so its device peak is below partial's."""

from __future__ import annotations

import copy

import pytest
import torch
from test_activations import _CountMatmuls, data, run_step, store, tiny_gpt2, tiny_llama
from test_activations_pieces import _equal, engine_window_run
from test_planner_engine import hw_path

from offloadpp.planner import ActivationSettings
from offloadpp.runtime.activations.manager import ActivationManager

transformers = pytest.importorskip("transformers")

__all__ = [
    "data",
    "hw_path",
    "store",
]  # (the fixtures, shared with test_activations.py, test_planner_engine.py)

LAST = ("partial_last", "partial_last_host", "partial_last_ssd")


def _gradients(ref, x, store, policy: str, **kw) -> tuple[dict, object]:
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy=policy, min_swap_bytes=0, **kw)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        got = run_step(model, x, mgr)[1]
        return got, mgr.stats()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", LAST)
def test_last_gradients_equal_keep_bit_for_bit(policy, kind, store, data, on_device):
    """partial_last* with dropout on: the gradients equal the keep policy's bit for bit, two
    steps (host buffers and SSD keys reused); the swapped variants move bytes, nothing is fetched
    late, and the MLP's kept outputs are records beside the checkpoints (more than
    recompute_pieces*'s; on the stand-in a swap-out not started when backward wants it back is
    cancelled, so the bytes moved are not compared)."""
    ref = tiny_gpt2() if kind == "gpt2" else tiny_llama()
    want, _ = _gradients(ref, data, store, "keep")
    pieces = policy.replace("partial_last", "recompute_pieces")
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy=policy, min_swap_bytes=0)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        for _ in range(2):
            _, got = run_step(model, data, mgr)
            assert _equal(got, want), policy
            s = mgr.stats()
            assert s.fetch_misses == 0 and s.recompute_s > 0
            assert (s.ssd_write_bytes > 0) == policy.endswith("_ssd")
            mgr.reset_stats()
    _, base = _gradients(ref, data, store, pieces)
    assert s.saved_bytes > base.saved_bytes > 0, (s.saved_bytes, base.saved_bytes)


def _matmuls(store, data, model_of, policy: str) -> int:
    model = model_of()
    # (the head kept: under partial_last it has no pieces and recomputes whole, under partial not)
    cfg = ActivationSettings(policy=policy, min_swap_bytes=0, overrides={"head": "keep"})
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        with mgr.forward():
            loss = model(input_ids=data, labels=data).loss
        counter = _CountMatmuls()
        with counter:
            mgr.backward(loss)
    return counter.n


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_last_recomputes_the_attention_not_the_mlp(store, data, kind):
    """Backward under partial_last runs each block's attention projections again (as
    recompute_pieces does) and none of its MLP's (as partial runs none of the block's)."""
    if kind == "gpt2":
        model_of, attn, mlp = (lambda: tiny_gpt2(dropout=0.0)), 2, 2  # (c_attn, c_proj; c_fc, c_proj)
    else:
        # (q, k, v, o and, with dropout and grouped heads, the attention's two batched products
        # on the CPU's math path, which partial keeps the output of; gate, up, down)
        model_of, attn, mlp = tiny_llama, 6, 3
    blocks = 4 if kind == "gpt2" else 2
    counts = {p: _matmuls(store, data, model_of, p) for p in ("partial", "partial_last", "recompute_pieces")}
    assert counts["recompute_pieces"] - counts["partial_last"] == blocks * mlp, counts
    assert counts["partial_last"] - counts["partial"] == blocks * attn, counts


def test_last_llama_attention_holds_less_than_partial(store):
    """A Llama block's attention piece under partial_host holds its q and k from before the
    rotation beside the rotated ones at its recompute; under partial_last_host it holds what
    recompute_pieces_host's does: the accounted device peak is below partial_host's (the MLP's
    outputs are what partial_last adds to recompute_pieces'), with the same gradients."""
    x = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    ref = tiny_llama()
    want, _ = _gradients(ref, x, store, "keep")
    peaks = {}
    for policy in ("partial_host", "partial_last_host", "recompute_pieces_host"):
        got, s = _gradients(ref, x, store, policy, overrides={"head": "keep"})
        assert _equal(got, want), policy
        peaks[policy] = s.peak_device_bytes
    assert peaks["recompute_pieces_host"] <= peaks["partial_last_host"] < peaks["partial_host"], peaks


def test_last_ssd_bytes_in_the_step_report_are_the_cost_models(tmp_path, hw_path):
    """Under the engine with a model profile (analytic, the hardware profile's), the activation
    bytes a step writes to SSD under partial_last_ssd (each block's two checkpoints and its MLP's
    kept output) are the cost model's for the same plan, and more than recompute_pieces_ssd's by
    the MLPs' kept outputs. (The head kept, as in test_activations_pieces.py's twin.)"""
    from test_planner_engine import _config, tiny

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper

    got = {}
    for policy in ("recompute_pieces_ssd", "partial_last_ssd"):
        path = tmp_path / policy
        path.mkdir()
        cfg = _config(path, hardware_profile=hw_path, micro_batch=2, seq_len=16, device_budget_bytes=None,
                      host_budget_bytes=None, activations=ActivationSettings(policy=policy, min_swap_bytes=0, overrides={"head": "keep"}))  # fmt: skip
        with assemble_engine(tiny(), cfg, hyper=AdamHyper(lr=1e-3)) as e:
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                x = torch.randint(0, 256, (2, 16), generator=g)
                loss = e(input_ids=x, labels=x).loss
                e.activations.swapper.make_room(0, 0)  # (every swap-out under way: the twin's Note)
                e.backward(loss)
                report = e.step()
        written = {k: w for k, _, w in report.ssd_by_kind}["activations"]
        assert written == {k: w for k, _, w in report.predicted_ssd_by_kind}["activations"] > 0, policy
        got[policy] = written
    x = 2 * 16 * 64 * 4  # (a checkpoint: micro-batch 2 x 16 tokens x width 64, fp32)
    assert got["recompute_pieces_ssd"] == 6 * x
    assert got["partial_last_ssd"] == 6 * x + 3 * 4 * x  # (each MLP's first linear's output, 4 x width)


@pytest.mark.parametrize("kind,device", [("llama", "cpu"), ("gpt2", "standin")])
def test_last_under_the_engine_with_accumulation_equals_keep(tmp_path, monkeypatch, kind, device):
    """Under the engine, G = 2, dropout on: partial_last_ssd gives the losses and weights of keep
    bit for bit over two steps (test_activations_pieces.py's twin for recompute_pieces_ssd)."""
    from conftest import set_device

    set_device(monkeypatch, device)
    ref = tiny_gpt2() if kind == "gpt2" else tiny_llama()
    lk, wk, _ = engine_window_run(tmp_path, ref, "keep")
    ll, wl, _ = engine_window_run(tmp_path, ref, "partial_last_ssd")
    assert lk == ll
    assert _equal(wl, wk)
