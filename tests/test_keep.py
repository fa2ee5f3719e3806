"""planner/keep.py: the one rule for what the memory left after streaming keeps (the default plan
and the search's fills): by SSD bytes saved per step per byte held."""

from __future__ import annotations

from offloadpp.planner import Budgets, Settings, Tier, UnitSpec, default_plan, streaming_plan
from offloadpp.planner.default import plan_shape
from offloadpp.planner.keep import keep, ranked, saved_bytes
from offloadpp.planner.peaks import peak_bytes
from offloadpp.planner.schedule import grads_order

BLOCKS = tuple(UnitSpec(f"h.{i}", 1_000_000) for i in range(12))


def _lazy(units=BLOCKS, q: int = 0):
    """A deferred step applied at the next visit (CPU, one rank, fp32: the weights are the master)."""
    return streaming_plan(units, device="cpu", compute_dtype="fp32", prefetch_depth=1, optim_prefetch_depth=q,
                          deferred_update=True, clipping=True)  # fmt: skip


def test_bytes_saved_per_byte_held_with_updates_at_the_next_visit():
    """A master is read by backward and by the next forward (which its pending update shares) and
    written once: 3 bytes a step per byte held (2 where the schedule keeps the unit across a turn);
    moments read and written: 2; gradients written and read back: 2, 0 in the optimizer's window."""
    plan = _lazy()
    saved = saved_bytes(plan)
    u = BLOCKS[5]  # a middle unit: fetched once in forward and once in backward
    assert saved[f"{u.name}.master"] == 3 * u.master_bytes
    assert saved[f"{u.name}.exp_avg"] + saved[f"{u.name}.exp_avg_sq"] == 2 * u.moments_bytes
    assert saved[f"{u.name}.grads"] == 2 * plan.grad_bytes(u)
    window = grads_order(plan)[-(plan.optim_prefetch_depth + 1) :]
    assert all(saved[f"{n}.grads"] == 0 for n in window)
    assert all(saved[f"{v.name}.master"] in (2 * v.master_bytes, 3 * v.master_bytes) for v in BLOCKS)


def test_ranked_masters_first_then_gradients_in_the_order_pending_updates_read_them_then_moments():
    plan = _lazy()
    rows = ranked(plan)
    values = [v for v, _ in rows]
    assert values == sorted(values, reverse=True)
    kinds = [alts[0][1] for _, alts in rows if _ > 0]
    first_grads, first_moments = kinds.index("grads@host"), kinds.index("moments@host")
    assert set(kinds[:first_grads]) == {"master@device"}  # (the host as the alternative: below)
    assert first_grads < first_moments and set(kinds[first_grads:first_moments]) == {"grads@host"}
    master = next(alts for _, alts in rows if alts[0][1] == "master@device")
    assert [w for _, w in master] == ["master@device", "master@host"]
    grads = [alts[0][0] for v, alts in rows if alts[0][1] == "grads@host" and v > 0]
    assert grads == [n for n in grads_order(plan) if n in grads]


def test_the_default_plan_spends_room_where_it_saves_the_most_bytes_and_says_so():
    """With room for about half the masters beyond the streaming minimum, the default plan keeps
    masters (3 B saved per B), no moments or gradients (2), stays within the budgets, and its
    notes say which arrays and why."""
    settings = Settings(gradient_clipping=1.0, prefetch_depth=1, optim_prefetch_depth=0)
    plan = streaming_plan(
        BLOCKS, device="cpu", prefetch_depth=1, optim_prefetch_depth=0, **plan_shape(settings)
    )
    dev, host = peak_bytes(plan)
    room = 6 * BLOCKS[0].master_bytes
    got = default_plan(BLOCKS, device="cpu", budgets=Budgets(dev, host + room), settings=settings)
    kept = [p for p in got.placements if p.master is Tier.HOST]
    assert 4 <= len(kept) <= 6
    assert all(p.moments is Tier.SSD and p.grads is Tier.SSD for p in got.placements)
    d, h = peak_bytes(got)
    assert d <= dev and h <= host + room
    note = next(n for n in got.notes if n.startswith("memory left after streaming keeps"))
    assert f"master of {len(kept)} unit(s)" in note and "B saved per B" in note
    assert any(n.startswith("gradients") for n in got.notes)  # and where the gradients went


def test_more_room_after_the_masters_goes_to_gradients_before_moments():
    plan = _lazy()
    dev, host = peak_bytes(plan)
    masters = sum(u.master_bytes for u in BLOCKS)
    got = keep(plan, dev, host + masters + 4 * plan.grad_bytes(BLOCKS[0]), additive=True)
    assert all(p.master is Tier.HOST for p in got.placements)
    on_host = [p.unit for p in got.placements if p.grads is Tier.HOST]
    assert on_host and all(p.moments is Tier.SSD for p in got.placements)
    assert on_host == sorted(on_host, key=grads_order(plan).index)[: len(on_host)]
    assert set(on_host) <= set(grads_order(plan)[: len(on_host) + 1])


def test_the_streaming_minimum_streams_in_the_default_plan_but_not_in_the_search():
    """additive: a plan at its own peaks keeps nothing more (the state on SSD, as the settings
    asked); without it, arrays that raise no peak are kept (the search weighs them)."""
    units = (UnitSpec("embed", 25_800_000, backward_needs_weights=False), *BLOCKS[:6])
    plan = _lazy(units)
    dev, host = peak_bytes(plan)
    assert keep(plan, dev, host, additive=True).placements == plan.placements
    free = keep(plan, dev, host)
    assert free.ssd_bytes() < plan.ssd_bytes()
    d, h = peak_bytes(free)
    assert d <= dev and h <= host
