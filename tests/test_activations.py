"""Activation swapping (runtime/activations.py) around plain torch models, no engine: a tiny GPT-2
(random init, built from a config, nothing downloaded) under each policy and a mix must give the
gradients of the run without swapping; the accounted device peak must stay within a budget of
25% of what keeping everything needs; parameters and views are never swapped twice; unchanged
storages are not written to SSD again.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from offloadpp.io import TensorStore
from offloadpp.planner import ActivationSettings, decide
from offloadpp.runtime.activations.manager import ActivationManager
from offloadpp.runtime.activations.records import ActivationError

transformers = pytest.importorskip("transformers")

VOCAB = 128


def tiny_gpt2(n_layer: int = 4, dropout: float = 0.1, n_embd: int = 64, seed: int = 0):
    cfg = transformers.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def run_step(model, x, mgr=None, seed: int = 5) -> tuple[float, dict]:
    """One forward + backward (dropout seeded); (loss, gradients by name)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if mgr is None:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
    else:
        with mgr.forward():
            loss = model(input_ids=x, labels=x).loss
        mgr.backward(loss)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def tiny_llama():
    """A 2-layer Llama with attention dropout (a recompute must replay its RNG)."""
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, attention_dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def rel_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)


@pytest.fixture
def store(tmp_path):
    s = TensorStore([str(tmp_path / "nvme")])
    yield s
    s.close()


@pytest.fixture(scope="module")
def data():
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def standin_swapped_out(store, policy):
    """On the stand-in with long delays (OFFLOADPP_STANDIN_SKIP applies), a Swapper holding one
    record of 4096 floats, swapped out under `policy` and waited for: (accelerator, swapper,
    record, what compute saved); both closed after."""
    from types import SimpleNamespace

    from torch.multiprocessing.reductions import StorageWeakRef

    from offloadpp.runtime.accel import StandinAccelerator
    from offloadpp.runtime.activations.records import SavedStorage
    from offloadpp.runtime.activations.swap import Swapper

    accel = StandinAccelerator(seed=3, delay_ms=30.0)
    sw = Swapper(accel, store, key_prefix="t", host_budget_bytes=None)
    try:
        x = torch.arange(4096.0)  # what compute saved
        rec = SavedStorage(SimpleNamespace(name="u"), policy, x.untyped_storage(),
                           StorageWeakRef(x.untyped_storage()), 0)  # fmt: skip
        sw.hold(rec)
        sw.swap_out(rec)
        sw.make_room(1 << 40, 0)  # (waits for the swap-out)
        yield accel, sw, rec, x
    finally:
        sw.close()
        accel.close()


MIX = {
    "embed": "ssd",
    "transformer.h.0": "recompute",
    "transformer.h.1": "host",
    "transformer.h.2": "ssd",
    "head": "recompute",
}


@pytest.mark.parametrize(
    "policy",
    [
        "keep",
        "host",
        "ssd",
        "recompute",
        "recompute_host",
        "recompute_ssd",
        "partial",
        "partial_host",
        "partial_ssd",
        "recompute_nested",
        "recompute_nested_host",
        "recompute_nested_ssd",
        "auto",
        "mix",
    ],
)
def test_gradients_equal_the_run_without_swapping(policy, store, data, on_device):
    ref = tiny_gpt2()  # dropout on: recompute must replay the RNG
    _, want = run_step(ref, data)
    model = copy.deepcopy(ref)
    # Note: the budget of host and ssd. Without one, forward never waits for its swap-outs, and
    # backward cancels those not started when it wants them back (the bytes never left: Swapper.
    # fetch). How many that is depends on how far the copies got meanwhile: on the stand-in, whose
    # copy stream lags a tiny model's forward by up to 2 ms a copy, a second step (faster than the
    # first, which allocates host buffers and SSD files) cancelled nearly all, and moved 17 KB of
    # 1.66 MB saved. With a budget forward waits for the oldest swap-outs past it, so all but the
    # budget's bytes move, on every device and step.
    budget = 600_000 if policy in ("auto", "host", "ssd") else None
    cfg = ActivationSettings(
        policy="keep" if policy == "mix" else policy,
        overrides=MIX if policy == "mix" else {},
        min_swap_bytes=0,
        budget_bytes=budget,
    )
    reads = 0
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        for _ in range(2):  # the second step reuses host buffers, SSD keys, and the auto decision
            loss, got = run_step(model, data, mgr)
            assert rel_diff(got, want) <= 1e-6, policy
            s = mgr.stats()
            assert s.fetch_misses == 0
            if policy in ("host", "ssd"):  # every byte out comes back (the budget Note)
                assert s.d2h_bytes >= s.saved_bytes - budget > 0 and s.h2d_bytes == s.d2h_bytes
            if policy == "ssd":
                # (a storage unchanged since the last step is not written again; one backward
                # wants while its write is in flight comes back from the host buffer, no read:
                # reads are counted over the run)
                assert 0 < s.ssd_write_bytes <= s.d2h_bytes
                reads += s.ssd_read_bytes
            if policy in ("recompute", "recompute_nested"):
                assert s.recompute_s > 0 and s.d2h_bytes == 0
            ckpt = 6 * data.numel() * 64 * 4 + data.numel() * 8 + data.shape[1] * 8
            if policy.startswith("recompute_") and policy != "recompute_nested":
                # only the checkpoints moved: the inputs of the 4 blocks, of ln_f and lm_head (the
                # head unit's two roots), and the embedding's token ids (int64)
                # (a copy backward wants before the worker started it is cancelled, the bytes never
                # left: on a loaded machine the last units' may be)
                ckpt = 6 * data.numel() * 64 * 4 + data.numel() * 8 + data.shape[1] * 8
                assert s.recompute_s > 0 and 0 < s.d2h_bytes <= ckpt and s.h2d_bytes == s.d2h_bytes
                assert (s.ssd_write_bytes > 0) == policy.endswith("_ssd")
            if policy.startswith("partial"):  # the matmuls' outputs moved (or stayed), not recomputed
                assert s.recompute_s > 0 and (s.d2h_bytes > ckpt) == (policy != "partial")
                assert (s.ssd_write_bytes > 0) == (policy == "partial_ssd")
            mgr.reset_stats()
        assert reads > 0 or policy != "ssd"
        if policy == "auto":  # on the CPU acting as the device swaps go to SSD, else to host (decide.py)
            swap = "ssd" if on_device == "cpu" else "host"
            assert set(mgr.policies().values()) <= {"keep", swap} and swap in mgr.policies().values()


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.n += 1
        return func(*args, **(kwargs or {}))


def matmuls_in_backward(store, data, policies) -> dict:
    """{policy: the matmuls one backward of tiny_gpt2 (no dropout) runs under it}."""
    counts = {}
    for policy in policies:
        model = tiny_gpt2(dropout=0.0)
        cfg = ActivationSettings(policy=policy, min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            with mgr.forward():
                loss = model(input_ids=data, labels=data).loss
            counter = _CountMatmuls()
            with counter:
                mgr.backward(loss)
        counts[policy] = counter.n
    return counts


def test_partial_recompute_runs_no_matmul_again(store, data):
    """Backward under partial runs the matmuls backward itself needs and no more (keep's
    count): the forward's outputs of c_attn, c_proj, c_fc, the MLP's c_proj and the head's
    projection come back instead of being computed again; recompute runs each of them again."""
    # (the fused head keeps its logits under partial: the output of its matmul)
    counts = matmuls_in_backward(store, data, ("keep", "recompute", "partial"))
    assert counts["partial"] == counts["keep"] > 0, counts
    assert counts["recompute"] == counts["keep"] + 4 * 4 + 1, counts  # four a block, the head's


def one_block_under_budget(dtype: torch.dtype = torch.float32):
    """(x, the model, its gradients without swapping, what one block saves, 90% of that): the
    budget a policy recomputing a block piece by piece meets and the whole block's recompute
    cannot."""
    from offloadpp.profiling.model import profile_model

    x = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    ref = tiny_gpt2(n_embd=128).to(dtype)
    block = (
        profile_model(copy.deepcopy(ref), {"input_ids": x, "labels": x}, repeats=1).units[1].activation_bytes
    )
    _, want = run_step(ref, x)
    return x, ref, want, block, int(0.9 * block)


def test_partial_pieces_hold_one_piece_at_a_time(store):
    """A partial block is recomputed piece by piece (its norms, its attention, its MLP), so its
    backward holds one piece's tensors and not the whole block's: under a budget of 90% of what
    one block saves, partial_host stays within it where recompute_host (the whole block at once)
    cannot, with the gradients of the run without swapping (dropout on)."""
    x, ref, want, block, budget = one_block_under_budget()
    peaks = {}
    for policy in ("recompute_host", "partial_host"):
        model = copy.deepcopy(ref)
        cfg = ActivationSettings(policy=policy, budget_bytes=budget, min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            for _ in range(2):
                _, got = run_step(model, x, mgr)
                assert rel_diff(got, want) <= 1e-6, policy
                peaks[policy] = mgr.stats().peak_device_bytes
                mgr.reset_stats()
    assert peaks["partial_host"] <= budget < block <= peaks["recompute_host"], (peaks, budget, block)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["partial", "partial_host", "partial_ssd"])
def test_partial_derives_the_norms_outputs_instead_of_keeping_them(store, data, monkeypatch, kind, policy):
    """A partial block's attention and MLP take the two norms' outputs: those are derived again
    from the norms' own checkpoints in backward, not kept nor moved (recompute.py, Note on
    derived checkpoints): the run moves (or, partial, holds) two width-sized tensors a block
    less than the same run deriving nothing, with the same gradients, dropout on."""
    from offloadpp.runtime.activations.recompute import Segment

    if kind == "gpt2":
        ref, width = tiny_gpt2(), 64
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, attention_dropout=0.1,
        )  # fmt: skip
        torch.manual_seed(0)
        ref, width = transformers.LlamaForCausalLM(cfg), 64
    blocks = ref.config.num_hidden_layers
    _, want = run_step(ref, data)
    moved, held = {}, {}
    for derive in (True, False):
        if not derive:
            monkeypatch.setattr(Segment, "derives", lambda self, x: False)
        model = copy.deepcopy(ref)
        cfg = ActivationSettings(policy=policy, min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            names = [u.name for u in mgr.units]
            for _ in range(2):
                _, got = run_step(model, data, mgr)
                assert rel_diff(got, want) <= 1e-6, (derive, policy)
                s = mgr.stats()
                moved[derive], held[derive] = s.saved_bytes, s.peak_device_bytes
                mgr.reset_stats()
        assert names[1:-1] and all("layers" in n or ".h." in n for n in names[1:-1])
    x = data.numel() * width * 4  # one fp32 width-sized tensor
    if policy == "partial":  # (its checkpoints stay with its segments, not in records)
        assert held[False] - held[True] >= 2 * x * (blocks - 1), held
    else:
        assert moved[False] - moved[True] == 2 * x * blocks, moved


class _NormThenScaled(nn.Module):
    """A root whose own forward changes the norm's output in place before the next piece."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)
        h.mul_(2.0)  # (LayerNorm's backward does not need its output)
        return self.lin(h).relu()


@pytest.mark.parametrize("policy", ["partial", "partial_host", "partial_ssd"])
def test_a_norm_output_changed_in_place_is_not_derived(store, policy):
    """The next piece's argument is derived only while it is the norm's output unchanged: here
    the root doubles it in place first, so it is kept as a checkpoint, and the gradients are
    the plain run's."""
    torch.manual_seed(0)
    ref = _NormThenScaled()
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    ref(x).sum().backward()
    mgr = ActivationManager(
        [("blk", [model])], ActivationSettings(policy=policy, min_swap_bytes=0), store=store
    )
    mgr.install()
    with mgr.forward():
        out = model(x)
    mgr.backward(out.sum())
    mgr.close()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_quarter_budget_within_peak_and_trains_like_keep(store, data, on_device):
    """8 blocks, budget 25% of the keep-all peak: the accounted peak stays within it, and three
    SGD steps give the losses and weights of keeping everything."""
    ref = tiny_gpt2(n_layer=8, dropout=0.0)
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(ref, ActivationSettings(policy="keep")) as keep:
        run_step(ref, data, keep)
        keep_peak = keep.stats().peak_device_bytes
    assert keep_peak >= keep.stats().saved_bytes > 0
    budget = keep_peak // 4
    for policy in ("auto", "ssd"):
        m = copy.deepcopy(model)
        r = copy.deepcopy(model)
        opt_m, opt_r = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(r.parameters(), lr=0.1)
        cfg = ActivationSettings(policy=policy, budget_bytes=budget, min_swap_bytes=4096)
        with ActivationManager.for_model(m, cfg, store=store) as mgr:
            for _ in range(3):
                loss_r, _ = run_step(r, data)
                loss_m, _ = run_step(m, data, mgr)
                assert loss_m == loss_r
                opt_r.step()
                opt_m.step()
                s = mgr.stats()
                assert s.peak_device_bytes <= budget, (policy, s.peak_device_bytes, budget)
                assert s.within_budget
                mgr.reset_stats()
        for (n, a), b in zip(m.named_parameters(), r.parameters()):
            assert torch.equal(a, b), n


class Body(nn.Module):
    """Saves one storage through several views (split, transpose), a parameter and its transpose,
    a module buffer, and a non-parameter input that lives across steps."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 96) * 0.1)
        self.register_buffer("scale", torch.rand(32, 32) + 0.5)

    def forward(self, x, ctx):
        h = x @ self.w  # saves x (activation input) and w (parameter)
        q, k, v = h.split(32, dim=-1)  # views of h's storage
        s = (q @ k.transpose(-1, -2)) * self.scale  # saves q, k (views of h) and the buffer
        y = s.softmax(-1) @ v  # saves softmax output and v (view of h)
        return (y * ctx).sum() + (h.t() @ h).sum()  # saves ctx (long-lived), h.t() and h


def body_manager(policy: str, store) -> tuple[Body, ActivationManager]:
    torch.manual_seed(0)
    body = Body()
    mgr = ActivationManager(
        [("body", [body])], ActivationSettings(policy=policy, min_swap_bytes=0), store=store
    )
    mgr.install()
    return body, mgr


def test_views_and_params_are_not_swapped_twice(store):
    x = torch.randn(32, 64, requires_grad=True)
    ctx = torch.randn(32, 32)
    torch.manual_seed(0)
    ref = Body()
    body, mgr = body_manager("ssd", store)
    (ref(x, ctx)).backward()
    want = {"w": ref.w.grad, "x": x.grad.clone()}
    x.grad = None
    with mgr.forward():
        out = body(x, ctx)
    mgr.drain()  # else backward cancels the swap-outs still queued: nothing to compare
    mgr.backward(out)
    assert rel_diff({"w": body.w.grad, "x": x.grad}, want) <= 1e-6
    s = mgr.stats()
    h_bytes, x_bytes, ctx_bytes, sm_bytes = 32 * 96 * 4, 32 * 64 * 4, 32 * 32 * 4, 32 * 32 * 4
    distinct = h_bytes + x_bytes + ctx_bytes + sm_bytes + 32 * 32 * 4  # + s (softmax input)
    assert s.saved_bytes <= distinct
    assert s.ssd_write_bytes == s.saved_bytes  # every distinct storage once, no parameter or buffer
    assert s.dedup_hits >= 4  # q, k, v, h.t() found h
    assert s.param_refs >= 2  # w (and the buffer) by reference
    mgr.close()


def test_unchanged_storage_is_not_rewritten_to_ssd(store):
    """x and ctx are the same tensors every step: written once, then found unchanged (same
    version, same CRC) and read from their first copy, until they change; a change torch does not
    track (through numpy: no new version) is caught by the CRC."""
    x = torch.randn(32, 64, requires_grad=True)
    ctx = torch.randn(32, 32)
    body, mgr = body_manager("ssd", store)
    torch.manual_seed(0)
    ref = Body()
    written = []
    for step in range(4):
        if step == 2:
            ctx.mul_(2.0)  # a new version
        if step == 3:
            ctx.numpy()[:] = 3.0  # the same version, other bytes
        with mgr.forward():
            out = body(x, ctx)
        mgr.drain()
        mgr.backward(out)
        s = mgr.stats()
        written.append((s.ssd_write_bytes, s.cache_hits))
        mgr.reset_stats()
        want_w = torch.autograd.grad(ref(x, ctx), ref.w)[0]
        assert rel_diff({"w": body.w.grad}, {"w": want_w}) <= 1e-6, step
        body.w.grad = None
    ctx_bytes, x_bytes = ctx.untyped_storage().nbytes(), x.untyped_storage().nbytes()
    assert written[1] == (written[0][0] - ctx_bytes - x_bytes, 2)
    assert written[2] == (written[0][0] - x_bytes, 1)
    assert written[3] == (written[0][0] - x_bytes, 1)
    mgr.close()


def test_unpack_reads_the_current_parameter_storage(store, data):
    """The runtime rebinds parameter storage between forward and backward; saved parameters are
    rebuilt from the parameter's data at unpack, never from the storage seen in forward."""
    ref = tiny_gpt2(dropout=0.0)
    _, want = run_step(ref, data)
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(
        model, ActivationSettings(policy="ssd", min_swap_bytes=0), store=store
    ) as mgr:
        model.zero_grad(set_to_none=True)
        with mgr.forward():
            loss = model(input_ids=data, labels=data).loss
        old = [p.data for p in model.parameters()]
        for p in model.parameters():
            p.data = p.data.clone()
        for o in old:
            o.fill_(float("nan"))  # the storage forward saw is garbage now
        mgr.backward(loss)
        got = {n: p.grad for n, p in model.named_parameters()}
        assert rel_diff(got, want) <= 1e-6
        assert mgr.stats().param_refs > 0


def test_second_backward_is_refused(store, data):
    model = tiny_gpt2(dropout=0.0)
    with ActivationManager.for_model(
        model, ActivationSettings(policy="host", min_swap_bytes=0), store=store
    ) as mgr:
        with mgr.forward():
            loss = model(input_ids=data, labels=data).loss
        mgr.backward(loss, retain_graph=True)
        with pytest.raises(ActivationError, match="retain_graph"):
            loss.backward()


def test_recompute_needs_the_same_saves(store):
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            y = x @ self.w
            return (y.tanh() if self.calls == 1 else y).sum()

    m = Flaky()
    mgr = ActivationManager([("flaky", [m])], ActivationSettings(policy="recompute"))
    mgr.install()
    with mgr.forward():
        out = m(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(ActivationError, match="flaky"):
        mgr.backward(out)
    mgr.close()


def test_auto_is_the_planners_choice_the_runtime_only_runs_it(store, data, monkeypatch):
    """A plan that leaves "auto" (no model profile) has it decided from the first step's measured
    sizes by the planner (planner/decide.py measured_activations), once; the runtime runs that
    choice and has no rule of its own: here the planner's is replaced by one that sends every
    auto unit to SSD under a budget that keeps them all, and the second step swaps them all."""
    asked = []

    def planner(measured, requested, room, *, device, host_bytes):
        asked.append((tuple(m.name for m in measured), tuple(requested), room, device))
        return tuple("ssd" if p == "auto" else p for p in requested)

    monkeypatch.setattr(decide, "measured_activations", planner)
    model = tiny_gpt2()
    cfg = ActivationSettings(
        policy="auto", overrides={"head": "recompute"}, budget_bytes=1 << 40, min_swap_bytes=0
    )
    with ActivationManager.for_model(model, cfg, store=store) as mgr:
        names = tuple(u.name for u in mgr.units)
        for _ in range(2):
            mgr.reset_stats()
            run_step(model, data, mgr)
        assert len(asked) == 1 and asked[0][0] == names and asked[0][3] == "cpu"
        assert asked[0][1] == tuple("recompute" if n == "head" else "auto" for n in names)
        assert mgr.policies() == {n: "recompute" if n == "head" else "ssd" for n in names}
        assert mgr.stats().ssd_write_bytes > 0  # (the second step ran the planner's choice)
    with pytest.raises(ValueError, match="TensorStore"):  # the planner may send auto units to SSD
        ActivationManager.for_model(tiny_gpt2(n_layer=1), cfg)


def test_config_is_validated(store):
    with pytest.raises(ValueError, match="min_swap_bytes"):
        ActivationSettings(min_swap_bytes=-1)
    with pytest.raises(ValueError, match="extra"):
        ActivationSettings(polcy="ssd")
    with pytest.raises(ValueError, match="nope"):
        ActivationManager.for_model(tiny_gpt2(n_layer=1), ActivationSettings(overrides={"nope": "ssd"}))
    with pytest.raises(ValueError, match="TensorStore"):
        ActivationManager.for_model(tiny_gpt2(n_layer=1), ActivationSettings(policy="ssd"))


def test_llama_under_ssd_and_recompute(store):
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    _, want = run_step(ref, x)
    for unit_policies in (
        {"model.layers.0": "ssd", "model.layers.1": "recompute"},
        {"model.layers.0": "recompute"},
    ):
        model = copy.deepcopy(ref)
        cfg = ActivationSettings(policy="host", overrides=unit_policies, min_swap_bytes=0)
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            _, got = run_step(model, x, mgr)
        assert rel_diff(got, want) <= 1e-6


def test_recompute_leaves_the_kv_cache_alone_and_refuses_a_prefix(data):
    """HF blocks append to a KV cache even in training: the recompute must not append again, and
    cannot replay a block whose cache held a prefix (that raises, it does not compute wrong)."""
    model = tiny_gpt2(n_layer=2, dropout=0.0)
    with ActivationManager.for_model(model, ActivationSettings(policy="recompute")) as mgr:
        with mgr.forward():
            out = model(input_ids=data, labels=data)
        mgr.backward(out.loss)
        assert out.past_key_values.get_seq_length() == data.shape[1]
        with torch.no_grad():
            prefix = model(input_ids=data[:, :4], use_cache=True).past_key_values
        with mgr.forward():
            out = model(input_ids=data[:, 4:], labels=data[:, 4:], cache=prefix)
        with pytest.raises(ActivationError, match="recomput"):
            mgr.backward(out.loss)


def test_bench_activations_smoke(tmp_path):
    """`offloadpp bench activations` on a toy model: runs, writes its JSON, reports every contender."""
    import argparse
    import json

    from offloadpp.bench import activations as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "act.json"
    args = p.parse_args(
        ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--vocab", "128", "--seq", "32", "--batch", "2",
         "--steps", "1", "--warmup", "0", "--min-swap-kib", "0", "--dir", str(tmp_path / "swap"), "--json", str(out),
         "--device", "cpu", "--threads", "1"]
    )  # fmt: skip
    rc = bench.run(args)
    report = json.loads(out.read_text())
    assert rc in (0, 1) and report["pass"] == (rc == 0)
    med = report["results"][0]["median"]
    assert set(med) == {"none", "keep", "host", "ssd", "recompute"}
    assert med["ssd"]["ssd_write_bytes"] + med["ssd"]["d2h_bytes"] > 0 and med["recompute"]["recompute_s"] > 0


def test_bench_activations_plan_contender(tmp_path):
    """`--policies keep,plan`: the planner's choice for a third of keep-all's peak runs beside the
    unbounded keep, within its budget, and its measured SSD bytes are set beside the cost model's."""
    import argparse
    import json
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_planner import cpu_hw

    from offloadpp.bench import activations as bench

    hw = tmp_path / "hw.json"
    cpu_hw().to_json(str(hw))
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "act.json"
    args = p.parse_args(
        ["--n-layer", "3", "--n-embd", "64", "--n-head", "4", "--vocab", "128", "--seq", "64", "--batch", "4",
         "--steps", "1", "--warmup", "1", "--min-swap-kib", "0", "--dir", str(tmp_path / "swap"), "--json", str(out),
         "--device", "cpu", "--threads", "1", "--policies", "keep,plan", "--budget-frac", "0.33", "--hardware", str(hw)]
    )  # fmt: skip
    rc = bench.run(args)
    report = json.loads(out.read_text())
    r = report["results"][0]
    plan = r["plan"]
    assert rc in (0, 1) and "pass_plan" in report
    assert set(plan["policies"]) - {"keep"}, plan  # a third of the peak: something leaves the device
    assert r["median"]["plan"]["peak_act_bytes"] <= r["budget_bytes"]
    assert r["median"]["keep"]["peak_act_bytes"] == r["keep_peak_bytes"]  # keep is unbounded
    assert 0 <= plan["bytes_error"] < 1.0
    assert plan["measured_ssd_bytes"] > 0 or plan["measured_recompute_s"] > 0  # it swapped or recomputed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "policy", ["host", "ssd", "recompute", "recompute_host", "recompute_ssd", "recompute_nested_host"]
)
def test_cuda_gradients_and_allocator_peak(policy, store, data):
    """On a GPU: side streams and pinned buffers give the same gradients, and the allocator's peak
    over the step stays below keeping everything."""
    ref = tiny_gpt2(n_layer=8, dropout=0.0).cuda()
    x = data.cuda()
    _, want = run_step(ref, x)
    model = copy.deepcopy(ref)
    with ActivationManager.for_model(
        model, ActivationSettings(policy=policy, min_swap_bytes=0), store=store
    ) as mgr:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _, got = run_step(model, x, mgr)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert rel_diff(got, want) <= 1e-6
        assert mgr.stats().peak_device_bytes > 0 and peak > 0


def test_recompute_frees_its_graphs(data):
    """Nothing of a step outlives it: recomputed tensors are detached, so no cycle through the C++
    graph keeps segments (and the memory they reach) alive across steps."""
    import gc

    from offloadpp.runtime.activations.recompute import Segment

    model = tiny_gpt2(n_layer=2, dropout=0.0)
    with ActivationManager.for_model(model, ActivationSettings(policy="recompute")) as mgr:
        for _ in range(3):
            run_step(model, data, mgr)
        gc.collect()
        assert sum(type(o) is Segment for o in gc.get_objects()) == 0


def test_on_the_standin_a_swap_in_released_in_flight_keeps_its_memory_for_the_copy():
    """A record brought back to the device and released before backward used it (a step that
    stops early): its device buffer goes with the record, but the copy into it is still queued
    on the h2d stream: the buffer must outlive that copy (swap.py's record_use, site act.in_keep).
    On the stand-in, with long delays, memory freed under a queued copy raises."""
    from offloadpp.runtime.activations.policy import ActPolicy
    from offloadpp.runtime.activations.records import RecState

    with standin_swapped_out(None, ActPolicy.HOST) as (accel, sw, rec, _):
        assert rec.state is RecState.HOST
        sw.fetch(rec)
        assert rec.state is RecState.MOVING_IN and not rec.event.done()
        sw.release(rec)
        accel.synchronize_device()  # raises if the copy found its destination freed


def test_on_the_standin_a_swap_out_cancelled_in_flight_gives_its_host_buffer_back_after_the_copy():
    """Backward wanting a record whose swap-out job has not started cancels it (the device bytes
    stay), but its device-to-host copy is already queued: the host buffer goes back to the pool
    only after that copy (site act.out_host_reuse), else the copy may land on the buffer's next
    owner. On the stand-in, with long delays: the next owner writes the buffer and sends it to
    the device, which must get the owner's bytes."""
    from types import SimpleNamespace

    from torch.multiprocessing.reductions import StorageWeakRef

    from offloadpp.runtime.accel import StandinAccelerator
    from offloadpp.runtime.activations.policy import ActPolicy
    from offloadpp.runtime.activations.records import RecState, SavedStorage
    from offloadpp.runtime.activations.swap import Swapper, _align

    accel = StandinAccelerator(seed=3, delay_ms=30.0)  # (OFFLOADPP_STANDIN_SKIP applies)
    sw = Swapper(accel, None, key_prefix="t", host_budget_bytes=None)
    try:
        saved = [torch.full((1024,), float(i)) for i in range(2)]  # what compute saved
        recs = [
            SavedStorage(
                SimpleNamespace(name="u"),
                ActPolicy.HOST,
                x.untyped_storage(),
                StorageWeakRef(x.untyped_storage()),
                0,
            )  # fmt: skip
            for x in saved
        ]
        for rec in recs:
            sw.hold(rec)
            sw.swap_out(rec)  # the worker waits for the first copy: the second job is queued
        sw.fetch(recs[1])
        assert recs[1].state is RecState.READY  # cancelled: the bytes never left
        owner = sw.pool.get(_align(recs[1].nbytes), torch.uint8)  # the next owner of a buffer
        mine = torch.full((1024,), 7.0)
        owner[: recs[1].nbytes].copy_(mine.view(torch.uint8))
        h2d = accel.new_stream()
        dev = accel.empty(recs[1].nbytes, torch.uint8, h2d)
        accel.copy(dev, owner[: recs[1].nbytes], h2d)
        accel.synchronize(accel.record(h2d), site="test.sync")
        assert torch.equal(dev.view(torch.float32), mine)
        for rec in recs:
            sw.release(rec)
    finally:
        sw.close()
        accel.close()
