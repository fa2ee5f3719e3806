"""The cost model: the replay's timing on synthetic hardware (pure), and its bytes against the
runtime's (a tiny GPT-2 trained for a few steps: every plan must move exactly what the replay says)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from offloadpp.planner import Budgets, PlanError, Settings, Tier, streaming_plan
from offloadpp.planner.cost import estimate, replay
from offloadpp.planner.hardware import HardwareProfile
from offloadpp.planner.model_profile import analytic_profile
from offloadpp.planner.request import Request
from offloadpp.planner.search import search

GPT2 = {
    "model_type": "gpt2",
    "n_layer": 4,
    "n_embd": 256,
    "n_head": 4,
    "vocab_size": 4096,
    "n_positions": 128,
}


def hw(**kw) -> HardwareProfile:
    base = dict(
        device="cpu", device_name="t", cpu_cores=2, ssd_read_gbps=2.0, ssd_write_gbps=2.0, h2d_gbps=10.0,
        d2h_gbps=10.0, memcpy_gbps=10.0, device_flops_per_s={"fp32": 100e9}, adam_params_per_s={1: 1e9},
        host_memory_bytes=1 << 34, device_memory_bytes=1 << 34,
    )  # fmt: skip
    base.update(kw)
    return HardwareProfile(**base)


def model(seq_len: int = 64):
    return analytic_profile(GPT2, micro_batch=1, seq_len=seq_len)


def stream(m, k: int = 2, q: int = 2, **kw):
    return streaming_plan(m.unit_specs(), device=kw.pop("device", "cpu"), compute_dtype=kw.pop("compute_dtype", "fp32"),
                          prefetch_depth=k, optim_prefetch_depth=q, budgets=Budgets(1 << 34, 1 << 34), **kw)  # fmt: skip


def in_memory(plan):
    cpu = plan.device == "cpu"
    return replace(plan, placements=tuple(
        replace(p, weights=Tier.DEVICE, master=Tier.HOST, moments=Tier.HOST, grads=Tier.HOST) if cpu or not plan.separate_weights
        else replace(p, weights=Tier.DEVICE, master=Tier.HOST, moments=Tier.HOST, grads=Tier.HOST)
        for p in plan.placements))  # fmt: skip


def test_in_memory_plan_is_compute_plus_the_last_update():
    m = model()
    e = estimate(in_memory(stream(m)), hw(), m)
    assert e.ssd_read_bytes == e.ssd_write_bytes == 0 and e.ssd_s == 0
    assert e.bound == "compute"
    # the embeddings' backward has no FLOPs here: the last block's update and theirs run after backward
    tail = (m.units[0].numel + m.units[1].numel) / 1e9
    assert e.step_s == pytest.approx(e.compute_s + tail, rel=0.01)
    assert e.optimizer_wait_s == pytest.approx(tail, rel=0.05)


def test_slow_ssd_bounds_the_step():
    m = model()
    e = estimate(stream(m), hw(ssd_read_gbps=0.05, ssd_write_gbps=0.05), m)
    assert e.bound == "ssd"
    assert e.step_s >= 0.97 * e.ssd_s
    assert e.ssd_read_bytes > 0 and e.ssd_write_bytes > 0
    fast = estimate(stream(m), hw(ssd_read_gbps=50.0, ssd_write_gbps=50.0), m)
    assert fast.bound == "compute" and fast.step_s < 1.2 * fast.compute_s


def test_step_is_at_least_the_floor_and_deterministic():
    m = model()
    for k, q in ((0, 0), (1, 1), (2, 2), (3, 0)):
        for gbps in (0.2, 1.0, 5.0):
            h = hw(ssd_read_gbps=gbps, ssd_write_gbps=gbps)
            e = estimate(stream(m, k, q), h, m)
            assert e.step_s >= 0.97 * e.floor_s, (k, q, gbps)
            assert estimate(stream(m, k, q), h, m) == e


def test_deeper_prefetch_hides_more_io():
    m = model()
    h = hw(ssd_read_gbps=0.5, ssd_write_gbps=2.0)
    k0 = estimate(stream(m, 0, 0), h, m)
    k2 = estimate(stream(m, 2, 2), h, m)
    assert k2.step_s < k0.step_s


def test_cpu_sharing_slows_the_step():
    m = model()
    base = estimate(in_memory(stream(m)), hw(adam_params_per_s={1: 0.05e9}), m)
    shared = estimate(in_memory(stream(m)), hw(adam_params_per_s={1: 0.05e9}, compute_slowdown_under_adam=1.5,
                                               adam_slowdown_under_compute=2.0), m)  # fmt: skip
    assert shared.backward_s > base.backward_s * 1.2  # compute slowed while Adam runs beside it
    assert shared.step_s > base.step_s * 1.03


def test_io_contention_slows_compute_only_while_the_ssd_works():
    m = model()
    for plan, charged in ((in_memory(stream(m)), False), (stream(m), True)):
        fast = dict(ssd_read_gbps=8.0, ssd_write_gbps=8.0)  # the step is bound by compute
        base = estimate(plan, hw(**fast), m)
        slowed = estimate(plan, hw(compute_slowdown_under_io=1.5, **fast), m)
        if charged:  # forward and backward compute while the state streams
            assert base.bound == "compute"
            assert slowed.step_s > 1.05 * base.step_s
        else:  # nothing on SSD: nothing to charge
            assert slowed == base
    with pytest.raises(ValueError, match="compute_slowdown_under_io"):
        hw(compute_slowdown_under_io=0.9)


def test_forward_reads_overtake_the_previous_steps_writes():
    # as the engine serves them: the next forward's fetches (k=2 ahead) go before the writes the
    # previous step's updates queued, so forward computes nearly as if the weights were in memory
    # (a FIFO SSD put them behind every queued write: forward 7x longer here)
    m = model()
    h = hw(ssd_read_gbps=1.0, ssd_write_gbps=1.0)
    e = estimate(stream(m, 2, 2), h, m)
    resident = estimate(in_memory(stream(m, 2, 2)), h, m)
    assert e.ssd_read_bytes > 0 and e.ssd_write_bytes > 0
    assert e.forward_s < 2.0 * resident.forward_s


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_deferred_update_runs_adam_after_backward_or_at_the_next_visit(device):
    """A deferred step's updates (one rank) are applied at each unit's next visit
    (runtime/pending.py), on the CPU device and on CUDA alike: the next forward carries them,
    nothing waits for them after backward."""
    cdt = "bf16" if device == "cuda" else "fp32"
    m = analytic_profile(GPT2, micro_batch=1, seq_len=64, compute_dtype=cdt)
    h = hw(device=device, device_flops_per_s={cdt: 100e9}, adam_params_per_s={1: 0.2e9, 2: 0.2e9})
    e = estimate(in_memory(stream(m, deferred_update=True, device=device, compute_dtype=cdt)), h, m)
    plain = estimate(in_memory(stream(m, device=device, compute_dtype=cdt)), h, m)
    adam = sum(u.numel for u in m.units) / 0.2e9
    assert e.optimizer_wait_s < 0.2 * adam
    assert e.forward_s >= plain.forward_s + 0.7 * adam


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_speculative_plan_replays_its_updates_during_backward(device):
    """Clipping with speculation is replayed as a step that validates: the optimizer's time after
    backward is what it is without clipping, not the deferred updates'; the lower bound holds."""
    from offloadpp.planner.cost import lower_bound

    cdt = "bf16" if device == "cuda" else "fp32"
    m = analytic_profile(GPT2, micro_batch=1, seq_len=64, compute_dtype=cdt)
    h = hw(device=device, device_flops_per_s={cdt: 10e9},  # compute-bound: Adam can hide behind backward
           adam_params_per_s={1: 0.2e9, 2: 0.2e9})  # fmt: skip
    q = len(m.units) - 1  # the read-ahead "auto" budgets give deferred updates where it fits
    deferred = stream(m, q=q, device=device, compute_dtype=cdt, deferred_update=True)
    spec = replace(deferred, speculative=True)
    plain = stream(m, device=device, compute_dtype=cdt)
    d, s_, p = (estimate(x, h, m) for x in (deferred, spec, plain))
    adam = sum(u.numel for u in m.units) / 0.2e9
    # every deferred update at the next forward's visits (runtime/pending.py), beside its compute
    assert d.optimizer_wait_s < 0.2 * adam and d.forward_s > p.forward_s
    assert s_.step_s < d.step_s
    assert s_.optimizer_wait_s <= 1.1 * p.optimizer_wait_s + 1e-3
    assert lower_bound(spec, h, m) <= s_.step_s and lower_bound(deferred, h, m) <= d.step_s


def test_lower_bound_counts_the_updates_a_speculative_plan_defers():
    """A speculative plan's units whose state is in memory cannot speculate: their gradients'
    norm is taken as they are absorbed and their updates wait for the end of backward. The lower
    bound counted neither, so the search replayed two dozen such in-memory placements (bound by
    compute) before the streaming one that won by 25% (issue 36's property sweep, profile 1)."""
    from offloadpp.planner.cost import lower_bound

    m = analytic_profile(GPT2, micro_batch=1, seq_len=64, compute_dtype="bf16")
    h = hw(device="cuda", device_flops_per_s={"bf16": 1e15}, memcpy_gbps=0.5, adam_params_per_s={1: 1e9})
    spec = in_memory(stream(m, device="cuda", compute_dtype="bf16", deferred_update=True, speculative=True))
    numel = sum(u.numel for u in m.units)
    absorb_and_norm = numel * 12 / 0.5e9  # fp32 gradients absorbed (8 B) and their norm (4 B)
    bound = lower_bound(spec, h, m)
    assert absorb_and_norm + numel / 1e9 <= bound <= estimate(spec, h, m).step_s


def test_accumulation_counts_micro_batches():
    m = model()
    one = estimate(in_memory(stream(m)), hw(), m)
    two = estimate(in_memory(stream(m, accumulate_grads=True)), hw(), m, micro_batches=2)
    assert two.compute_s == pytest.approx(2 * one.compute_s)
    with pytest.raises(PlanError, match="accumulate_grads"):
        estimate(in_memory(stream(m)), hw(), m, micro_batches=2)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_step_of_several_micro_batches_is_steady_after_two(deferred, monkeypatch):
    """A step of several micro-batches is replayed twice, not three times (planning time, issue
    36): its first step already ends as a steady one does, so the estimate is the three-step one.
    Updates deferred to the next step's visits are not steady after two: those walk three."""
    import offloadpp.planner.cost as cost

    m = analytic_profile(GPT2, micro_batch=1, seq_len=64, compute_dtype="bf16")
    h = hw(device="cuda", device_flops_per_s={"bf16": 50e9}, adam_params_per_s={1: 0.5e9})
    plan = stream(m, device="cuda", compute_dtype="bf16", accumulate_grads=True, deferred_update=deferred)
    assert cost.replay_steps(plan, 4) == (3 if deferred else 2)
    assert (
        cost.replay_steps(plan, 1) == 3 and cost.replay_steps(replace(plan, accumulate_grads=False), 1) == 3
    )
    two = estimate(plan, h, m, micro_batches=4)
    monkeypatch.setattr(cost, "replay_steps", lambda plan, micro_batches: 3)
    assert two.step_s == pytest.approx(estimate(plan, h, m, micro_batches=4).step_s, rel=1e-9)


def test_cuda_plan_moves_weights_over_the_link():
    m = analytic_profile(GPT2, micro_batch=1, seq_len=64, compute_dtype="bf16")
    h = hw(device="cuda", device_flops_per_s={"bf16": 100e12}, h2d_gbps=0.5, d2h_gbps=0.5)
    e = estimate(stream(m, device="cuda", compute_dtype="bf16"), h, m)
    weights = sum(u.padded_numel * 2 for u in m.unit_specs())
    assert weights < e.h2d_bytes < 2 * weights  # all once in forward, the early blocks again in backward
    assert e.d2h_bytes > 0 and e.link_s > 0
    with pytest.raises(PlanError, match="device"):
        estimate(stream(m, device="cuda", compute_dtype="bf16"), hw(), m)


# ---- the replay's bytes against the runtime's -------------------------------------------------------
def _runtime_bytes(shape_kw, plan, steps: int = 4, clip: float = 0.0, micro: int = 1):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import tempfile

    from offloadpp.bench.harness import Contender, GPT2Shape, close_all, make_engines

    shape = GPT2Shape(**shape_kw)
    m, batch = shape.build(), shape.batch()
    torch.set_num_threads(1)
    c = Contender("c", plan)
    with tempfile.TemporaryDirectory() as d:
        make_engines(m, [c], d, ssd_gbps=(2.0, 2.0), gradient_clipping=clip, accumulation=micro)
        e = c.engine
        out = []
        try:
            for _ in range(steps):
                s0 = e.store.stats
                for _ in range(micro):
                    e.backward(e(**batch).loss)
                    e.step()
                e.store.wait_all()  # the report counts completed I/O: count it all, here
                d = e.store.stats - s0
                out.append((d.bytes_read, d.bytes_written))
        finally:
            close_all([c])
    return out


TINY = dict(n_layer=8, n_embd=64, n_head=4, vocab_size=512, micro_batch=1, seq_len=16)


def _tiny_plans():
    h = hw(ssd_read_gbps=0.5, ssd_write_gbps=0.5)
    m = analytic_profile(
        {"model_type": "gpt2", "n_layer": 8, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 128},
        micro_batch=1, seq_len=16,
    )  # fmt: skip
    plans = [
        ("k2q2", stream(m, 2, 2), 0.0, 1),
        ("k0q0", stream(m, 0, 0), 0.0, 1),
        ("k1q3", stream(m, 1, 3), 0.0, 1),
    ]
    s = stream(m, 1, 1)
    from offloadpp.planner import build_schedule

    need = build_schedule(s)
    extra = sum(u.padded_numel for u in m.unit_specs()) * 3  # a quarter of master + moments
    b = Request(
        Budgets(need.peak_device_bytes + extra, need.peak_host_bytes + extra),
        Settings(prefetch_depth=1, optim_prefetch_depth=1),
    )
    partial = search(h, m, b).plan
    assert partial.ssd_bytes() > 0 and any(
        p.master is Tier.HOST or p.moments is Tier.HOST for p in partial.placements
    )
    plans.append(("partial", partial, 0.0, 1))
    plans.append(("clip", stream(m, 2, 1, deferred_update=True), 1.0, 1))
    plans.append(("accum", stream(m, 1, 1, accumulate_grads=True), 0.0, 2))
    return h, m, plans


@pytest.mark.parametrize("which", ["k2q2", "k0q0", "k1q3", "partial", "clip", "accum"])
def test_replay_moves_the_runtimes_bytes(which):
    h, m, plans = _tiny_plans()
    _, plan, clip, micro = next(p for p in plans if p[0] == which)
    got = _runtime_bytes(TINY, plan, clip=clip, micro=micro)
    est, _ = replay(plan, h, m, micro_batches=micro)
    assert got[-1] == got[-2], got  # steady state
    assert (est.ssd_read_bytes, est.ssd_write_bytes) == got[-1]


# ---- one byte accounting: the plan, the estimate and the runtime ------------------------------------
def _homes_ssd(plan) -> dict[str, int]:
    """key -> bytes of every array whose home is SSD (Plan.homes)."""
    return {f"{u.name}.{a}": plan.array_bytes(u, a) for u, p in plan for a, t in plan.homes(u, p).items()
            if t is Tier.SSD}  # fmt: skip


@pytest.mark.parametrize("weights", ["device", "host", "ssd"])
def test_cuda_plan_ssd_bytes_are_what_the_replay_writes(weights):
    """16-bit weights resident on the device (or in host memory) have no SSD copy: the plan says
    0 bytes on SSD for them and the replay writes none; on SSD they are written each step."""
    m = analytic_profile(GPT2, micro_batch=1, seq_len=64, compute_dtype="bf16")
    h = hw(device="cuda", device_flops_per_s={"bf16": 100e12}, h2d_gbps=10.0, d2h_gbps=10.0)
    base = stream(m, device="cuda", compute_dtype="bf16")
    t = Tier(weights)
    plan = replace(base, placements=tuple(replace(p, weights=t, master=Tier.HOST, moments=Tier.HOST)
                                          for p in base.placements))  # fmt: skip
    est, by_key = replay(plan, h, m)
    homes = _homes_ssd(plan)
    assert plan.ssd_bytes() == sum(homes.values())
    assert {k for k, v in by_key.items() if v} == set(homes)  # the replay moves exactly those keys
    assert est.ssd_write_bytes == (plan.ssd_bytes() if weights == "ssd" else 0)
    if weights != "ssd":
        assert plan.ssd_bytes() == 0 and est.ssd_read_bytes == 0


@pytest.mark.parametrize("which", ["k2q2", "partial", "clip"])
def test_plan_estimate_and_runtime_hold_the_same_ssd_bytes(which):
    """What the plan says lives on SSD is what the runtime's store holds (its keys and their
    sizes), and every step writes each of them once, as the replay does."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import tempfile

    from offloadpp.bench.harness import Contender, GPT2Shape, close_all, make_engines

    h, m, plans = _tiny_plans()
    _, plan, clip, micro = next(p for p in plans if p[0] == which)
    shape = GPT2Shape(**TINY)
    model, batch = shape.build(), shape.batch()
    torch.set_num_threads(1)
    c = Contender("c", plan)
    with tempfile.TemporaryDirectory() as d:
        make_engines(model, [c], d, ssd_gbps=(2.0, 2.0), gradient_clipping=clip)
        e = c.engine
        try:
            for _ in range(3):
                e.backward(e(**batch).loss)
                e.step()
            e.store.wait_all()
            # a transactional array has two generations in the store (runtime/slots.py): each
            # the size the plan says; the plan counts one
            held, gens = {}, {}
            for k in e.store.keys():
                base = k.split("@")[0]
                held[base] = e.store.nbytes(k)
                gens.setdefault(base, set()).add(k)
        finally:
            close_all([c])
    assert all(len(g) == (1 if clip else 2) or k.endswith(".grads") for k, g in gens.items())
    homes = _homes_ssd(plan)
    assert {k: homes[k] for k in held} == held  # every key the store holds, at the plan's size
    # and every array the plan puts there, but the gradients a deferred update keeps in memory
    # for its first units (the plan's SSD bytes are "at most")
    assert all(k.endswith(".grads") for k in set(homes) - set(held))
    assert sum(held.values()) <= plan.ssd_bytes() == sum(homes.values())
    est, by_key = replay(plan, h, m, micro_batches=micro)
    written = sum(plan.array_bytes(u, a) for u, p in plan for a, t in plan.homes(u, p).items()
                  if t is Tier.SSD and a != "grads")  # fmt: skip
    grads = sum(v for k, v in homes.items() if k.endswith(".grads"))
    assert written <= est.ssd_write_bytes <= written + grads  # each once (persistent grads: when on SSD)
    assert set(k for k, v in by_key.items() if v) <= set(homes)


def test_a_lower_bound_is_each_plans_and_each_activation_choices_own():
    """cost.lower_bound finds the terms that do not read the activations once per plan (the
    search bounds every activation choice of a placement): another plan, even one equal in its
    units and depths, gets its own terms, and each activation choice of one plan its own bound."""
    import offloadpp.planner.cost as cost
    from offloadpp.planner.cost import lower_bound

    m = model()
    h = hw(ssd_read_gbps=0.5, ssd_write_gbps=0.5)
    streamed, kept = stream(m), in_memory(stream(m))
    names = [u.name for u in m.units]
    recompute = {n: "recompute" for n in names[1:]}
    got = [
        lower_bound(streamed, h, m),
        lower_bound(kept, h, m),
        lower_bound(streamed, h, m, activations=recompute),
    ]
    cost._TERMS.clear()  # (from nothing, in another order)
    fresh = [
        lower_bound(streamed, h, m, activations=recompute),
        lower_bound(kept, h, m),
        lower_bound(streamed, h, m),
    ]
    assert got == fresh[::-1]
    assert got[0] > got[1]  # streaming is bound by its SSD bytes, the in-memory plan is not
    assert lower_bound(kept, h, m, activations=recompute) > got[1]  # (the recompute's forward again)


def test_the_activation_replay_remembers_each_units_parts_for_its_own_policies():
    """simulate_act remembers a unit's parts and sizes for the replay (its policies do not change
    while it runs): each unit gets its own, and another replay with other policies its own."""
    from types import SimpleNamespace

    from offloadpp.planner.activations import ActUnit
    from offloadpp.planner.simulate_act import ActReplay

    sim = SimpleNamespace(sched=SimpleNamespace(visits=()), costs=SimpleNamespace(forward_s={"a": 1.0, "b": 1.0},
                          forward_visit_s=0.5), cuda=True)  # fmt: skip
    pieces = ((100, 10, 30, 0), (200, 20, 60, 0))
    units = {n: ActUnit(n, 300, 10, 1, True, partial=90, pieces=pieces) for n in "ab"}
    saved = {"a": 300, "b": 300}

    def replay(policies):
        return ActReplay(sim, policies, saved, 2, None, units)

    r = replay({"a": "partial_host", "b": "keep"})
    parts = r.forward_parts("a")
    assert parts == ((40 / 120, 40), (80 / 120, 80)) and r.forward_parts("a") is parts
    assert r.forward_parts("b") == ((1.0, 300),) and (r.recompute_s("a"), r.recompute_s("b")) == (0.5, 0.0)
    other = replay({"a": "recompute_host", "b": "partial_host"})
    assert other.forward_parts("a") == ((1.0, 10),) and other.forward_parts("b") == parts
    assert (other.recompute_s("a"), other.recompute_s("b")) == (1.5, 0.5)


def test_the_activation_replays_share_a_units_sizes_only_for_the_same_profile_bytes_and_policy():
    """simulate_memo's shared sizes (its Note): a search's replays find a unit's parts once per
    (unit profile, saved bytes, policy as given); another profile of the same name, other saved
    bytes or another policy (a recompute_pieces one, run as partial) get their own."""
    from types import SimpleNamespace

    from offloadpp.planner.activations import ActUnit
    from offloadpp.planner.simulate_act import ActReplay

    sim = SimpleNamespace(sched=SimpleNamespace(visits=()), costs=SimpleNamespace(forward_s={"a": 1.0},
                          forward_visit_s=0.5), cuda=True)  # fmt: skip
    pieces = ((100, 10, 30, 0), (200, 20, 60, 0))
    units = {"a": ActUnit("a", 300, 10, 1, True, partial=90, pieces=pieces)}
    saved = {"a": 300}
    first = ActReplay(sim, {"a": "partial_host"}, saved, 2, None, units)
    again = ActReplay(sim, {"a": "partial_host"}, saved, 2, None, units)
    assert again.forward_parts("a") is first.forward_parts("a")  # found once
    bigger = {
        "a": ActUnit(
            "a",
            600,
            20,
            1,
            True,
            partial=180,
            pieces=tuple((2 * a, 2 * b, 2 * c, d) for a, b, c, d in pieces),
        )
    }
    assert ActReplay(sim, {"a": "partial_host"}, saved, 2, None, bigger).forward_parts("a") == (
        (40 / 120, 80),
        (80 / 120, 160),
    )
    assert ActReplay(sim, {"a": "host"}, {"a": 300}, 2, None, units)._out_shape("a")[0] == 300
    assert ActReplay(sim, {"a": "host"}, {"a": 500}, 2, None, units)._out_shape("a")[0] == 500
    assert ActReplay(sim, {"a": "keep"}, saved, 2, None, units)._out_shape("a") is None
    pieces_run = ActReplay(sim, {"a": "recompute_pieces_host"}, saved, 2, None, units).forward_parts("a")
    assert pieces_run != first.forward_parts("a")


def test_each_model_profile_gets_its_own_activation_sizes_in_the_replay():
    """cost._model_acts finds a profile's saved bytes and activation units once for every replay
    of a search: another profile of the same units (another sequence length) gets its own."""
    import offloadpp.planner.cost as cost

    short, long = model(seq_len=32), model(seq_len=128)
    assert cost._model_acts(short)[0] != cost._model_acts(long)[0]
    h = hw(ssd_read_gbps=0.5, ssd_write_gbps=0.5)
    plan = stream(short)
    swapped = {u.name: "ssd" for u in short.units}
    got = [estimate(plan, h, m, activations=swapped) for m in (short, long)]
    cost._ACTS.clear()
    assert [estimate(plan, h, m, activations=swapped) for m in (long, short)][::-1] == got
    assert got[0].ssd_write_bytes < got[1].ssd_write_bytes  # (the longer sequence saves more)


def test_the_shared_activation_sizes_are_kept_per_model_and_forgotten_when_planning_from_nothing():
    """simulate_memo's shared sizes (its Note) live with the model's mapping of activation units:
    a model's replays share them whatever other models' replays ran in between (the last
    _SHARED_MAX models' are kept, not one store emptied when full, once in the middle of a point),
    and peaks.clear_cache (a benchmark's point planned from nothing) forgets them."""
    from types import SimpleNamespace

    from offloadpp.planner import simulate_memo
    from offloadpp.planner.activations import ActUnit
    from offloadpp.planner.peaks import clear_cache
    from offloadpp.planner.simulate_act import ActReplay

    sim = SimpleNamespace(sched=SimpleNamespace(visits=()), costs=SimpleNamespace(forward_s={"a": 1.0},
                          forward_visit_s=0.5), cuda=True)  # fmt: skip
    pieces = ((100, 10, 30, 0), (200, 20, 60, 0))
    saved = {"a": 300}

    def model():
        return {"a": ActUnit("a", 300, 10, 1, True, partial=90, pieces=pieces)}

    def parts(units):
        return ActReplay(sim, {"a": "partial_host"}, saved, 2, None, units).forward_parts("a")

    clear_cache()
    first = model()
    found = parts(first)
    others = [model() for _ in range(simulate_memo._SHARED_MAX - 1)]
    assert all(parts(u) is not found for u in others)  # (each model its own)
    assert parts(first) is found
    parts(model())  # one more model: the oldest's go
    assert parts(first) is not found
    found = parts(first)
    clear_cache()
    assert not simulate_memo._SHARED and parts(first) is not found
