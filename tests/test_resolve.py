"""The one resolve stage (planner/resolve.py) and the promises it makes:

- the rules for "auto" budgets, pure, from Settings, the units and what the machine has free;
- `offloadpp plan --json` and `offloadpp.initialize` produce the same plan and budgets;
- a run at the streaming minimum never holds more than a budget by the engine's own accounting,
  and reports the peaks (a pool that would pass its budget raises a named error);
- the smallest ZeRO-Infinity config (DeepSpeed leaves most keys None) trains.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os

import pytest
import torch

from offloadpp.planner import (
    Budgets,
    Machine,
    PlanError,
    Settings,
    UnitSpec,
    build_schedule,
    min_budgets,
    resolve,
)
from offloadpp.planner.decide import LOOP_SLOWDOWN_TOLERANCE
from offloadpp.planner.planfile import load_plan, plan_to_dict
from offloadpp.planner.resolve import DEVICE_SHARE_CPU, HOST_SHARE, READ_AHEAD_HOST_SHARE

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

UNITS = (
    UnitSpec("embed", 1_000_000, backward_needs_weights=False),
    *(UnitSpec(f"h.{i}", 400_000) for i in range(6)),
    UnitSpec("head", 1024, borrows=("embed",)),
)
MACHINE = Machine("cpu", host_available_bytes=16 << 30, cores=2)


# ---- the rules, pure ----------------------------------------------------------------------------
def test_auto_budgets_with_state_on_ssd_are_the_streaming_minimum():
    r = resolve(Settings(), UNITS, MACHINE)
    dev, host = min_budgets(
        UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=2, optim_prefetch_depth=2
    )
    assert (r.budgets.device_bytes, r.budgets.host_bytes) == (dev, host)
    assert r.plan.ssd_bytes() == sum(u.master_bytes + u.moments_bytes for u in UNITS)  # all on SSD
    assert r.settings.adam_threads == 2 and r.plan.activations == ("keep",) * len(UNITS)


def test_deferred_updates_read_ahead_over_every_unit_when_it_fits():
    clip = Settings(gradient_clipping=1.0)
    r = resolve(clip, UNITS, MACHINE)
    assert r.plan.optim_prefetch_depth == len(UNITS) - 1 == r.settings.optim_prefetch_depth
    _, host_all = min_budgets(UNITS, device="cpu", compute_dtype="fp32", prefetch_depth=2,
                              optim_prefetch_depth=len(UNITS) - 1, deferred_update=True)  # fmt: skip
    assert r.budgets.host_bytes == host_all
    small = Machine("cpu", host_available_bytes=int(host_all / READ_AHEAD_HOST_SHARE) - 1, cores=2)
    assert resolve(clip, UNITS, small).plan.optim_prefetch_depth < len(UNITS) - 1


def test_auto_budgets_without_offload_are_shares_of_free_memory():
    r = resolve(Settings(offload_params=False, offload_optimizer=False), UNITS, MACHINE)
    assert r.budgets.device_bytes == int(MACHINE.host_available_bytes * DEVICE_SHARE_CPU)
    assert r.budgets.host_bytes == int(MACHINE.host_available_bytes * HOST_SHARE)
    assert r.plan.ssd_bytes() == 0  # everything fits in memory, so nothing is on SSD
    cuda = Machine("cuda", host_available_bytes=64 << 30, device_free_bytes=10 << 30, cores=8)
    rc = resolve(Settings(offload_params=False, offload_optimizer=False), UNITS, cuda)
    assert rc.budgets.device_bytes == int(0.8 * (10 << 30)) and rc.plan.device == "cuda"


def test_explicit_budgets_win_and_infeasible_ones_are_named():
    r = resolve(Settings(device_budget_bytes=1 << 30, host_budget_bytes=2 << 30), UNITS, MACHINE)
    assert r.budgets == Budgets(1 << 30, 2 << 30)
    with pytest.raises(PlanError, match=r"device budget of 4.00 KiB \(4096 bytes\) is too small"):
        resolve(Settings(device_budget_bytes=4096), UNITS, MACHINE)


def test_the_plan_is_made_for_the_settings():
    r = resolve(Settings(compute_dtype="bf16", gradient_accumulation_steps=2, prefetch_depth=1,
                         activations={"policy": "recompute", "budget_bytes": 1 << 20}), UNITS, MACHINE)  # fmt: skip
    p = r.plan
    assert (p.compute_dtype, p.accumulate_grads, p.prefetch_depth) == ("bf16", True, 1)
    assert p.activations[0] == "keep" and set(p.activations[1:]) == {"recompute"}  # embed cannot recompute
    assert r.budgets.activation_bytes == 1 << 20
    s = build_schedule(p)
    assert s.peak_device_bytes <= r.budgets.device_bytes and s.peak_host_bytes <= r.budgets.host_bytes


# ---- the CLI prints the plan initialize runs ----------------------------------------------------
def _ds_config(nvme: str, **over) -> dict:
    os.makedirs(nvme, exist_ok=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
        "offloadpp": {"enabled": True},
    }
    cfg.update(over)
    return cfg


def test_plan_cli_and_initialize_agree(tmp_path, capsys):
    """For one config and model the plan `offloadpp plan --json` writes is the plan and budgets
    offloadpp.initialize runs, "auto" budgets included."""
    import offloadpp
    from offloadpp.cli import plan as plan_cli
    from offloadpp.presets import get_preset

    cfg = _ds_config(str(tmp_path / "nvme"))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "plan.json"
    p = argparse.ArgumentParser()
    plan_cli.add_arguments(p)
    assert (
        plan_cli.run(p.parse_args(["--config", str(path), "--model", "gpt2-tiny", "--json", str(out)])) == 0
    )
    printed, _ = load_plan(str(out))
    assert "budgets: device" in capsys.readouterr().out
    model = transformers.GPT2LMHeadModel(get_preset("gpt2-tiny").gpt2_config())
    engine, *_ = offloadpp.initialize(model=model, config=str(path))
    try:
        ran = engine.runtime.plan
        assert ran.budgets == printed.budgets
        assert plan_to_dict(ran) == plan_to_dict(printed)
    finally:
        engine.close()


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_lora_plan_runs_its_updates_after_backward_with_one_generation(clip):
    """speculate "auto" over units whose trainable state is 1% of their base (LoRA): updates
    deferred, not speculative, the plan's footprint the base and at most 16 B per trainable
    parameter, and a note that says why; the same units fully trainable plan as before."""
    from offloadpp.planner.plan import flat_numel

    lora = tuple(UnitSpec(u.name, u.numel // 100, frozen_numel=u.numel, backward_needs_weights=u.backward_needs_weights)
                 for u in UNITS if not u.borrows)  # fmt: skip
    machine = Machine("cpu", host_available_bytes=16 << 30, ssd_free_bytes=1 << 40, cores=2)
    p = resolve(Settings(gradient_clipping=clip), lora, machine).plan
    assert p.deferred_update and not p.speculative
    trainable = sum(flat_numel(u.numel) for u in lora)
    assert p.frozen_ssd_bytes() < p.ssd_footprint_bytes() <= p.frozen_ssd_bytes() + 16 * trainable
    assert any("below the cost model's prediction error (15%)" in n for n in p.notes), p.notes
    assert "below the cost model's prediction error" in p.describe()
    on = resolve(Settings(gradient_clipping=clip, speculate="on"), lora, machine).plan
    assert on.deferred_update == (clip > 0) and on.speculative == (clip > 0)
    assert on.ssd_footprint_bytes() >= on.frozen_ssd_bytes() + 24 * trainable
    full = resolve(Settings(gradient_clipping=clip), UNITS, machine).plan
    assert full.deferred_update == (clip > 0) and full.speculative == (clip > 0)
    assert not any("prediction error" in n for n in full.notes)


# ---- budgets are promises -----------------------------------------------------------------------
def _gpt2(n_layer=6, seed=0):
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=128, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"gradient_clipping": 1.0, "gradient_accumulation_steps": 2},
        {"compute_dtype": "bf16"},
        {"prefetch_depth": 0, "optim_prefetch_depth": 0},
        {"activations": {"policy": "ssd", "budget_bytes": 6 << 20, "min_swap_bytes": 0}},
        {"gradient_clipping": 1e3, "speculate": "on", "optim_prefetch_depth": 1},
        {"gradient_clipping": 1e-3, "speculate": "on", "optim_prefetch_depth": 1},
    ],
    ids=["plain", "clip-accum", "bf16", "k0q0", "act-ssd", "speculate-q1", "speculate-q1-redo"],
)  # act-ssd: 6 MiB holds the units backward works on (the swapped activations' working set), a
# quarter of the 23 MiB keeping every activation takes here
def test_streaming_minimum_holds_every_budget(tmp_path, settings, caplog):
    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.runtime import RuntimeConfig

    cfg = RuntimeConfig(nvme_paths=[str(tmp_path)], settings=Settings(**settings), device="cpu",
                        ssd_read_gbps=2.0, ssd_write_gbps=2.0)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="offloadpp.runtime"):
        with assemble_engine(_gpt2(), cfg, hyper=AdamHyper(lr=1e-3)) as eng:
            for p in eng.plan.placements:  # the streaming minimum: every array lives on SSD
                assert (p.weights.value, p.master.value, p.moments.value) == ("ssd", "ssd", "ssd")
            reports = []
            for _ in range(3 * cfg.settings.gradient_accumulation_steps):
                x = torch.randint(0, 128, (4, 64), generator=g)
                eng.backward(eng(input_ids=x, labels=x).loss)
                r = eng.step()
                if r is not None:
                    reports.append(r)
            final = eng.budget_report()
    if settings.get("speculate") == "on":  # a window sliding over a read-ahead short of every unit
        assert eng.plan.speculative and eng.plan.optim_prefetch_depth == 1
        assert all(r.speculated_units == len(eng.units) for r in reports)
        assert all((r.redone_units > 0) == (settings["gradient_clipping"] < 1) for r in reports)
    for r in reports:
        names = [b.name for b in r.budgets]
        assert names == ["device", "host", "activations", "activation staging"]
        for b in r.budgets:
            assert b.within, (b.name, b.run_peak_bytes, b.budget_bytes)
        assert r.budget("device").peak_bytes > 0 and r.budget("host").peak_bytes > 0
    assert all(b.within for b in final)
    assert any("mem device" in rec.getMessage() for rec in caplog.records)  # the log line


def test_pool_never_passes_its_budget():
    from offloadpp.runtime.memory import BudgetExceededError, BufferPool

    pool = BufferPool("host", 4096 * 3, lambda n, dt: torch.empty(n, dtype=dt))
    pool.release_wait_s = 0.05
    a, b = pool.get(1024, torch.float32), pool.get(1024, torch.float32)
    with pytest.raises(BudgetExceededError, match=r"host pool: 8.00 KiB .* host budget of 12.00 KiB"):
        pool.get(2048, torch.float32)
    with pytest.raises(BudgetExceededError, match="larger than the whole host budget"):
        pool.get(10_000, torch.float32)
    given = []

    def reclaim() -> bool:  # the owner gives b back (as the optimizer completes a job), once
        if given:
            return False
        given.append(b)
        pool.put(b)
        return True

    pool.reclaim = reclaim
    c = pool.get(2048, torch.float32)  # fits once b is back: no waiting, no raise
    assert given == [b] and pool.peak_bytes <= pool.budget_bytes == pool.allocated_bytes
    pool.put(a)
    pool.put(c)


def test_pool_paced_below_its_budget_waits_for_work_under_way_but_never_refuses_for_the_pace():
    from offloadpp.runtime.memory import BufferPool

    class Write:  # a write still draining a returned buffer
        def __init__(self):
            self.waited = False

        def done(self) -> bool:
            return self.waited

        def wait(self) -> None:
            self.waited = True

    pool = BufferPool("host", 4096 * 4, lambda n, dt: torch.empty(n, dtype=dt))
    pool.release_wait_s = 0.05
    pool.pace_bytes = 4096 * 2
    a = pool.get(1024, torch.float32)
    w = Write()
    pool.put(a, after=[w])
    b = pool.get(2048, torch.float32)  # past the pace: the draining write is waited for first
    assert w.waited and pool.allocated_bytes == 4096 * 2  # a's buffer freed to make room for b
    c = pool.get(1024, torch.float32)  # nothing under way: past the pace, within the budget
    assert pool.allocated_bytes == 4096 * 3 <= pool.budget_bytes
    pool.pace_bytes = None
    w2 = Write()
    pool.put(c, after=[w2])
    pool.get(512, torch.float32)  # unpaced: the budget has room, nothing is waited for
    assert not w2.waited
    pool.put(b)


# ---- the smallest config DeepSpeed documents ----------------------------------------------------
def test_smallest_zero_infinity_config_trains(tmp_path):
    """Only a batch size, an optimizer and ZeRO-Infinity's NVMe offload, plus the block: DeepSpeed
    leaves steps_per_print, scheduler and more None; offloadpp uses its defaults."""
    import offloadpp

    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            "offload_param": {"device": "nvme", "nvme_path": nvme},
        },
        "offloadpp": {"enabled": True},
    }
    model = _gpt2(n_layer=2)
    engine, optimizer, loader, sched = offloadpp.initialize(model=model, model_parameters=model.parameters(),
                                                            config=copy.deepcopy(cfg))  # fmt: skip
    try:
        x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(4):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] and engine.global_steps == 4
        assert engine.runtime.config.log_every >= 1 and sched is None and loader is None
    finally:
        engine.close()


# ---- activations: from the DeepSpeed block, in the device budget, refused when they cannot fit -----
def _cpu_hardware(path) -> str:
    from offloadpp.planner import HardwareProfile

    hw = HardwareProfile(device="cpu", device_name="test cpu", cpu_cores=2, ssd_read_gbps=2.0, ssd_write_gbps=2.0,
                         h2d_gbps=10.0, d2h_gbps=10.0, memcpy_gbps=10.0, device_flops_per_s={"fp32": 50e9},
                         adam_params_per_s={1: 1e9, 2: 1.5e9}, host_memory_bytes=16 << 30,
                         device_memory_bytes=16 << 30)  # fmt: skip
    hw.to_json(str(path))
    return str(path)


@pytest.mark.parametrize("policy", ["recompute", "partial_host", "ssd", "auto"])
def test_activation_policies_from_the_deepspeed_block(tmp_path, policy):
    """The block's activation policy reaches the plan initialize runs; with "auto" and a budget the
    planner picks each unit's policy within it; the run keeps its activations within the budget."""
    import offloadpp
    from offloadpp.planner.activations import act_units, need_bytes
    from offloadpp.planner.resolve import model_profile_for

    model = _gpt2(n_layer=4)
    s = Settings(micro_batch=4, seq_len=64)
    prof = model_profile_for(model.config.to_dict(), unit_specs_of(model), s)
    keep_all = need_bytes(act_units(prof), {})
    acts = {"policy": policy, "min_swap_bytes": 0}
    if policy == "auto":
        acts["budget_bytes"] = keep_all // 3
    cfg = _ds_config(str(tmp_path / "nvme"), train_micro_batch_size_per_gpu=4, gradient_clipping=0.0)
    cfg["offloadpp"].update(plan="auto", hardware_profile=_cpu_hardware(tmp_path / "hw.json"), seq_len=64,
                            activations=acts)  # fmt: skip
    engine, *_ = offloadpp.initialize(model=model, config=cfg)
    try:
        plan = engine.runtime.plan
        pol = dict(zip([u.name for u in plan.units], plan.activations))
        if policy == "auto":
            assert set(pol.values()) != {"keep"} and need_bytes(act_units(prof), pol) <= keep_all // 3
        else:
            assert {p for n, p in pol.items() if n != "embed"} == {policy}
            # the embeddings' backward reads no weights: they cannot recompute
            assert pol["embed"] == ("keep" if policy in ("recompute", "partial_host") else policy)
        assert plan.budgets.activation_bytes is not None  # counted in the device budget
        x = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        assert engine.runtime.activations.policies() == pol
        assert all(b.within for b in engine.runtime.budget_report()), engine.runtime.budget_report()
    finally:
        engine.close()


def unit_specs_of(model):
    from offloadpp.runtime import unit_specs

    return unit_specs(model)


def _plan_cli(tmp_path, hw, cfg):
    """`offloadpp plan` on a 4-layer GPT-2 (width 1024) for another machine: writes the hardware
    profile, the model's config and the DeepSpeed config under tmp_path; returns a function that
    runs the command with extra arguments and returns its exit code."""
    from offloadpp.cli import plan as plan_cli

    hw.to_json(str(tmp_path / "hw.json"))
    model = {"model_type": "gpt2", "n_layer": 4, "n_embd": 1024, "n_head": 16, "vocab_size": 8192,
             "n_positions": 1024}  # fmt: skip
    (tmp_path / "model.json").write_text(json.dumps(model))
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    p = argparse.ArgumentParser()
    plan_cli.add_arguments(p)
    base = ["--config", str(tmp_path / "ds.json"), "--model", str(tmp_path / "model.json"),
            "--hardware", str(tmp_path / "hw.json"), "--machine-from-hardware"]  # fmt: skip
    return lambda *extra: plan_cli.run(p.parse_args(base + list(extra)))


def test_plan_cli_refuses_what_cannot_fit_with_the_largest_batch(tmp_path, capsys):
    """`offloadpp plan` for another machine (its hand-written profile): a micro-batch whose
    activations cannot fit is refused with the largest that can, which then plans."""
    from offloadpp.planner import HardwareProfile

    hw = HardwareProfile(device="cuda", device_name="test gpu", cpu_cores=16, ssd_read_gbps=10.0, ssd_write_gbps=8.0,
                         h2d_gbps=25.0, d2h_gbps=25.0, memcpy_gbps=20.0, device_flops_per_s={"bf16": 150e12},
                         adam_params_per_s={16: 3e9}, host_memory_bytes=256 << 30, device_memory_bytes=4 << 30)  # fmt: skip
    cfg = _ds_config(str(tmp_path / "nvme"), bf16={"enabled": True}, gradient_clipping=0.0)
    cfg["offloadpp"]["plan"] = "auto"
    plan = _plan_cli(tmp_path, hw, cfg)

    def run(batch: int) -> int:
        return plan("--micro-batch", str(batch), "--seq-len", "1024")

    assert run(256) == 1
    err = capsys.readouterr().err
    assert "infeasible" in err and "The largest micro-batch that fits is" in err
    largest = int(err.split("The largest micro-batch that fits is ")[1].split(";")[0])
    assert run(largest) == 0
    out = capsys.readouterr().out
    assert "activations (budget" in out and "planned in" in out


def test_plan_cli_estimates_a_speculative_step_and_its_deferred_one(tmp_path, capsys):
    """With clipping, `offloadpp plan` estimates the step whose speculative updates validate and
    prints the deferred step's estimate beside it; --speculate off plans the deferred one."""
    import re

    from offloadpp.planner import HardwareProfile

    # compute-bound (a slow device, fast SSDs): the updates' overlap with backward is what counts
    hw = HardwareProfile(device="cuda", device_name="test gpu", cpu_cores=16, ssd_read_gbps=40.0, ssd_write_gbps=40.0,
                         h2d_gbps=25.0, d2h_gbps=25.0, memcpy_gbps=20.0, device_flops_per_s={"bf16": 2e12},
                         adam_params_per_s={16: 1e9}, host_memory_bytes=256 << 30, device_memory_bytes=8 << 30)  # fmt: skip
    plan = _plan_cli(
        tmp_path, hw, _ds_config(str(tmp_path / "nvme"), bf16={"enabled": True}, gradient_clipping=1.0)
    )

    def run(*extra: str) -> str:
        assert plan("--micro-batch", "2", "--seq-len", "256", *extra) == 0
        return capsys.readouterr().out

    def step_s(out: str) -> float:
        return float(re.search(r"step \(estimate\)\s+([0-9.]+) s", out).group(1))

    spec = run()
    assert "(speculative)" in spec
    assert "the estimate's SSD bytes per step by kind" in spec and "| optimizer_state |" in spec
    assert "note: I/O: " in spec  # the resolve stage's I/O settings, and whose they are
    deferred = float(re.search(r"runs them deferred: ([0-9.]+) s", spec).group(1))
    assert step_s(spec) < deferred
    off = run("--speculate", "off")
    assert "(speculative)" not in off and "runs them deferred" not in off
    assert step_s(off) > step_s(spec)


def _gpt2_window(g: int, batch: int = 1, **settings):
    """A bf16 GPT-2 (test_planner's) on a GPU with a 1 GB/s SSD, windows of g micro-batches."""
    from test_planner import GPT2_CUDA, _cuda_machine, cuda_hw

    from offloadpp.planner.model_profile import analytic_profile

    m = analytic_profile(GPT2_CUDA, micro_batch=batch, seq_len=512, compute_dtype="bf16")
    s = Settings(
        compute_dtype="bf16", plan="auto", gradient_accumulation_steps=g, micro_batch=batch, **settings
    )
    return resolve(
        s, m.unit_specs(), _cuda_machine(8), hardware=cuda_hw(ssd_read_gbps=1.0, ssd_write_gbps=1.0), model=m
    )


def test_a_vertical_plan_keeps_the_horizontal_plans_gradient_homes_for_a_loop():
    """The vertical plan is made for one step of the window, where no gradient is kept between
    micro-batches and their home could be anywhere (it was the SSD); a per-micro-batch loop run
    with it accumulates there. Its homes are the horizontal plan's (no deferred update: the
    window never uses them), and that loop is no slower than the horizontal plan's (it took 6x;
    the horizontal plan here is the first its search replayed, stopped at the window's bar, so
    the loop may be faster)."""
    r = _gpt2_window(4)
    assert r.plan.vertical and not r.plan.deferred_update
    assert [p.grads for p in r.plan.placements] == [p.grads for p in r.other.plan.placements]
    assert r.loop_estimate.step_s <= r.other.estimate.step_s * 1.01


def test_auto_takes_the_windows_candidate_whose_loop_holds_where_its_pick_slows_one():
    """Micro-batch 4, G=8, clipping 1.0 on the same GPT-2: the window search's pick (what
    "vertical" takes) would make a per-micro-batch loop over 2% slower than the horizontal plan,
    and "auto" kept the window horizontal (0.465 s against about 0.12 vertically). Another of the
    window's candidates keeps the loop (decide.loop_candidates): "auto" runs the window
    vertically with it, and a loop with its plan is no slower."""
    r = _gpt2_window(8, 4, gradient_clipping=1.0)
    times = dict(r.plan.window_s)
    assert r.plan.vertical and times["vertical"] < 0.5 * times["horizontal"]
    assert r.loop_estimate.step_s <= times["horizontal"] * (1 + LOOP_SLOWDOWN_TOLERANCE)
    forced = _gpt2_window(8, 4, gradient_clipping=1.0, accumulation="vertical")
    assert forced.plan.vertical and forced.loop_estimate.step_s > 1.02 * times["horizontal"]
    assert any(f"the search's pick ({forced.estimate.step_s:.3f} s) would slow" in n for n in r.plan.notes)


def test_auto_keeps_windows_horizontal_where_every_vertical_candidate_slows_a_loop():
    """Micro-batch 8, G=4, clipping 1.0, a 0.4 GiB device budget on the same GPT-2: vertically a
    window would take under half the horizontal one, but a per-micro-batch loop with any of the
    window's plans would be slower than with the horizontal plan; "auto" keeps it horizontal and
    says why, "vertical" takes it."""
    tight = dict(gradient_clipping=1.0, device_budget_bytes=int(0.4 * (1 << 30)))
    r = _gpt2_window(4, 8, **tight)
    times = dict(r.plan.window_s)
    assert times["vertical"] < 0.5 * times["horizontal"] and not r.plan.vertical
    assert any("would slow a per-micro-batch loop" in n for n in r.plan.notes)
    from offloadpp.cli.plan import window_lines

    assert 'would be slower (the plan\'s note), which "auto" never chooses' in window_lines(r)[-1]
    forced = _gpt2_window(4, 8, accumulation="vertical", **tight)
    assert forced.plan.vertical
    assert forced.loop_estimate.step_s > times["horizontal"] * (1 + LOOP_SLOWDOWN_TOLERANCE)
