"""The planner and cost model over data-parallel ranks (planner/ranks.py, UnitSpec.shards):
each rank's shards, its share of the node, and its collectives."""

from __future__ import annotations

import os

import pytest

from offloadpp.planner import Machine, PlanError, Settings, UnitSpec, resolve
from offloadpp.planner.cost import estimate, lower_bound
from offloadpp.planner.hardware import HardwareProfile
from offloadpp.planner.model_profile import analytic_profile
from offloadpp.planner.plan import ALIGN_NUMEL, shard_units
from offloadpp.planner.ranks import RankLink, rank_share

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "paper")
GPT2 = {
    "model_type": "gpt2",
    "n_layer": 4,
    "n_embd": 256,
    "n_head": 4,
    "n_positions": 128,
    "vocab_size": 1000,
}


def _hw(**over) -> HardwareProfile:
    d = dict(device="cuda", device_name="test", cpu_cores=16, ssd_read_gbps=4.0, ssd_write_gbps=3.0, h2d_gbps=20.0,
             d2h_gbps=20.0, memcpy_gbps=10.0, device_flops_per_s={"fp32": 20e12, "bf16": 80e12},
             adam_params_per_s={1: 0.3e9, 8: 1.6e9, 16: 2.0e9}, host_memory_bytes=64 << 30,
             device_memory_bytes=16 << 30, collective_gbps=8.0)  # fmt: skip
    d.update(over)
    return HardwareProfile(**d)


def _profile(dtype="bf16"):
    return analytic_profile(GPT2, micro_batch=4, seq_len=128, compute_dtype=dtype, name="gpt2-small")


def test_a_shard_is_an_aligned_nth_of_the_unit():
    u = UnitSpec("h.0", 1_000_003)
    two = shard_units([u], 2)[0]
    assert two.shard_numel % ALIGN_NUMEL == 0 and two.shard_numel >= 1_000_003 / 2
    assert two.padded_numel == 2 * two.shard_numel >= u.numel
    assert two.master_bytes == two.shard_numel * 4 < 0.51 * u.master_bytes
    assert two.moments_bytes == two.shard_numel * 8
    assert two.weights_bytes("bf16") == two.padded_numel * 2  # the device computes with the whole unit
    assert two.weights_home_bytes("bf16") == two.shard_numel * 2
    assert two.grad_bytes == two.padded_numel * 4 and two.shard_grad_bytes == two.shard_numel * 4
    assert shard_units([u], 1)[0] == u
    with pytest.raises(PlanError, match="shards"):
        UnitSpec("x", 10, shards=0)


def test_each_rank_plans_for_its_share_of_the_node():
    prof = _profile()
    units = prof.unit_specs()
    s = Settings(compute_dtype="bf16")
    node = Machine(device="cuda", host_available_bytes=64 << 30, device_free_bytes=16 << 30, cores=16)
    one = resolve(s, units, node)
    two = resolve(s, units, Machine(**{**node.__dict__, "ranks": 2, "local_ranks": 2}))
    assert one.plan.ranks == 1 and two.plan.ranks == 2
    assert all(u.shards == 2 for u in two.plan.units)
    # the state on SSD: each rank keeps about half of one process's
    assert 0.45 * one.plan.ssd_bytes() <= two.plan.ssd_bytes() <= 0.55 * one.plan.ssd_bytes()
    # each rank's Adam threads: its share of the node's cores
    assert one.settings.adam_threads == 16 and two.settings.adam_threads == 8
    assert (
        Machine(**{**node.__dict__, "ranks": 4, "local_ranks": 2}).rank_share().host_available_bytes
        == 32 << 30
    )
    with pytest.raises(PlanError, match="local_ranks"):
        Machine(device="cpu", host_available_bytes=1 << 30, ranks=2, local_ranks=3)


def test_a_rank_gets_its_share_of_the_nodes_ssds_memory_bandwidth_and_cores():
    hw = _hw()
    r = rank_share(hw, 2)
    assert (r.ssd_read_gbps, r.ssd_write_gbps, r.memcpy_gbps, r.cpu_cores) == (2.0, 1.5, 5.0, 8)
    assert r.adam_rate(8) == pytest.approx(hw.adam_rate(16) / 2)  # Adam is bound by memory: shared
    assert r.h2d_gbps == hw.h2d_gbps and r.device_flops_per_s == hw.device_flops_per_s  # a GPU each
    cpu = rank_share(_hw(device="cpu"), 2)
    assert cpu.device_flops_per_s["fp32"] == 10e12  # the CPU acting as the device: its cores are shared
    assert rank_share(hw, 1) is hw


def test_the_link_between_ranks_and_nodes():
    assert RankLink(local=4, collective_gbps=10.0).bus_gbps() == 10.0
    assert RankLink(local=4, nodes=2, collective_gbps=10.0, network_gbps=3.0).bus_gbps() == 3.0
    assert RankLink(local=4, collective_gbps=10.0).ring_bytes(1000) == 750
    with pytest.raises(PlanError, match="network_gbps"):
        RankLink(local=2, nodes=2, collective_gbps=10.0).bus_gbps()
    with pytest.raises(PlanError, match="collective_gbps"):
        RankLink(local=2).bus_gbps()


def _dp_plan(ranks: int, local: int, dtype="bf16", **settings):
    prof = _profile(dtype)
    node = Machine(device="cuda", host_available_bytes=64 << 30, device_free_bytes=16 << 30, cores=16,
                   ranks=ranks, local_ranks=local)  # fmt: skip
    r = resolve(Settings(compute_dtype=dtype, **settings), prof.unit_specs(), node)
    return r.plan, prof, r.settings


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_the_estimate_counts_the_collectives_and_the_shared_node(clip):
    hw = _hw()
    plan1, prof, s1 = _dp_plan(1, 1, gradient_clipping=clip)
    plan2, _, s2 = _dp_plan(2, 2, gradient_clipping=clip)
    e1 = estimate(plan1, hw, prof, adam_threads=s1.adam_threads)
    with pytest.raises(PlanError, match="link"):
        estimate(plan2, hw, prof, adam_threads=s2.adam_threads)
    link = RankLink(local=2, collective_gbps=hw.collective_gbps)
    e2 = estimate(plan2, hw, prof, adam_threads=s2.adam_threads, link=link)
    # every unit's gradients reduced once, every unit's weights gathered at least once a step
    reduce = sum(link.ring_bytes(u.grad_bytes) for u in plan2.units)
    gather = sum(link.ring_bytes(u.weights_bytes("bf16")) for u in plan2.units)
    assert e2.comm_bytes >= reduce + gather
    assert e2.comm_s == pytest.approx(e2.comm_bytes / (hw.collective_gbps * 1e9))
    # each rank moves about half the state over half the SSD: the same SSD time
    assert 0.4 * (e1.ssd_read_bytes + e1.ssd_write_bytes) <= e2.ssd_read_bytes + e2.ssd_write_bytes
    assert e2.ssd_read_bytes + e2.ssd_write_bytes <= 0.6 * (e1.ssd_read_bytes + e1.ssd_write_bytes)
    assert e2.compute_s == pytest.approx(e1.compute_s)  # a GPU each, the same micro-batch
    assert lower_bound(plan2, hw, prof, adam_threads=s2.adam_threads, link=link) <= e2.step_s * 1.0001
    # a slower link: never a faster step
    slow = estimate(
        plan2, hw, prof, adam_threads=s2.adam_threads, link=RankLink(local=2, collective_gbps=0.5)
    )
    assert slow.step_s >= e2.step_s and slow.comm_s > e2.comm_s


def test_two_nodes_go_at_the_networks_speed():
    hw = _hw()
    plan, prof, s = _dp_plan(4, 2)
    fast = estimate(plan, hw, prof, adam_threads=s.adam_threads, link=RankLink(local=2, nodes=2, collective_gbps=8.0,
                                                                                 network_gbps=8.0))  # fmt: skip
    slow = estimate(plan, hw, prof, adam_threads=s.adam_threads, link=RankLink(local=2, nodes=2, collective_gbps=8.0,
                                                                                 network_gbps=1.0))  # fmt: skip
    assert slow.comm_s == pytest.approx(8 * fast.comm_s, rel=1e-6)
    with pytest.raises(PlanError, match="describes"):
        estimate(plan, hw, prof, adam_threads=s.adam_threads, link=RankLink(local=2, collective_gbps=8.0))


def test_plan_auto_over_ranks_on_the_paper_machine():
    """The cost-model planner for 2 GPUs of a machine like the paper's (docs/performance.md has
    the 13B figures): it picks a plan over shards, within each rank's share."""
    from dataclasses import replace

    from offloadpp.planner.resolve import machine_for

    hw = HardwareProfile.from_json(os.path.join(DOCS, "rtx4090-12ssd.hardware.json"))
    prof = analytic_profile(GPT2, micro_batch=4, seq_len=128, compute_dtype="bf16", name="gpt2-small")
    m = replace(machine_for(hw), ranks=2, local_ranks=2)
    s = Settings(compute_dtype="bf16", plan="auto", collective_gbps=10.0)
    r = resolve(s, prof.unit_specs(), m, hardware=hw, model=prof)
    assert r.plan.ranks == 2 and r.estimate is not None and r.estimate.comm_bytes > 0
    assert r.plan.budgets.host_bytes <= hw.host_memory_bytes // 2


def test_several_ranks_defer_instead_of_speculating():
    """Speculative updates are one process's: over ranks "auto" defers and "on" is refused."""
    prof = _profile()
    units = prof.unit_specs()
    node = Machine(device="cuda", host_available_bytes=64 << 30, device_free_bytes=16 << 30, cores=16)
    two = Machine(**{**node.__dict__, "ranks": 2, "local_ranks": 2})
    clip = Settings(compute_dtype="bf16", gradient_clipping=1.0)
    assert resolve(clip, units, node).plan.speculative  # one process: speculates
    assert not resolve(clip, units, two).plan.speculative
    with pytest.raises(PlanError, match="one process"):
        resolve(clip.model_copy(update={"speculate": "on"}), units, two)


def test_the_plan_says_where_deferred_updates_run():
    """Clipping: one rank on the CPU device applies them at the next visit; over several ranks
    (speculate "auto" turned off there) they run as a pass after backward, and the notes say so."""
    units = _profile().unit_specs()
    s = Settings(gradient_clipping=1.0, speculate="off")
    node = Machine(device="cpu", host_available_bytes=64 << 30, cores=16)
    one = resolve(s, units, node)
    assert any("next visit (the next forward" in n for n in one.plan.notes)
    two = resolve(
        Settings(gradient_clipping=1.0), units, Machine(**{**node.__dict__, "ranks": 2, "local_ranks": 2})
    )
    assert not two.plan.speculative and two.plan.deferred_update
    assert any("pass after backward over the 2 ranks" in n for n in two.plan.notes)
    assert any("pass after backward over the 2 ranks" in line for line in two.plan.describe().splitlines())
