"""The nested recompute (recompute_nested*, runtime/activations/nested.py, Note on nested)
around plain torch models, no engine: a block recomputed from its one checkpoint holding its
pieces' boundaries, then each piece again when backward reaches it, with the gradients of the run
without swapping (dropout on), below the device peak of the whole block's recompute."""

from __future__ import annotations

import copy

import pytest
import torch
from test_activations import (
    VOCAB,
    data,
    matmuls_in_backward,
    one_block_under_budget,
    rel_diff,
    run_step,
    store,
    tiny_gpt2,
)

from offloadpp.planner import ActivationSettings
from offloadpp.runtime.activations.manager import ActivationManager

transformers = pytest.importorskip("transformers")

__all__ = ["data", "store"]  # (the fixtures, shared with test_activations.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nested_recompute_holds_one_piece_at_a_time(store, on_device, dtype):
    """recompute_nested* keeps only the block's checkpoint (kept or swapped as recompute*'s) and
    recomputes the block holding its pieces' boundaries, then each piece (norms, attention, MLP)
    again when backward reaches it (nested.py, Note on nested): under a budget of 90% of what
    one block saves, recompute_nested_host stays within it where recompute_host (the whole block
    at once) cannot, with the gradients of the run without swapping (dropout on), in fp32 and
    bf16, on the CPU and on the stand-in."""
    x, ref, want, block, budget = one_block_under_budget(dtype)
    peaks = {}
    for policy in ("recompute_host", "recompute_nested_host"):
        model = copy.deepcopy(ref)
        cfg = ActivationSettings(policy=policy, budget_bytes=budget, min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            for _ in range(2 if policy == "recompute_nested_host" else 1):
                _, got = run_step(model, x, mgr)
                assert rel_diff(got, want) <= 1e-6, policy
                s = mgr.stats()
                assert s.fetch_misses == 0
                assert s.d2h_bytes > 0 and s.ssd_write_bytes == 0  # (the checkpoints moved to host)
                peaks[policy] = s.peak_device_bytes
                mgr.reset_stats()
    assert peaks["recompute_nested_host"] <= budget < block <= peaks["recompute_host"], (peaks, budget, block)


def test_nested_recompute_runs_the_pieces_but_the_last_once_more(store, data):
    """Backward under recompute_nested runs each linear layer of a block once more than
    recompute does, but the MLP's (the last piece, which backward needs first: what it saves is
    kept from the block's recompute): per block, 4 once (the block's recompute) and the
    attention's 2 once again (its piece's); the head's once (no pieces: a plain recompute)."""
    counts = matmuls_in_backward(store, data, ("keep", "recompute", "recompute_nested"))
    assert counts["recompute"] == counts["keep"] + 4 * 4 + 1, counts
    assert counts["recompute_nested"] == counts["keep"] + (4 + 2) * 4 + 1, counts


def test_nested_recompute_of_a_llama_block(store, data):
    """A Llama block's pieces (its norms, attention with the rotary tables handed in, MLP) replay
    exactly, attention dropout on."""
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, attention_dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    _, want = run_step(ref, data)
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy="recompute_nested_ssd", min_swap_bytes=0)
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        for _ in range(2):
            _, got = run_step(model, data, mgr)
            assert rel_diff(got, want) <= 1e-6
            assert mgr.stats().fetch_misses == 0
            mgr.reset_stats()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_peak_of_nested_is_below_the_whole_recompute(store):
    """On a GPU the allocator agrees with the accounting: a step under recompute_nested_host
    allocates less at its peak than under recompute_host, same gradients (dropout on)."""
    x = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(1)).cuda()
    ref = tiny_gpt2(n_embd=256).cuda()
    _, want = run_step(ref, x)
    peaks = {}
    for policy in ("recompute_host", "recompute_nested_host"):
        model = copy.deepcopy(ref)
        with ActivationManager.for_model(
            model, ActivationSettings(policy=policy, min_swap_bytes=0), store=store
        ) as mgr:
            run_step(model, x, mgr)  # (host buffers and gradients allocated once)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _, got = run_step(model, x, mgr)
            torch.cuda.synchronize()
            peaks[policy] = torch.cuda.max_memory_allocated() - base
            assert rel_diff(got, want) <= 1e-6, policy
    assert peaks["recompute_nested_host"] < peaks["recompute_host"], peaks


def test_nested_makes_the_attentions_and_the_mlps_arguments_again(store, data, monkeypatch):
    """A nested block's attention and MLP take the norms' outputs: their recompute makes them again
    from the norms' own arguments instead of holding them (nested.py, Note on nested): the
    accounted peak is at least one width-sized tensor lower than holding them, same gradients."""
    from offloadpp.runtime.activations.nested import Piece

    ref = tiny_gpt2()
    _, want = run_step(ref, data)
    peaks = {}
    for derive in (True, False):
        if not derive:
            monkeypatch.setattr(Piece, "derives", lambda self, x: False)
        model = copy.deepcopy(ref)
        cfg = ActivationSettings(policy="recompute_nested_host", min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            _, got = run_step(model, data, mgr)
            assert rel_diff(got, want) <= 1e-6, derive
            peaks[derive] = mgr.stats().peak_device_bytes
    assert peaks[False] - peaks[True] >= data.numel() * 64 * 4, peaks


@pytest.mark.parametrize("policy", ["recompute_host", "recompute_nested_host"])
def test_a_blocks_pieces_release_their_bytes_as_their_backward_ends(store, data, policy):
    """A whole or nested recompute releases each piece's saved bytes once backward has taken
    them all (recompute.py, Note on release), not at the block's end: at a block's first norm's
    backward the bytes the manager counts are below those at its MLP's first linear's (the block
    recomputed, the MLP not done) by at least what that linear saves (its input: tokens x
    width), so the next blocks' checkpoints can come back while the block's earlier pieces run;
    same gradients."""
    ref = tiny_gpt2()
    _, want = run_step(ref, data)
    model = copy.deepcopy(ref)
    cfg = ActivationSettings(policy=policy, min_swap_bytes=0, prefetch_units=0)
    seen: dict[str, list[int]] = {"mlp": [], "ln_1": []}
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        for block in model.transformer.h:
            for name, m in (("mlp", block.mlp.c_fc), ("ln_1", block.ln_1)):
                m.register_full_backward_pre_hook(
                    lambda m, g, name=name: seen[name].append(mgr.swapper.device_bytes)
                )
        _, got = run_step(model, data, mgr)
    assert rel_diff(got, want) <= 1e-6
    width = data.numel() * model.config.n_embd * 4
    assert len(seen["mlp"]) == len(seen["ln_1"]) == len(model.transformer.h)
    for mlp, ln_1 in zip(seen["mlp"], seen["ln_1"]):
        assert ln_1 <= mlp - width, seen


def test_a_recomputed_blocks_pieces_release_what_the_profile_says_they_save(store, data):
    """What the replay releases after each piece of a whole recompute (simulate_act.py
    `_left_after`: the analytic profile's saved bytes of that piece) is what the runtime takes
    off its account there: GPT-2's MLP, second norm and attention, each within 2% and a norm's
    statistics (which the profile leaves out), block by block."""
    from offloadpp.planner import analytic_profile
    from offloadpp.planner.activations import act_units

    model = tiny_gpt2(dropout=0.0)
    prof = analytic_profile(model.config.to_dict(), micro_batch=data.shape[0], seq_len=data.shape[1])
    names = ("mlp", "ln_2", "attn", "ln_1")  # (backward order; mlp: at its first linear's)
    cfg = ActivationSettings(policy="recompute", min_swap_bytes=0, prefetch_units=0)
    seen: dict[str, list[int]] = {n: [] for n in names}
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        for block in model.transformer.h:
            for name in names:
                m = block.mlp.c_fc if name == "mlp" else getattr(block, name)
                m.register_full_backward_pre_hook(
                    lambda m, g, name=name: seen[name].append(mgr.swapper.device_bytes)
                )
        run_step(model, data, mgr)
    units = {u.name: u for u in act_units(prof)}
    stats = data.numel() * 2 * 4  # (a norm's mean and rstd, fp32 a token: not in the profile)
    for i in range(len(model.transformer.h)):
        pieces = units[f"transformer.h.{len(model.transformer.h) - 1 - i}"].pieces  # (ln_1, attn, ln_2, mlp)
        for (a, b), want in zip(zip(names, names[1:]), (pieces[3][0], pieces[2][0], pieces[1][0])):
            got = seen[a][i] - seen[b][i]
            assert abs(got - want) <= 0.02 * want + stats, (a, got, want, seen)
