"""The out-of-core runtime against in-memory torch: a tiny GPT-2 (random init, built from a
config: nothing is downloaded) with every array on SSD must train to the weights
torch.optim.AdamW gives, with and without gradient accumulation and clipping.

The key-bias elements of GPT-2's c_attn.bias are compared with a looser bound: tests/numerics.py
says why.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from numerics import compare_weights

transformers = pytest.importorskip("transformers")

from offloadpp.assemble import assemble_engine  # noqa: E402
from offloadpp.optim import AdamHyper  # noqa: E402
from offloadpp.planner import LossScaling, PlanError, Settings, Tier  # noqa: E402
from offloadpp.runtime import PreflightError, RuntimeConfig  # noqa: E402

LR, WD = 1e-3, 0.01
VOCAB = 128


def tiny_gpt2(seed: int = 0, meta: bool = False):
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(cfg)
    return transformers.GPT2LMHeadModel(cfg)


def tiny_llama(seed: int = 0):
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def streaming_config(path, **settings) -> RuntimeConfig:
    """The default settings (budgets "auto" with the state on SSD: the streaming minimum, every
    array of every unit on SSD), on the CPU as the device."""
    scaling = {k: settings.pop(k) for k in ("initial_scale_power", "hysteresis") if k in settings}
    if scaling:
        settings["loss_scaling"] = LossScaling(**scaling)
    return RuntimeConfig(
        nvme_paths=[str(path)],
        settings=Settings(**settings),
        device="cpu",
        ssd_read_gbps=2.0,
        ssd_write_gbps=2.0,
    )


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(n)]


def compare(got: dict, want: dict, steps: int) -> float:
    """Max over tensors of max|got - want| / max|want|, key-bias elements bounded separately."""
    return compare_weights(got, want, lr=LR, steps=steps)


def train_pair(ref, eng, data, *, accum: int = 1, clip: float = 0.0, check_every: int = 0):
    """The same micro-batches through torch (AdamW in memory) and the engine."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    reports = []
    for step in range(len(data) // accum):
        for m in range(accum):
            x = data[step * accum + m]
            loss_ref = ref(input_ids=x, labels=x).loss
            (loss_ref / accum).backward()
            x = x.to(eng.device.torch_device)  # (on_device's cuda case: the batch made on the host)
            loss = eng(input_ids=x, labels=x).loss
            assert math.isclose(loss.item(), loss_ref.item(), rel_tol=1e-4), (
                step,
                loss.item(),
                loss_ref.item(),
            )
            eng.backward(loss)
            r = eng.step()
            assert (r is None) == (m < accum - 1)
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        reports.append(r)
        if check_every and (step + 1) % check_every == 0:
            assert compare(eng.module.state_dict(), ref.state_dict(), step + 1) < 1e-5
    return reports


def test_all_state_on_ssd_trains_like_adamw(tmp_path, on_device):
    ref = tiny_gpt2()
    eng = assemble_engine(
        copy.deepcopy(ref), streaming_config(tmp_path), hyper=AdamHyper(lr=LR, weight_decay=WD)
    )
    try:
        for p in eng.plan.placements:
            assert (p.weights, p.master, p.moments) == (Tier.SSD, Tier.SSD, Tier.SSD), p
        reports = train_pair(ref, eng, batches(10), check_every=3)  # state_dict() between steps too
        assert compare(eng.module.state_dict(), ref.state_dict(), 10) < 1e-5
        r = reports[-1]
        assert r.step == 10 and r.ssd_read_bytes > 0 and r.ssd_write_bytes > 0 and r.fetch_misses == 0
        assert r.floor_s == max(r.compute_s, r.ssd_s, r.adam_s) and r.step_s > 0
        sd = eng.module.state_dict()
        assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])  # tied: one parameter
        assert eng.disk_bytes() >= eng.plan.ssd_bytes()
    finally:
        eng.close()


def test_accumulation_and_clipping_train_like_adamw(tmp_path, on_device):
    ref = tiny_gpt2()
    cfg = streaming_config(tmp_path, gradient_accumulation_steps=2, gradient_clipping=1.0)
    eng = assemble_engine(copy.deepcopy(ref), cfg, hyper=AdamHyper(lr=LR, weight_decay=WD))
    try:
        assert eng.plan.accumulate_grads and eng.plan.deferred_update
        assert all(p.grads is Tier.SSD for p in eng.plan.placements)
        reports = train_pair(ref, eng, batches(20), accum=2, clip=1.0)
        assert compare(eng.module.state_dict(), ref.state_dict(), 10) < 1e-5
        assert all(r.grad_norm is not None and r.grad_norm > 1.0 for r in reports)  # clipping was active
    finally:
        eng.close()


def test_llama_trains_like_adamw(tmp_path, on_device):
    ref = tiny_llama()
    eng = assemble_engine(
        copy.deepcopy(ref), streaming_config(tmp_path), hyper=AdamHyper(lr=LR, weight_decay=WD)
    )
    try:
        assert [u.name for u in eng.units] == ["embed", "model.layers.0", "model.layers.1", "head"]
        train_pair(ref, eng, batches(3))
        assert compare(eng.module.state_dict(), ref.state_dict(), 3) < 1e-5
    finally:
        eng.close()


def test_budget_too_small_for_one_unit(tmp_path):
    model = tiny_gpt2()
    cfg = RuntimeConfig(
        nvme_paths=[str(tmp_path)],
        settings=Settings(device_budget_bytes=4096, host_budget_bytes=1 << 30),
        device="cpu",
    )
    with pytest.raises(
        PlanError,
        match=r"device budget of 4.00 KiB \(4096 bytes\) is too small.*largest unit 'transformer.h.0'",
    ):
        assemble_engine(model, cfg)
    cfg = RuntimeConfig(
        nvme_paths=[str(tmp_path)],
        settings=Settings(device_budget_bytes=1 << 30, host_budget_bytes=4096),
        device="cpu",
    )
    with pytest.raises(PlanError, match=r"host budget of 4.00 KiB \(4096 bytes\) is too small"):
        assemble_engine(model, cfg)
    assert list(tmp_path.iterdir()) == []  # nothing written before the error


@pytest.mark.parametrize("what", ["missing", "file", "unwritable"])
def test_bad_nvme_path(tmp_path, what):
    if what == "missing":
        path, match = tmp_path / "no" / "such", "does not exist"
    elif what == "file":
        path, match = tmp_path / "f", "is not a directory"
        path.write_text("")
    else:
        path, match = "/proc", "is not writable"  # not writable even for root
    cfg = RuntimeConfig(nvme_paths=[str(path)], device="cpu")
    with pytest.raises(PreflightError, match=match):
        assemble_engine(tiny_gpt2(), cfg)


def test_too_little_free_space(small_fs):
    model = tiny_gpt2()
    cfg = streaming_config(small_fs)
    with pytest.raises(PreflightError) as e:
        assemble_engine(model, cfg)
    # where each byte of the need comes from, and what to do (issue 37)
    assert re.search(
        r"not enough free space for the training state: '.*small_fs' has .* free and needs .* \(.* more\)\. The "
        r"need: the training state .*, its second generation .*, swap-file headers and 4 KiB rounding .* \(\d+ "
        r"files in all\), a margin of 1% \(at least 1\.00 MiB\) .* for filesystem metadata .*\. Free that much "
        r"there, give the run more or other nvme paths, or a larger host budget",
        str(e.value),
    ), str(e.value)


def test_checkpoint_round_trip(tmp_path, on_device):
    ref = tiny_gpt2()
    data = batches(6)
    hyper = AdamHyper(lr=LR, weight_decay=WD)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = assemble_engine(copy.deepcopy(ref), streaming_config(tmp_path / "a"), hyper=hyper)
    b = assemble_engine(tiny_gpt2(seed=5), streaming_config(tmp_path / "b"), hyper=AdamHyper(lr=0.5))
    try:
        for x in data[:3]:
            a.backward(a(input_ids=x, labels=x).loss)
            a.step()
        a.save_state(str(tmp_path / "ckpt"))
        b.load_state(str(tmp_path / "ckpt"))
        assert b.global_step == 3 and b.get_lr() == LR
        for x in data[3:]:
            for e in (a, b):
                e.backward(e(input_ids=x, labels=x).loss)
                e.step()
        sa, sb = a.module.state_dict(), b.module.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    finally:
        a.close()
        b.close()


def test_meta_model_is_initialised_unit_by_unit(tmp_path):
    model = tiny_gpt2(meta=True)
    assert next(model.parameters()).is_meta
    eng = assemble_engine(model, streaming_config(tmp_path), init_fn=model._init_weights)
    try:
        sd = eng.module.state_dict()
        assert not any(v.is_meta for v in sd.values())
        assert 0.01 < sd["transformer.wte.weight"].std().item() < 0.03  # normal(0, 0.02)
        assert torch.equal(sd["transformer.h.0.ln_1.weight"], torch.ones(64))
        x = batches(1)[0]
        losses = []
        for _ in range(3):
            loss = eng(input_ids=x, labels=x).loss
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
        assert abs(losses[0] - math.log(VOCAB)) < 0.5 and losses[-1] < losses[0]
    finally:
        eng.close()


def test_set_lr_and_eval_forward(tmp_path):
    ref = tiny_gpt2()
    eng = assemble_engine(
        copy.deepcopy(ref), streaming_config(tmp_path), hyper=AdamHyper(lr=LR, weight_decay=WD)
    )
    try:
        eng.set_lr(0.0)
        assert eng.get_lr() == 0.0
        x = batches(1)[0]
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
        assert compare(eng.module.state_dict(), ref.state_dict(), 1) == 0.0  # lr 0: nothing moves
        eng.set_lr(LR)
        with torch.no_grad():
            out = eng(input_ids=x)  # an eval forward in between changes nothing
        assert out.logits.shape == (2, 16, VOCAB)
        eng.backward(eng(input_ids=x, labels=x).loss)
        assert eng.step().step == 2
    finally:
        eng.close()


class WithUnused(torch.nn.Module):
    """Blocks with a parameter forward never uses: torch.optim skips it (no decay, no step)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.spare = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x).square().mean()


def test_parameters_without_grads_are_left_alone(tmp_path):
    torch.manual_seed(0)
    ref = WithUnused()
    units = (("inp",), ("blocks.0", "spare.0"), ("blocks.1", "spare.1"), ("blocks.2", "spare.2"), ("out",))
    settings = Settings(device_budget_bytes=1 << 24, host_budget_bytes=1 << 24, units=units)
    cfg = RuntimeConfig(
        nvme_paths=[str(tmp_path)], settings=settings, device="cpu", ssd_read_gbps=1.0, ssd_write_gbps=1.0
    )
    init = copy.deepcopy(ref.state_dict())
    eng = assemble_engine(copy.deepcopy(ref), cfg, hyper=AdamHyper(lr=LR, weight_decay=WD))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    try:
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            x = torch.randn(4, 8, generator=g)
            ref(x).backward()
            opt.step()
            opt.zero_grad()
            eng.backward(eng(x))
            eng.step()
        sd, want = eng.module.state_dict(), ref.state_dict()
        for k in want:
            torch.testing.assert_close(sd[k], want[k], rtol=1e-5, atol=1e-7, msg=k)
        assert torch.equal(sd["spare.1.weight"], init["spare.1.weight"])
        assert not torch.equal(sd["blocks.1.weight"], init["blocks.1.weight"])
    finally:
        eng.close()


def global_rel_diff(got: dict, want: dict) -> float:
    num = sum((got[k].float() - w).square().sum() for k, w in want.items())
    den = sum(w.square().sum() for w in want.values())
    return math.sqrt(num / den)


def test_bf16_compute_with_fp32_master(tmp_path):
    """The 16-bit path (a separate compute copy written by Adam's half_out) on the CPU device."""
    ref = tiny_gpt2()
    init = copy.deepcopy(ref.state_dict())
    cfg = streaming_config(tmp_path, compute_dtype="bf16")
    eng = assemble_engine(copy.deepcopy(ref), cfg, hyper=AdamHyper(lr=LR, weight_decay=WD))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    try:
        assert eng.plan.separate_weights and eng.units[1].compute is not eng.units[1].master
        for x in batches(3):
            loss_ref = ref(input_ids=x, labels=x).loss
            loss_ref.backward()
            opt.step()
            opt.zero_grad()
            loss = eng(input_ids=x, labels=x).loss
            assert loss.dtype == torch.float32 or loss.dtype == torch.bfloat16
            assert abs(loss.item() - loss_ref.item()) < 2e-2
            eng.backward(loss)
            eng.step()
        sd = eng.module.state_dict()
        assert sd["transformer.h.0.mlp.c_fc.weight"].dtype == torch.float32  # the master, as created
        # bf16 rounds activations and gradients: the update is close to fp32's, not equal
        moved = global_rel_diff(ref.state_dict(), init)
        assert global_rel_diff(sd, ref.state_dict()) < 0.15 * moved
    finally:
        eng.close()


def test_fp16_overflow_skips_the_step(tmp_path):
    ref = tiny_gpt2()
    cfg = streaming_config(tmp_path, compute_dtype="fp16", initial_scale_power=40, hysteresis=1)
    eng = assemble_engine(copy.deepcopy(ref), cfg, hyper=AdamHyper(lr=LR, weight_decay=WD))
    try:
        assert eng.plan.deferred_update
        x = batches(1)[0]
        scales = []
        for _ in range(3):
            eng.backward(eng(input_ids=x, labels=x).loss)
            r = eng.step()
            scales.append(r.loss_scale)
            assert r.skipped and r.grad_norm == math.inf and r.step == 0
        assert scales == [2.0**40, 2.0**39, 2.0**38]  # halved on each overflow (hysteresis 1)
        sd, want = eng.module.state_dict(), ref.state_dict()
        assert all(torch.equal(sd[k], want[k]) for k in want)  # no update happened
        eng.loss_scaler.scale = 1024.0
        eng.backward(eng(input_ids=x, labels=x).loss)
        r = eng.step()
        assert not r.skipped and r.step == 1 and math.isfinite(r.grad_norm)
    finally:
        eng.close()


def test_updates_start_during_backward(tmp_path):
    """The point of the schedule: a unit is handed to Adam when its gradients are complete,
    while backward goes on with the units before it, not after backward."""
    ref = tiny_gpt2()
    eng = assemble_engine(copy.deepcopy(ref), streaming_config(tmp_path), hyper=AdamHyper(lr=LR))
    submitted_during_backward = []
    orig = eng.optimizer._submit

    def spy(job):
        submitted_during_backward.append((job.unit.name, job.update, eng.executor.in_backward))
        orig(job)

    eng.optimizer._submit = spy
    try:
        x = batches(1)[0]
        eng.backward(eng(input_ids=x, labels=x).loss)
        # every unit was handed to Adam from inside backward, in backward order (the embeddings,
        # whose tied gradient completes last, at the very end)
        names = [n for n, upd, during in submitted_during_backward if upd and during]
        assert names == [u.name for u in eng.optimizer.order]
        assert eng.step().step == 1
    finally:
        eng.close()


def test_swap_directories_take_the_plans_stripe_weights(tmp_path):
    from offloadpp.runtime.engine import stripe_weights

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    stripe = ((a, 0.75), (b, 0.25))
    # the runtime's directories lie inside the profiled ones (swap_dirs adds "offloadpp")
    assert stripe_weights([f"{a}/offloadpp", f"{b}/offloadpp"], stripe) == [0.75, 0.25]
    assert stripe_weights([f"{b}/offloadpp", f"{a}/offloadpp"], stripe) == [0.25, 0.75]
    assert stripe_weights([a, str(tmp_path / "c")], stripe) is None  # one not profiled: evenly
    assert stripe_weights([a, b], ()) is None


def test_placements_run_within_their_schedules_peaks(tmp_path, monkeypatch):
    """Placements run two steps with budgets exactly their schedule's peaks: the runtime draws
    each array from the pool the plan counts it in. The first: masters kept in host memory under
    weights not on the device are host bytes (they were drawn from the device pool, which the
    plan had not sized for them all at once: a budget error at initialization)."""
    import random
    from dataclasses import replace

    import offloadpp.runtime.memory as memory
    from offloadpp.assemble import unit_specs
    from offloadpp.planner import Placement, streaming_plan, with_peak_budgets
    from offloadpp.runtime import OffloadEngine

    monkeypatch.setattr(memory, "RELEASE_WAIT_S", 2.0)  # a plan that does not fit fails fast
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    specs = unit_specs(model, None)
    tiers = (Tier.DEVICE, Tier.HOST, Tier.SSD)
    rng = random.Random(0)
    cases = [(Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)]
    cases += [tuple(rng.choice(tiers) for _ in specs) for _ in range(3)]
    data = batches(2)
    for i, weights in enumerate(cases):
        placements = tuple(
            Placement(u.name, w, Tier.SSD if w is Tier.SSD else Tier.HOST, rng.choice(tiers[1:]))
            for u, w in zip(specs, weights)
        )
        base = streaming_plan(
            specs, device="cpu", compute_dtype="fp32", prefetch_depth=1, optim_prefetch_depth=0
        )
        plan = with_peak_budgets(replace(base, placements=placements))
        d = tmp_path / str(i)
        d.mkdir()
        cfg = RuntimeConfig(nvme_paths=[str(d)], settings=Settings(), device="cpu", log_every=0,
                            ssd_read_gbps=2.0, ssd_write_gbps=2.0)  # fmt: skip
        eng = OffloadEngine(copy.deepcopy(model), cfg, plan, hyper=AdamHyper(lr=LR))
        try:
            for ids in data:
                eng.backward(eng(input_ids=ids, labels=ids).loss)
                eng.step()
            assert eng.device_pool.peak_bytes <= plan.budgets.buffer_bytes
            assert eng.host_pool.peak_bytes <= plan.budgets.host_bytes
        finally:
            eng.close()


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_gradients_autograd_leaves_stay_within_the_device_budget(tmp_path, monkeypatch, clip):
    """On the CPU device autograd's gradients are device memory outside the pool. With the
    optimizer's worker slower than backward (a loaded machine), each unit's stayed alive in its
    job until absorbed: past the device budget by several units' gradients. Now backward waits at
    the budget: the pool's buffers plus the live gradients never pass it by more than the
    gradients of the visit being made (room the plan's peak holds)."""
    import time
    import weakref
    from dataclasses import replace

    import offloadpp.runtime.memory as memory
    import offloadpp.runtime.optimizer as optimizer
    from offloadpp.assemble import unit_specs
    from offloadpp.planner import streaming_plan, with_peak_budgets
    from offloadpp.runtime import OffloadEngine
    from offloadpp.runtime.unit import Unit

    monkeypatch.setattr(memory, "RELEASE_WAIT_S", 5.0)
    work = optimizer._work

    def slow_work(job, store):
        time.sleep(0.05)
        return work(job, store)

    monkeypatch.setattr(optimizer, "_work", slow_work)
    live = [0]

    def dropped(n):
        live[0] -= n

    take = Unit.take_grads
    seen = []

    def take_grads(self):
        out = take(self)
        for _, _, g in out:
            n = g.numel() * g.element_size()
            live[0] += n
            weakref.finalize(g, dropped, n)
        pool = eng.device_pool
        seen.append(
            (pool.allocated_bytes - pool.charged_bytes + live[0], sum(g.numel() * 4 for _, _, g in out))
        )
        return out

    monkeypatch.setattr(Unit, "take_grads", take_grads)
    cfg = transformers.GPT2Config(n_layer=6, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    base = streaming_plan(unit_specs(model, None), device="cpu", compute_dtype="fp32", prefetch_depth=1,
                          optim_prefetch_depth=0)  # fmt: skip
    plan = with_peak_budgets(replace(base, deferred_update=clip > 0))
    rcfg = RuntimeConfig(nvme_paths=[str(tmp_path)], settings=Settings(gradient_clipping=clip), device="cpu", log_every=0,
                         ssd_read_gbps=2.0, ssd_write_gbps=2.0)  # fmt: skip
    eng = OffloadEngine(model, rcfg, plan, hyper=AdamHyper(lr=LR))
    try:
        for ids in batches(2):
            eng.backward(eng(input_ids=ids, labels=ids).loss)
            eng.step()
        assert seen
        over = [held - plan.budgets.buffer_bytes - visit for held, visit in seen]
        assert max(over) <= 0, (
            f"the device's buffers and live gradients passed its budget by {max(over)} bytes"
        )
        assert eng.device_pool.charged_bytes >= 0
    finally:
        eng.close()
