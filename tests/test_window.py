"""Vertical accumulation windows (runtime/window.py, runtime/accumulate.py): `train_window` runs
each unit over all G micro-batches while its weights are bound, and equals the horizontal
window (forward/backward/step per micro-batch) and torch's AdamW over the same global batch, with
dropout on and clipping 1.0, under every activation policy.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from offloadpp.assemble import assemble_engine
from offloadpp.optim import AdamHyper
from offloadpp.planner import ActivationSettings, Settings, Tier
from offloadpp.runtime import RuntimeConfig, accumulate, jobs, rng
from offloadpp.runtime.unit import TORCH_DTYPES

transformers = pytest.importorskip("transformers")

VOCAB = 128
G = 4
LR = 1e-3


def gpt2(dropout: float = 0.1):
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def config(path, policy: str = "keep", **settings) -> RuntimeConfig:
    path.mkdir(parents=True, exist_ok=True)
    s = Settings(gradient_accumulation_steps=G, gradient_clipping=1.0, accumulation="vertical",
                 activations=ActivationSettings(policy=policy), **settings)  # fmt: skip
    return RuntimeConfig(
        nvme_paths=[str(path)], settings=s, device="cpu", ssd_read_gbps=2.0, ssd_write_gbps=2.0
    )


@pytest.fixture(scope="module")
def windows():
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(G)] for _ in range(3)]


def torch_adamw(ref, windows) -> list[float]:
    """The reference: in memory, each window's micro-batches one after the other from the
    window's seed (the horizontal RNG stream), the loss divided by G, clipping 1.0, AdamW."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for w, mbs in enumerate(windows):
        torch.manual_seed(100 + w)
        for x in mbs:
            loss = ref(input_ids=x, labels=x).loss
            (loss / G).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def run_windows(eng, windows) -> tuple[list[float], list]:
    losses, results = [], []
    for w, mbs in enumerate(windows):
        torch.manual_seed(100 + w)
        r = eng.train_window([{"input_ids": x, "labels": x} for x in mbs])
        assert len(r.losses) == G and r.report is not None
        losses += [x.item() for x in r.losses]
        results.append(r)
    return losses, results


@pytest.mark.parametrize("policy", ["keep", "recompute", "host", "ssd", "partial", "recompute_ssd"])
def test_vertical_window_equals_torch_adamw(tmp_path, windows, policy):
    """Dropout on, clipping 1.0: the first window runs horizontally (it records the RNG tape),
    the next two vertically; per-micro-batch losses and the weights equal torch's AdamW over the
    same global batches. Fails without the RNG replay (every micro-batch would draw the first
    one's dropout masks) or without the per-unit gradient sum (a unit updated from part of the
    window's gradients)."""
    from numerics import compare_weights

    ref = gpt2()
    model = copy.deepcopy(ref)
    want = torch_adamw(ref, windows)
    with assemble_engine(model, config(tmp_path, policy), hyper=AdamHyper(lr=LR, weight_decay=0.01)) as eng:
        got, results = run_windows(eng, windows)
        assert [r.vertical for r in results] == [False, True, True]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=LR, steps=len(windows)) < 1e-5
        assert results[-1].report.grad_norm is not None  # (clipping: the window's global norm)


def test_vertical_equals_the_horizontal_engine_and_reads_weights_once(tmp_path, windows):
    """Against the engine's own horizontal windows (per-micro-batch forward/backward/step): the
    same losses and weights, and each unit's weights read from SSD once for forward and once for
    backward per window instead of G times each; each unit handed to the optimizer once."""
    ref = gpt2()
    hyper = AdamHyper(lr=LR, weight_decay=0.01)
    with assemble_engine(copy.deepcopy(ref), config(tmp_path / "h"), hyper=hyper) as h:
        want, reports = [], []
        for w, mbs in enumerate(windows):
            torch.manual_seed(100 + w)
            for x in mbs:
                loss = h(input_ids=x, labels=x).loss
                h.backward(loss)
                reports.append(h.step())
                want.append(loss.item())
        want_sd = {k: v.clone() for k, v in h.module.state_dict().items()}
        h_io = {k: (r, w) for k, r, w in reports[-1].ssd_by_kind}  # (the window's last report: all of it)
    with assemble_engine(copy.deepcopy(ref), config(tmp_path / "v"), hyper=hyper) as v:
        handed = []
        on_grads = v.optimizer.on_grads
        v.optimizer.on_grads = lambda u: (handed.append(u.name), on_grads(u))[1]
        got, results = run_windows(v, windows)
        v_io = {k: (r, w) for k, r, w in results[-1].report.ssd_by_kind}
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        for k, t in v.module.state_dict().items():
            assert torch.allclose(t, want_sd[k], rtol=1e-5, atol=1e-6), k
        names = [u.name for u in v.units]
        last = handed[-len(names) :]
        assert last == names[::-1] and handed.count(names[1]) == G + 2  # (G in the horizontal first window)
    # the horizontal window read the weights for each micro-batch and moved each unit's gradient
    # through its home between micro-batches; the vertical one reads weights at most once per
    # visit (here none: the deferred updates apply at the next forward's visit, pending.py) and
    # keeps the gradients on the device
    assert h_io["gradients"][0] > 0 and h_io["weights"][0] > 0
    assert v_io["gradients"] == (0, 0) and v_io["weights"][0] * G <= h_io["weights"][0]
    assert sum(map(sum, v_io.values())) * 2 < sum(map(sum, h_io.values()))


def test_backward_runs_unit_by_unit_across_micro_batches():
    """The property the window rests on (runtime/window.py's Note): micro-batches interleaved by
    greenlets on one thread, one backward over their losses runs each layer's backward for every
    micro-batch before the layer below it, and each parameter's post-accumulate-grad hook fires
    once, with the sum of the micro-batches' gradients."""
    from offloadpp.runtime.window import VerticalForward

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    order, fired = [], []
    for i, lin in enumerate(layers):
        lin.weight.register_post_accumulate_grad_hook(lambda p, i=i: fired.append((i, p.grad.clone())))

    class Walk:  # stands for the executor's pre-hook
        window = None

    def forward(m_x):
        m, x = m_x
        for i, lin in enumerate(layers):
            Walk.window.arrive(i)
            x = lin(x)
            x.register_hook(lambda g, i=i, m=m: order.append((i, m)))
        return x.square().sum()

    xs = [torch.randn(2, 4) for _ in range(3)]
    starts = [rng.RngState(torch.device("cpu")) for _ in xs]
    Walk.window = VerticalForward(torch.device("cpu"), starts)
    losses = Walk.window.run(forward, list(enumerate(xs)))
    torch.autograd.backward(losses)
    assert order == [(i, m) for i in (2, 1, 0) for m in (2, 1, 0)]
    assert [i for i, _ in fired] == [2, 1, 0]
    want = torch.autograd.grad(sum(forward_plain(layers, x) for x in xs), layers[0].weight)[0]
    assert torch.allclose(fired[-1][1], want)


def forward_plain(layers, x):
    for lin in layers:
        x = lin(x)
    return x.square().sum()


def test_rng_tape_predicts_each_micro_batch_start():
    """The tape of a forward's random operators, replayed on scratch tensors, moves the
    generator exactly as the forward did."""
    drop = torch.nn.Dropout(0.3)
    x = torch.randn(3, 5)
    tape = rng.Tape()
    torch.manual_seed(5)
    with rng.TapeRecorder(tape):
        drop(x)
        torch.randn(7)
    after = rng.RngState(torch.device("cpu"))
    assert len(tape) == 2
    torch.manual_seed(5)
    first = rng.RngState(torch.device("cpu"))
    starts = rng.predicted_starts(first, [tape, tape], torch.device("cpu"))
    assert starts[1] == after and not (starts[0] == after)
    assert rng.RngState(torch.device("cpu")) == first  # (the generators left as they were)


def test_window_falls_back_to_horizontal_when_the_tape_does_not_hold(tmp_path, windows, caplog):
    """A forward that draws other random numbers than its shape's tape says (here: a tape made
    empty) is detected before backward; the window is dropped and runs horizontally, exact."""
    from numerics import compare_weights

    ref = gpt2()
    want = torch_adamw(copy.deepcopy(ref), windows)
    with assemble_engine(
        copy.deepcopy(ref), config(tmp_path), hyper=AdamHyper(lr=LR, weight_decay=0.01)
    ) as eng:
        torch.manual_seed(100)
        eng.train_window([{"input_ids": x, "labels": x} for x in windows[0]])
        for tape in eng._windows.tapes.values():
            tape.ops.clear()
        torch.manual_seed(101)
        with caplog.at_level(logging.WARNING, logger="offloadpp.runtime"):
            r = eng.train_window([{"input_ids": x, "labels": x} for x in windows[1]])
        assert not r.vertical and "runs again horizontally" in caplog.text
        assert [x.item() for x in r.losses] == pytest.approx(want[G : 2 * G], rel=1e-5, abs=1e-6)
        torch.manual_seed(102)
        r = eng.train_window([{"input_ids": x, "labels": x} for x in windows[2]])
        assert r.vertical  # (the tape recorded again)
        ref2 = copy.deepcopy(ref)
        torch_adamw(ref2, windows)
        assert compare_weights(eng.module.state_dict(), ref2.state_dict(), lr=LR, steps=3) < 1e-5


def test_train_window_follows_the_plan_and_refuses_a_half_done_window(tmp_path, windows):
    cfg = config(tmp_path / "h")
    cfg = cfg.model_copy(update={"settings": cfg.settings.model_copy(update={"accumulation": "horizontal"})})
    with assemble_engine(gpt2(0.0), cfg) as eng:
        assert not eng.plan.vertical
        mbs = [{"input_ids": x, "labels": x} for x in windows[0]]
        assert [eng.train_window(mbs).vertical for _ in range(2)] == [False, False]
        assert eng.train_window(mbs, vertical=True).vertical  # (asked explicitly)
    with assemble_engine(gpt2(0.0), config(tmp_path)) as eng:
        assert eng.plan.vertical
        x = windows[0][0]
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()  # (not the window's boundary: 1 of G)
        with pytest.raises(RuntimeError, match="half done"):
            eng.train_window([{"input_ids": x, "labels": x}] * G)
        assert eng.micro_in_window == 1  # the refusal left the half-done window as it was
        with pytest.raises(TypeError, match="no loss"):
            accumulate.loss_of(object(), None)


def test_eval_window_vertical_equals_forward_per_batch(tmp_path, windows, monkeypatch):
    """Forward only, dropout on (train mode under no_grad): the vertical window's outputs equal
    each micro-batch's forward run alone, one after the other from the same seed."""
    from offloadpp.runtime.window import VerticalForward

    runs = []
    run = VerticalForward.run
    monkeypatch.setattr(VerticalForward, "run", lambda self, *a: (runs.append(1), run(self, *a))[1])
    with assemble_engine(gpt2(), config(tmp_path)) as eng:
        mbs = [(x,) for x in windows[0]]  # positional micro-batches
        torch.manual_seed(7)
        with torch.no_grad():
            want = [eng(*b).logits for b in mbs]
        for _ in range(2):
            torch.manual_seed(7)
            got = [o.logits for o in eng.eval_window(mbs)]
            for a, b in zip(got, want):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert len(runs) == 1  # the first recorded the tape horizontally, the second ran vertically


def run_both(tmp_path, dtype: str, windows, model=gpt2, monkeypatch=None, **settings) -> dict:
    """{accumulation: (losses, results, fp32 weights, grads)} of the same windows run
    horizontally and vertically with `dtype` compute, the deferred step (speculate off); grads:
    (with monkeypatch) each unit's gradients as each of its updates read them, in order."""
    got = {}
    for acc in ("horizontal", "vertical"):
        cfg = config(tmp_path / acc, compute_dtype=dtype, speculate="off", **settings)
        cfg = cfg.model_copy(update={"settings": cfg.settings.model_copy(update={"accumulation": acc})})
        grads: dict = {}
        if monkeypatch is not None:
            update = jobs._update

            def spy(job, crcs, update=update, grads=grads):
                if job.update and job.grads is None and job.direct is None and job.gbuf is not None:
                    g = torch.cat([job.gbuf[s.offset : s.offset + s.numel] for _, s in job.unit.params])
                    grads.setdefault(job.unit.name, []).append(g)  # (the parameters', not the padding)
                return update(job, crcs)

            monkeypatch.setattr(jobs, "_update", spy)
        with assemble_engine(model(), cfg, hyper=AdamHyper(lr=LR, weight_decay=0.01)) as eng:
            losses, results = run_windows(eng, windows)
            weights = {k: v.float().clone() for k, v in eng.module.state_dict().items()}
            got[acc] = (losses, results, weights, grads)
    return got


_ULP = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # (half a unit in the last place of a value near 1)


@pytest.mark.parametrize("dtype,device", [("bf16", "cpu"), ("fp16", "cpu"), ("bf16", "standin")])
def test_16bit_vertical_window_keeps_the_horizontal_sum_rounded_once(
    tmp_path, windows, dtype, device, monkeypatch
):
    """bf16 and fp16 compute (fp16 with loss scaling, its overflow check over the window's one
    backward), dropout on, clipping 1.0, the deferred step: the first vertical window's update
    reads each unit's gradients as the horizontal window's fp32 sums rounded once to the compute
    dtype, bit for bit (each micro-batch's 16-bit gradients are the horizontal window's, summed in
    fp32 on the device as it sums them, then kept in 16 bits: Plan.window_grad_dtype's Note);
    norms and weights follow within that rounding. Fails without the fp32 sum
    (runtime/window_grads.py: autograd's sum rounds at every micro-batch) and if the window keeps
    its sums in fp32 (the dtype). On the GPU's copy path (the stand-in accelerator) the sums are
    rounded on the device, before their copy to the host."""
    from numerics import compare_weights, key_bias_mask

    from offloadpp.planner import LossScaling

    copied = []  # the dtypes of the gradients copied to the host (the copy path)
    if device == "standin":
        from conftest import set_device

        from offloadpp.runtime.optimizer import OptimizerPipeline

        set_device(monkeypatch, "standin")
        to_host = OptimizerPipeline._grads_to_host
        monkeypatch.setattr(
            OptimizerPipeline,
            "_grads_to_host",
            lambda self, g: (copied.append(g[0][2].dtype), to_host(self, g))[1],
        )
    scaling = {"loss_scaling": LossScaling(initial_scale_power=8)} if dtype == "fp16" else {}
    got = run_both(tmp_path, dtype, windows, monkeypatch=monkeypatch, **scaling)
    (h_loss, h_res, h_w, h_g), (v_loss, v_res, v_w, v_g) = got["horizontal"], got["vertical"]
    assert [r.vertical for r in v_res] == [False, True, True]
    assert h_g.keys() == v_g.keys() and h_g
    half = TORCH_DTYPES[dtype]
    for name in h_g:
        # window 0 (horizontal in both: the RNG tape) leaves equal weights; window 1 is vertical
        h, v = h_g[name][1], v_g[name][1]
        assert h.dtype == torch.float32 and v.dtype == half, name
        assert torch.equal(v, h.to(half)), name
    assert set(copied) == ({half} if device == "standin" else set())  # (autograd's, and the windows' sums)
    assert v_loss[: 2 * G] == h_loss[: 2 * G]  # (the third window starts from rounded-apart weights)
    assert v_loss == pytest.approx(h_loss, rel=1e-4)
    for h, v in zip(h_res, v_res):
        assert not v.report.skipped and v.report.grad_norm == pytest.approx(
            h.report.grad_norm, rel=_ULP[dtype]
        )
    # the weights part by a fraction of Adam's step (lr) outside the key bias's rounding noise
    # (numerics.py: there up to lr a step), and they do part
    compare_weights(v_w, h_w, lr=LR, steps=len(windows))
    apart = max((v_w[k] - h_w[k])[~key_bias_mask(k, h_w[k])].abs().max().item() for k in h_w)
    assert 0 < apart < LR / 2, apart


def test_fp16_window_whose_sum_overflows_fp16_skips_as_one_large_micro_batch(tmp_path):
    """The same micro-batch G times (dropout off) at a loss scale where each micro-batch's fp16
    gradients fit and their sum over the window does not (Plan.window_grad_dtype's Note): the
    horizontal window sums in fp32 in the gradients' home and takes its step; the vertical one
    keeps its fp32 sum in fp16, which overflows as one micro-batch of the window's sequences
    would: the step is skipped (and the scale halved). Fails if the
    window keeps its sums in fp32 (it takes the step) or without the fp32 sum on the device (the
    16-bit sum overflows at the same point: this test does not tell those apart; the test above
    does)."""
    from offloadpp.planner import LossScaling

    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    scaling = LossScaling(initial_scale_power=19, hysteresis=1)  # (2^20: one micro-batch overflows)
    got = run_both(tmp_path, "fp16", [[x] * G] * 2, model=lambda: gpt2(0.0), loss_scaling=scaling)
    (_, h_res, _, _), (_, v_res, _, _) = got["horizontal"], got["vertical"]
    assert [r.vertical for r in v_res] == [False, True]
    assert [r.report.skipped for r in h_res + v_res] == [False, False, False, True]
    assert h_res[-1].report.loss_scale == v_res[-1].report.loss_scale == 2.0**19  # (the scale it ran at)


def test_fp16_overflow_in_a_vertical_window_skips_its_step(tmp_path, windows):
    """A loss scale that overflows: the window's one backward finds it, the step is skipped
    (no weight changes) and the scale halves, window after window."""
    from offloadpp.planner import LossScaling

    ref = gpt2()
    cfg = config(
        tmp_path, compute_dtype="fp16", loss_scaling=LossScaling(initial_scale_power=8, hysteresis=1)
    )
    with assemble_engine(copy.deepcopy(ref), cfg) as eng:
        run_windows(eng, windows[:1])  # (the RNG tape)
        before = {k: v.clone() for k, v in eng.module.state_dict().items()}
        eng.loss_scaler.scale = 2.0**40
        mbs = [{"input_ids": x, "labels": x} for x in windows[1]]
        scales = []
        for _ in range(2):
            r = eng.train_window(mbs)
            assert r.vertical and r.report.skipped
            scales.append(r.report.loss_scale)
        assert scales[1] == scales[0] / 2
        assert all(torch.equal(t, before[k]) for k, t in eng.module.state_dict().items())


def test_an_error_in_one_micro_batch_leaves_the_engine_usable(tmp_path, windows):
    """A micro-batch whose forward raises in the middle of a vertical window: the error reaches
    the caller, the other micro-batches' coroutines are unwound, the window is dropped as an
    interrupted step, and the next windows train as if it had not happened."""
    from numerics import compare_weights

    ref = gpt2()
    model = copy.deepcopy(ref)
    torch_adamw(ref, windows)
    with assemble_engine(model, config(tmp_path), hyper=AdamHyper(lr=LR, weight_decay=0.01)) as eng:
        run_windows(eng, windows[:1])
        calls = []

        def boom(module, args):
            calls.append(1)
            if len(calls) == 3:  # the third micro-batch reaching the second block
                raise ValueError("boom")

        h = eng.module.transformer.h[1].register_forward_pre_hook(boom)
        with pytest.raises(ValueError, match="boom"):
            eng.train_window([{"input_ids": x, "labels": x} for x in windows[1]])
        h.remove()
        assert eng.executor.window is None and eng.global_step == 1
        for w in (1, 2):
            torch.manual_seed(100 + w)
            assert eng.train_window([{"input_ids": x, "labels": x} for x in windows[w]]).vertical
        assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=LR, steps=3) < 1e-5


def _streamed(path):
    """A 6-block GPT-2 whose every unit's weights stream (one fetched ahead), and its config."""
    cfg = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg), config(path, prefetch_depth=1, device_budget_bytes=700_000)


def test_updates_at_the_next_visit_on_the_copy_path_equal_torch_adamw(tmp_path, windows, monkeypatch):
    """On the GPU's copy path (the stand-in accelerator) with clipping, a window's deferred
    updates apply at each unit's next visit (decide.lazy_runtime, runtime/pending.py), and the
    device copy of a unit's weights is made only once its update is done (Slot.updating): the
    losses equal torch's AdamW. Without the wait the forward computes with the weights before
    the update (losses off by 1e-2)."""
    from conftest import set_device

    set_device(monkeypatch, "standin")
    model, rc = _streamed(tmp_path)
    ref = copy.deepcopy(model)
    want = torch_adamw(ref, windows)
    with assemble_engine(model, rc, hyper=AdamHyper(lr=LR, weight_decay=0.01)) as eng:
        assert eng.device.copies and eng.optimizer.lazy and all(p.weights is Tier.SSD for _, p in eng.plan)
        got, results = run_windows(eng, windows)
        assert [r.vertical for r in results] == [False, True, True]
        assert {r.report.updates for r in results} == {"deferred"}
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_window_copies_prefetched_weights_up_within_the_visit(tmp_path, windows, monkeypatch):
    """On the GPU's copy path (the stand-in accelerator), a vertical window's visit runs G
    micro-batches, and each one reaching the unit pumps the held weights: a unit fetched ahead
    has its host-to-device copy started within the visit its read ends in (as the cost model
    replays it, planner/simulate.py Sim.compute), not only at its own visit's entry or bind."""
    from conftest import set_device

    from offloadpp.runtime import device as device_mod
    from offloadpp.runtime import executor as executor_mod

    set_device(monkeypatch, "standin")
    depth = {"hook": 0, "visit": 0}  # in a unit hook; entering a visit or binding a unit's weights
    early = [0]  # copies started in a hook, outside an entry and a bind

    def counting(name, key):
        orig = getattr(executor_mod.Executor, name)

        def wrapped(self, *a, _orig=orig):
            depth[key] += 1
            try:
                return _orig(self, *a)
            finally:
                depth[key] -= 1

        monkeypatch.setattr(executor_mod.Executor, name, wrapped)

    for name in ("_pre_forward", "_pre_backward"):
        counting(name, "hook")
    for name in ("_enter", "_bind", "ensure_forward"):
        counting(name, "visit")
    start_copy = device_mod.CopyWeights._start_copy

    def start(self, host):
        early[0] += depth["hook"] > 0 and depth["visit"] == 0
        return start_copy(self, host)

    monkeypatch.setattr(device_mod.CopyWeights, "_start_copy", start)
    model, rc = _streamed(tmp_path)
    with assemble_engine(model, rc, hyper=AdamHyper(lr=LR)) as eng:
        assert eng.device.copies and all(p.weights is Tier.SSD for _, p in eng.plan)
        run_windows(eng, windows[:1])  # horizontal (records the tapes)
        early[0] = 0
        _, results = run_windows(eng, windows[1:2])
        assert results[-1].vertical
    assert early[0] > 0
