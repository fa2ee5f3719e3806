"""offloadpp.planner: Plan types, the schedule a plan implies, the default placement policy.

Pure Python: none of this imports torch (checked in a subprocess).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from offloadpp.planner import (
    Budgets,
    Placement,
    Plan,
    PlanError,
    Settings,
    Tier,
    UnitSpec,
    all_on_ssd,
    build_schedule,
    default_plan,
    flat_numel,
    min_budgets,
    streaming_plan,
)

# A GPT-2-like split: tied embeddings (read again by the head), six blocks, the head.
UNITS = (
    [UnitSpec("embed", 25_800_000, backward_needs_weights=False)]
    + [UnitSpec(f"h.{i}", 3_150_000) for i in range(6)]
    + [UnitSpec("head", 1024, borrows=("embed",))]
)


def dplan(units, device_budget_bytes, host_budget_bytes, device="cpu", **settings):
    """The default plan of `units` for these budgets and settings."""
    return default_plan(
        units,
        device=device,
        settings=Settings(**settings),
        budgets=Budgets(device_budget_bytes, host_budget_bytes),
    )


def test_planner_imports_no_torch():
    code = "import sys, offloadpp.planner; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_flat_numel_pads_to_whole_blocks():
    assert flat_numel(1) == 2048
    assert flat_numel(2048) == 2048
    assert flat_numel(2049) == 4096
    assert UnitSpec("u", 10).master_bytes == 2048 * 4


def test_schedule_visits_and_windows():
    plan = replace(
        streaming_plan(UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=2), fill_gaps=False
    )
    s = build_schedule(plan)
    names = [(v.unit, v.backward) for v in s.visits]
    assert names[:8] == [(u.name, False) for u in UNITS]
    assert names[8:] == [(u.name, True) for u in reversed(UNITS)]
    assert s.visits[7].needs == ("head", "embed")  # the tied head reads the embeddings
    assert s.visits[-1].needs == ()  # embedding backward reads no weights
    assert s.alive[0] == {"embed", "h.0", "h.1"}  # k=2: two visits ahead
    assert s.alive[6] == {"h.5", "head", "embed"}  # the last blocks stay into backward
    assert s.update_order == ("head", "h.5", "h.4", "h.3", "h.2", "h.1", "h.0", "embed")
    assert s.window_at(0) == ("head", "h.5", "h.4")
    assert s.window_at(3) == ("h.4", "h.3", "h.2", "h.1")  # one updating, q=2 read ahead, one more
    assert s.next_keep == {"embed", "h.0", "h.1", "h.2"}  # what the next forward's first visits hold
    assert s.keep_until_update == {"embed"}  # read by the tied head first in backward


def test_gaps_are_filled_without_raising_the_peak():
    strict = replace(
        streaming_plan(UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=2), fill_gaps=False
    )
    s0, s1 = build_schedule(strict), build_schedule(replace(strict, fill_gaps=True))
    assert (s1.peak_device_bytes, s1.peak_host_bytes) == (s0.peak_device_bytes, s0.peak_host_bytes)
    assert all(a0 <= a1 for a0, a1 in zip(s0.alive, s1.alive))
    # the embeddings stay from the first visit to the tied head instead of being read twice
    assert all("embed" in s1.alive[i] for i in range(0, 9))


@pytest.mark.parametrize("deferred", [False, True])
def test_updated_weights_are_kept_for_the_next_forward_without_raising_the_peak(deferred, monkeypatch):
    import offloadpp.planner.schedule as sched_mod

    plan = streaming_plan(UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=2, optim_prefetch_depth=8,
                          deferred_update=deferred)  # fmt: skip
    s1 = build_schedule(plan)
    with monkeypatch.context() as m:
        m.setattr(sched_mod, "_keep_across", lambda plan, sched: sched)
        s0 = build_schedule(plan)
    assert (s1.peak_device_bytes, s1.peak_host_bytes) == (s0.peak_device_bytes, s0.peak_host_bytes)
    assert s0.next_keep <= s1.next_keep
    assert s0.next_keep == {"embed", "h.0", "h.1", "h.2"}  # the first two visits' units
    if deferred:  # every master is held through the updates anyway: all stay (no reads at forward)
        assert s1.next_keep == {u.name for u in UNITS}
    # each kept unit's hold ends at the first visit that holds it
    assert all(
        n in s1.alive[t] and all(n not in a for a in s1.alive[:t]) for n, t in s1.next_keep_until.items()
    )
    # only on the CPU device with fp32 compute (where the weights are the master)
    bf16 = streaming_plan(UNITS, device="cpu", compute_dtype="bf16", prefetch_depth=2, optim_prefetch_depth=8,
                          deferred_update=deferred)  # fmt: skip
    assert build_schedule(bf16).next_keep == {"embed", "h.0", "h.1", "h.2"}


@pytest.mark.parametrize("q", [8, 1])
def test_a_speculative_plan_keeps_for_each_way_of_running_a_step(q):
    """A speculative plan's deferred steps keep at least what a deferred plan's do (speculation
    costs them no reads); its speculating steps keep a set of their own, checked on their walk."""
    kw = dict(
        device="cpu", compute_dtype="fp32", prefetch_depth=2, optim_prefetch_depth=q, deferred_update=True
    )
    deferred = build_schedule(streaming_plan(UNITS, **kw))
    spec = build_schedule(streaming_plan(UNITS, speculative=True, clipping=True, **kw))
    assert deferred.spec_next_keep == frozenset() and spec.next_keep >= deferred.next_keep
    assert {"embed", "h.0", "h.1", "h.2"} <= spec.spec_next_keep
    assert set(spec.next_keep_until) == spec.next_keep | spec.spec_next_keep
    assert (
        spec.peak_device_bytes >= deferred.peak_device_bytes
        and spec.peak_host_bytes >= deferred.peak_host_bytes
    )


def test_min_budgets_grow_with_prefetch_depth():
    kw = dict(device="cpu", compute_dtype="fp32")
    d0, h0 = min_budgets(UNITS, prefetch_depth=0, optim_prefetch_depth=0, **kw)
    d2, h2 = min_budgets(UNITS, prefetch_depth=2, optim_prefetch_depth=2, **kw)
    assert 0 < d0 <= d2 and 0 < h0 <= h2
    # at least the largest unit's weights and grads
    assert d0 >= UNITS[0].weights_bytes("fp32") + UNITS[0].grad_bytes


def test_default_plan_streams_everything_at_the_minimum():
    dev, host = min_budgets(UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=2)
    plan = dplan(UNITS, dev, host)
    assert plan.prefetch_depth == 2 and plan.optim_prefetch_depth == 2
    assert all(p == Placement(u.name, Tier.SSD, Tier.SSD, Tier.SSD, Tier.SSD) for u, p in plan)
    assert plan.ssd_bytes() == sum(u.master_bytes + u.moments_bytes for u in UNITS)
    assert "embed" in plan.describe()


def test_default_plan_keeps_what_fits():
    plan = dplan(UNITS, 10**10, 10**10)
    assert all(
        p.weights is Tier.DEVICE and p.master is Tier.HOST and p.moments is Tier.HOST for p in plan.placements
    )
    assert plan.ssd_bytes() == 0


def test_default_plan_backs_off_prefetch_depth_then_fails_clearly():
    blocks = [UnitSpec(f"h.{i}", 3_150_000) for i in range(6)]
    d1, _ = min_budgets(blocks, device="cpu", compute_dtype="fp32", prefetch_depth=1)
    d2, _ = min_budgets(blocks, device="cpu", compute_dtype="fp32", prefetch_depth=2)
    assert d1 < d2
    plan = dplan(blocks, d1, 10**10, optim_prefetch_depth=2)
    assert plan.prefetch_depth == 1
    with pytest.raises(PlanError, match=r"device budget of .* too small.*'embed'.*25,800,000 parameters"):
        dplan(UNITS, 1 << 20, 10**10)
    with pytest.raises(
        PlanError, match=r"host budget of .* too small.*Raise the host budget to at least \d+ bytes"
    ):
        dplan(UNITS, 10**10, 1 << 20)


def test_persistent_grads_go_to_ssd_when_host_is_short():
    dev, host = min_budgets(
        UNITS, prefetch_depth=2, device="cpu", compute_dtype="fp32", accumulate_grads=True
    )
    plan = dplan(UNITS, dev, host, gradient_accumulation_steps=2)
    assert plan.persistent_grads and all(p.grads is Tier.SSD for p in plan.placements)
    assert plan.notes and "gradients" in plan.notes[0]
    roomy = dplan(UNITS, dev, 10**10, gradient_accumulation_steps=2)
    assert all(p.grads is Tier.HOST for p in roomy.placements)


def test_sixteen_bit_compute_keeps_a_separate_weights_copy():
    plan = streaming_plan(UNITS, device="cuda", compute_dtype="bf16", prefetch_depth=2)
    assert plan.separate_weights
    assert plan.ssd_bytes() == sum(u.master_bytes + u.moments_bytes + u.weights_bytes("bf16") for u in UNITS)


@pytest.mark.parametrize(
    "placement, match",
    [
        (Placement("u", Tier.SSD, Tier.HOST, Tier.SSD), "weights are the master copy"),
        (Placement("u", Tier.DEVICE, Tier.SSD, Tier.SSD), "master must be 'host'"),
        (Placement("u", Tier.SSD, Tier.DEVICE, Tier.SSD), "cannot live on the device"),
    ],
)
def test_plan_rejects_inconsistent_tiers(placement, match):
    with pytest.raises(PlanError, match=match):
        Plan(
            (UnitSpec("u", 10),),
            (placement,),
            device="cpu",
            compute_dtype="fp32",
            prefetch_depth=1,
            optim_prefetch_depth=0,
        )


def test_plan_rejects_bad_shapes():
    u = (UnitSpec("a", 1), UnitSpec("b", 1, borrows=("zz",)))
    with pytest.raises(PlanError, match="borrows unknown unit 'zz'"):
        Plan(u, all_on_ssd(u), device="cpu", compute_dtype="fp32", prefetch_depth=1, optim_prefetch_depth=0)
    with pytest.raises(PlanError, match="same order"):
        Plan(
            u[:1], all_on_ssd(u), device="cpu", compute_dtype="fp32", prefetch_depth=1, optim_prefetch_depth=0
        )
    with pytest.raises(PlanError, match="compute_dtype"):
        Plan(
            u[:1],
            all_on_ssd(u[:1]),
            device="cpu",
            compute_dtype="fp8",
            prefetch_depth=1,
            optim_prefetch_depth=0,
        )


def test_a_vertical_window_needs_accumulation_and_one_policy_per_unit_and_survives_a_plan_file():
    from offloadpp.planner.planfile import plan_from_dict, plan_to_dict

    u = (UnitSpec("a", 4096), UnitSpec("b", 4096))
    kw = dict(device="cpu", compute_dtype="fp32", prefetch_depth=1, optim_prefetch_depth=0)
    with pytest.raises(PlanError, match="micro_batches > 1"):
        Plan(u, all_on_ssd(u), vertical=True, accumulate_grads=True, **kw)
    with pytest.raises(PlanError, match="needs accumulate_grads"):
        Plan(u, all_on_ssd(u), vertical=True, micro_batches=4, **kw)
    with pytest.raises(PlanError, match="one policy per unit"):
        Plan(u, all_on_ssd(u), vertical=True, micro_batches=4, accumulate_grads=True,
             vertical_activations=("keep",), **kw)  # fmt: skip
    plan = Plan(u, all_on_ssd(u), vertical=True, micro_batches=4, accumulate_grads=True,
                vertical_activations=("recompute", "keep"), window_s=(("horizontal", 2.0), ("vertical", 1.0)), **kw)  # fmt: skip
    back = plan_from_dict(plan_to_dict(plan))[0]
    assert (back.vertical, back.micro_batches, back.vertical_activations) == (True, 4, ("recompute", "keep"))
    assert back.window_s == (("horizontal", 2.0), ("vertical", 1.0))


def test_deferred_updates_run_largest_first():
    plan = streaming_plan(UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=2, deferred_update=True)
    s = build_schedule(plan)
    assert s.absorb_order == ("head", "h.5", "h.4", "h.3", "h.2", "h.1", "h.0", "embed")
    assert s.update_order[0] == "embed" and set(s.update_order) == set(s.absorb_order)
    assert s.keep_until_update == frozenset()  # updates come after backward: nothing to keep for them


def test_peak_bytes_equal_the_built_schedules_over_random_placements():
    """planner.peaks prices a placement over the schedule's holds found once per shape; it must
    give build_schedule's peaks exactly (the planner's _fits relies on it)."""
    import itertools
    import random

    from offloadpp.planner import Placement, PlanError, Tier, streaming_plan
    from offloadpp.planner.peaks import peak_bytes
    from offloadpp.planner.plan import shard_units

    units = (UnitSpec("embed", 50_000, backward_needs_weights=False), *(UnitSpec(f"h.{i}", 20_000) for i in range(5)),
             UnitSpec("head", 1024, borrows=("embed",)))  # fmt: skip
    rng = random.Random(0)
    tiers = (Tier.DEVICE, Tier.HOST, Tier.SSD)
    checked = 0
    for device, dtype, k, q, accum, mode, ranks in itertools.product(
        ("cpu", "cuda"),
        ("fp32", "bf16"),
        (0, 1, 3),
        (0, 2, 6),
        (False, True),
        ("in-backward", "deferred", "speculative", "speculative-clipping"),
        (1, 3),
    ):
        if ranks > 1 and mode.startswith("speculative"):
            continue  # several ranks never speculate (planner/resolve.py)
        deferred = mode != "in-backward"
        base = streaming_plan(shard_units(units, ranks), device=device, compute_dtype=dtype, prefetch_depth=k,
                              optim_prefetch_depth=q, accumulate_grads=accum, deferred_update=deferred,
                              speculative=mode.startswith("speculative"), clipping=mode.endswith("clipping"))  # fmt: skip
        for _ in range(8):
            placements = tuple(Placement(u.name, rng.choice(tiers), rng.choice(tiers[1:]), rng.choice(tiers[1:]),
                                         rng.choice(tiers[1:])) for u in units)  # fmt: skip
            try:
                plan = replace(base, placements=placements)
            except PlanError:
                continue
            s = build_schedule(plan)
            assert peak_bytes(plan) == (s.peak_device_bytes, s.peak_host_bytes), (
                device,
                dtype,
                k,
                q,
                accum,
                mode,
                ranks,
            )
            checked += 1
    assert checked > 600


def test_persistent_grads_fill_the_host_unit_by_unit_in_the_order_updates_read_them():
    """Where not every unit's gradients fit the host budget, those of the units the pending updates
    read first get a home there and the rest go to SSD, rather than all to SSD: forward order past
    the optimizer's window (q+1 units, which holds theirs anyway: nothing to save there)."""
    from offloadpp.planner.keep import keep
    from offloadpp.planner.peaks import peak_bytes
    from offloadpp.planner.schedule import grads_order

    units = [UNITS[0]] + [UnitSpec(f"h.{i}", 3_150_000) for i in range(24)] + [UNITS[-1]]
    plan = streaming_plan(units, device="cpu", compute_dtype="fp32", prefetch_depth=2, optim_prefetch_depth=1,
                          deferred_update=True, clipping=True)  # fmt: skip
    assert grads_order(plan)[:2] == ["h.1", "h.2"] and grads_order(plan)[-2:] == ["embed", "h.0"]
    dev, host = peak_bytes(plan)
    budget = host + 3 * units[1].grad_bytes
    got = keep(plan, dev, budget, ("grads@host",))
    assert [p.unit for p in got.placements if p.grads is Tier.HOST][:3] == ["h.1", "h.2", "h.3"]
    assert all(p.grads is Tier.SSD for p in got.placements[5:])
    assert peak_bytes(got)[1] <= budget
    roomy = keep(plan, dev, 1 << 40, ("grads@host",))
    assert all(p.grads is Tier.HOST for p in roomy.placements)


@pytest.mark.parametrize(
    "dtype, accumulate, want",
    [("fp32", False, "fp32"), ("bf16", False, "bf16"), ("fp16", False, "fp16"), ("bf16", True, "fp32")],
)
def test_sixteen_bit_compute_keeps_sixteen_bit_gradients(dtype, accumulate, want):
    """bf16/fp16 compute: the gradients kept for a deferred update are the compute dtype's (the
    update upcasts them exactly): half the bytes at their home and through the SSD; accumulation
    keeps an fp32 sum."""
    plan = streaming_plan(UNITS, device="cpu", compute_dtype=dtype, prefetch_depth=2, deferred_update=True,
                          clipping=True, accumulate_grads=accumulate)  # fmt: skip
    assert plan.grad_dtype == want
    size = 4 if want == "fp32" else 2
    assert all(plan.grad_bytes(u) == u.padded_numel * size for u in UNITS)
    grads = sum(plan.array_bytes(u, "grads") for u, p in plan if plan.homes(u, p)["grads"] is Tier.SSD)
    assert grads == sum(u.padded_numel for u in UNITS) * size
    over_ranks = replace(plan, units=tuple(replace(u, shards=2) for u in plan.units))
    assert over_ranks.grad_dtype == "fp32"  # reduced over the ranks into fp32 shards


def test_a_16bit_frozen_segment_stays_16bit_under_fp32_compute():
    """UnitSpec.frozen_dtype (the model's 16-bit dtype of its frozen parameters): stored in it
    under fp32 compute, upcast at each fetch (the device holds both: weights_bytes), and in the
    compute dtype under 16-bit compute; a plan file keeps it."""
    from offloadpp.planner.planfile import plan_from_dict, plan_to_dict

    u = UnitSpec("h.0", 1000, frozen_numel=100_000, frozen_dtype="bf16")
    f = flat_numel(100_000)
    assert u.frozen_dtype_under("fp32") == "bf16" and u.frozen_bytes("fp32") == 2 * f
    assert u.weights_bytes("fp32") == flat_numel(1000) * 4 + 2 * f + 4 * f
    assert u.frozen_dtype_under("fp16") == "fp16" and u.weights_bytes("fp16") == flat_numel(1000) * 2 + 2 * f
    plain = UnitSpec("h.0", 1000, frozen_numel=100_000)
    assert plain.frozen_bytes("fp32") == 4 * f and plain.weights_bytes("fp32") == flat_numel(1000) * 4 + 4 * f
    with pytest.raises(PlanError, match="frozen_dtype"):
        UnitSpec("h.0", 1000, frozen_numel=10, frozen_dtype="fp32")
    plan = streaming_plan((u,), device="cpu", prefetch_depth=0, optim_prefetch_depth=0, compute_dtype="fp32")
    assert plan.frozen_ssd_bytes() == 2 * f
    assert plan_from_dict(plan_to_dict(plan))[0].units == (u,)


def test_with_placements_makes_the_plan_replace_makes():
    """Plan.with_placements (the search's fills, which skip the plan's checks) gives the plan
    dataclasses.replace gives: equal, same repr, its own placements."""
    base = streaming_plan(
        UNITS, device="cuda", compute_dtype="bf16", prefetch_depth=1, optim_prefetch_depth=2
    )
    placements = tuple(replace(p, moments=Tier.HOST) if i % 2 else p for i, p in enumerate(base.placements))
    fast, checked = base.with_placements(placements), replace(base, placements=placements)
    assert fast == checked and repr(fast) == repr(checked)
    assert fast.placements is placements and base.placements is not placements
    assert fast.resident_host_bytes() == checked.resident_host_bytes() > base.resident_host_bytes()


def test_peaks_tell_apart_placements_made_anew_that_differ_in_one_tier():
    """planner.peaks remembers a unit's terms by the placement's tiers, not the placement object (a
    fill makes equal placements anew): a placement made anew with one tier changed is priced as
    itself, and one made anew equal to an earlier one as that one."""
    from offloadpp.planner.peaks import clear_cache, peak_bytes

    clear_cache()
    base = streaming_plan(
        UNITS, device="cuda", compute_dtype="bf16", prefetch_depth=1, optim_prefetch_depth=1
    )
    seen = []
    for moments in (Tier.SSD, Tier.HOST, Tier.SSD):
        for grads in (Tier.SSD, Tier.HOST):
            # (every placement a new object, equal to an earlier one where the tiers are)
            placements = tuple(Placement(p.unit, p.weights, p.master, moments if p.unit == "h.2" else p.moments,
                                         grads if p.unit == "h.2" else p.grads) for p in base.placements)  # fmt: skip
            plan = replace(base, placements=placements)
            s = build_schedule(plan)
            assert peak_bytes(plan) == (s.peak_device_bytes, s.peak_host_bytes)
            seen.append(peak_bytes(plan))
    assert len(set(seen)) == 2 and seen[:2] == seen[4:]  # (grads' home is no peak here: no accumulation)
    assert seen[0] != seen[2]


def test_a_schedule_remembered_by_the_plan_is_built_again_for_a_derived_property_changed(monkeypatch):
    """schedule.cached_schedule finds a plan's schedule by its identity first; a derived property
    patched (as tests do) is in that key too, so the plan gets the schedule built with it."""
    from offloadpp.planner.schedule import cached_schedule, clear_schedules

    clear_schedules()
    plan = streaming_plan(
        UNITS, device="cuda", compute_dtype="bf16", prefetch_depth=1, optim_prefetch_depth=1
    )
    first = cached_schedule(plan)
    assert cached_schedule(plan) is first
    monkeypatch.setattr(Plan, "grad_dtype", property(lambda self: "fp32"))
    patched = cached_schedule(plan)
    assert patched is not first and patched == build_schedule(plan)
    assert patched.peak_host_bytes != first.peak_host_bytes


def test_the_kept_units_are_released_in_forward_order_whatever_the_sets_order():
    """schedule._first_alive: the replay and the runtime release the kept units in the order of
    next_keep_until (simulate.py, executor.py); built from a frozenset, whose order follows the
    hash seed, it is put in forward order, so a replay does not depend on the seed."""
    from offloadpp.planner.schedule import _first_alive

    plan = streaming_plan(UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=2, optim_prefetch_depth=8,
                          deferred_update=True)  # fmt: skip
    s = build_schedule(plan)
    names = sorted(s.next_keep)
    assert len(names) > 2
    fwd = s.forward_index
    for order in (names, names[::-1], frozenset(names)):
        got = _first_alive(s, order)
        assert list(got) == sorted(names, key=fwd.get)
    assert list(s.next_keep_until) == sorted(s.next_keep_until, key=fwd.get)
