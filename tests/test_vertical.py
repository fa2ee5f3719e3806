"""Vertical accumulation in the planner: a window of G micro-batches planned and replayed as one
step (planner/vertical.py), its activations counted for G micro-batches run one at a time, the
choice (decide.accumulation, resolve) and `offloadpp plan`'s printout. Pure Python."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_planner import GPT2_CUDA, _cuda_machine, cpu_hw, cuda_hw

from offloadpp.planner import PlanError, Settings, resolve, streaming_plan
from offloadpp.planner.activations import act_units, held_bytes, need_bytes, peak_bytes_at
from offloadpp.planner.cost import estimate
from offloadpp.planner.decide import LOOP_SLOWDOWN_TOLERANCE, accumulation
from offloadpp.planner.model_profile import analytic_profile
from offloadpp.planner.vertical import as_vertical, window_plan, window_profile

G = 4


def _model(batch: int = 1, seq: int = 512):
    return analytic_profile(GPT2_CUDA, micro_batch=batch, seq_len=seq, compute_dtype="bf16")


def _slow_ssd():
    """A GPU whose SSDs are slow beside it: every window is bound by the state's bytes."""
    return cuda_hw(ssd_read_gbps=1.0, ssd_write_gbps=1.0)


def test_a_window_profile_is_g_micro_batches_of_one():
    m = _model()
    w = window_profile(m, G)
    assert (w.micro_batch, w.window) == (G, G)
    for one, many in zip(m.units, w.units):
        assert many.forward_flops == G * one.forward_flops and many.backward_flops == G * one.backward_flops
        assert many.activation_bytes == G * one.activation_bytes
        assert many.pieces == tuple(tuple(G * x for x in p) for p in one.pieces)
        assert many.loss_workspace_bytes == one.loss_workspace_bytes  # one weight-sized buffer
    assert window_profile(m, 1) is m


def test_a_vertical_window_moves_each_units_weights_once_and_its_gradients_never_through_their_home():
    m, hw = _model(), _slow_ssd()
    units = m.unit_specs()
    kw = dict(device="cuda", compute_dtype="bf16", prefetch_depth=1, optim_prefetch_depth=1)
    one = streaming_plan(units, **kw)
    step = estimate(one, hw, m)
    horizontal = estimate(
        streaming_plan(units, accumulate_grads=True, micro_batches=G, **kw), hw, m, micro_batches=G
    )
    vplan = as_vertical(streaming_plan(units, micro_batches=G, **kw), G)
    vertical = estimate(window_plan(vplan), hw, window_profile(m, G))

    def kinds(e):
        return {k: (r, w) for k, r, w in e.ssd_by_kind}

    # the window's weights move as one step's: read for forward and for backward once, written once
    assert kinds(vertical)["weights"] == kinds(step)["weights"]
    assert kinds(vertical)["optimizer_state"] == kinds(step)["optimizer_state"]
    assert kinds(vertical)["gradients"] == (0, 0)  # summed on the device, handed to the optimizer once
    # horizontally every micro-batch reads them again and moves the gradients through their home
    assert kinds(horizontal)["weights"][0] > (G - 1) * kinds(step)["weights"][0]
    assert kinds(horizontal)["gradients"][0] > 0
    # the kinds are the replay's bytes, and the device computes G micro-batches
    assert sum(r for r, _ in kinds(vertical).values()) == vertical.ssd_read_bytes
    assert sum(w for _, w in kinds(vertical).values()) == vertical.ssd_write_bytes
    assert vertical.compute_s == pytest.approx(horizontal.compute_s, rel=1e-9)
    assert vertical.step_s < horizontal.step_s
    # the window's sum leaves the device rounded once to the compute dtype (Plan.window_grad_dtype),
    # where a per-micro-batch loop with the same plan accumulates fp32 in their home
    assert window_plan(vplan).grad_dtype == "bf16" == vplan.window_grad_dtype == one.grad_dtype
    assert vplan.grad_dtype == "fp32"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_deferred_windows_gradients_go_through_their_home_in_16_bits_as_one_steps(device):
    """Clipping with the deferred step: a vertical window's gradients wait in their home (SSD)
    for the update, in the compute dtype (Plan.window_grad_dtype): the same bytes as one step of
    G = 1 moves, half of what fp32 sums would (the runtime keeps them so: tests/test_window.py);
    on CUDA they cross the link in it too. Fails if the window's sums are counted in fp32."""
    m, hw = _model(), _slow_ssd() if device == "cuda" else cpu_hw()
    units = m.unit_specs()
    kw = dict(device=device, compute_dtype="bf16", prefetch_depth=1, optim_prefetch_depth=1,
              deferred_update=True, clipping=True)  # fmt: skip
    step = estimate(streaming_plan(units, **kw), hw, m)
    vplan = as_vertical(streaming_plan(units, micro_batches=G, **kw), G)
    window = window_plan(vplan)
    vertical = estimate(window, hw, window_profile(m, G))

    def grads(e):
        return {k: (r, w) for k, r, w in e.ssd_by_kind}["gradients"]

    assert window.grad_dtype == "bf16" and grads(step)[1] > 0
    assert grads(vertical) == grads(step)  # (fp32 sums: twice these)
    if device == "cuda":
        assert vertical.d2h_bytes == step.d2h_bytes


def test_a_window_holds_g_micro_batches_activations_and_runs_them_one_at_a_time():
    m = _model()
    one = {u.name: u for u in act_units(m)}
    many = {u.name: u for u in act_units(window_profile(m, G))}
    block = _block(m.units)
    u1, ug = one[block], many[block]
    # kept: every micro-batch's saved bytes from its forward to its backward
    assert held_bytes(ug, "keep") == G * held_bytes(u1, "keep")
    assert peak_bytes_at(ug, "keep") == G * u1.saved
    # recompute: G checkpoints held, and one micro-batch recomputed at a time
    assert peak_bytes_at(ug, "recompute") == (G - 1) * u1.checkpoint + peak_bytes_at(u1, "recompute")
    # swapped: one micro-batch's bytes on the device at a time
    assert peak_bytes_at(ug, "host") == peak_bytes_at(u1, "host")
    # so keeping every unit's activations needs G times what one micro-batch needs, at the least
    assert need_bytes(tuple(many.values()), {}) >= (G - 1) * need_bytes(tuple(one.values()), {})


@pytest.mark.parametrize(
    "asked, h, v, why, want",
    [
        ("auto", 10.0, 5.0, None, True),
        ("auto", 5.0, 10.0, None, False),
        ("auto", None, None, None, False),  # no estimates to compare: as a per-micro-batch loop runs
        ("auto", 10.0, 5.0, "does not fit", False),
        ("horizontal", 10.0, 5.0, None, False),
        ("vertical", 5.0, 10.0, None, True),
    ],
)
def test_the_choice_rule(asked, h, v, why, want):
    assert accumulation(Settings(gradient_accumulation_steps=G, accumulation=asked), h, v, why) is want
    assert accumulation(Settings(accumulation="vertical"), h, v, None) is False  # one micro-batch: no window


def test_vertical_forced_where_the_window_cannot_fit_names_why():
    with pytest.raises(PlanError, match='accumulation "vertical": the activations'):
        accumulation(
            Settings(gradient_accumulation_steps=G, accumulation="vertical"),
            1.0,
            None,
            "the activations of its 4 micro-batches held at once do not fit",
        )


def _resolve(m, **settings):
    s = Settings(
        compute_dtype="bf16",
        plan="auto",
        gradient_accumulation_steps=G,
        micro_batch=m.micro_batch,
        **settings,
    )
    return resolve(s, m.unit_specs(), _cuda_machine(8), hardware=_slow_ssd(), model=m)


def test_resolve_runs_the_window_vertically_where_it_is_faster():
    m = _model()
    r = _resolve(m)
    assert r.plan.vertical and r.plan.micro_batches == G and r.plan.accumulate_grads
    assert len(r.plan.vertical_activations) == len(r.plan.units)
    times = dict(r.plan.window_s)
    assert times["vertical"] == r.estimate.step_s < times["horizontal"] == r.other.estimate.step_s
    assert not r.other.plan.vertical and r.loop_estimate is not None
    assert any("runs vertically" in n and "per-micro-batch loop" in n for n in r.plan.notes)
    # a per-micro-batch loop runs the plan horizontally within its budgets
    from offloadpp.planner.peaks import peak_bytes

    dev, host = peak_bytes(r.plan)
    assert dev <= r.plan.budgets.buffer_bytes and host <= r.plan.budgets.host_bytes
    forced = _resolve(m, accumulation="horizontal")
    assert not forced.plan.vertical and forced.other is None and forced.plan.window_s == ()
    # planned after the vertical window, the horizontal search stopped once no plan left could
    # beat its bar (Request.beat_s: the window's estimate, or the bar a per-micro-batch loop with
    # the vertical plan sets, whichever is higher): its plan is one it replayed first
    assert r.other.beaten_by >= r.estimate.step_s and len(r.other.candidates) < len(forced.candidates)
    assert r.other.beaten_by in (r.estimate.step_s, r.loop_estimate.step_s / (1 + LOOP_SLOWDOWN_TOLERANCE))
    assert r.estimate.step_s < forced.estimate.step_s <= times["horizontal"]
    assert any("none left could beat" in n for n in r.other.plan.notes)


def test_resolve_keeps_the_window_horizontal_where_its_micro_batches_cannot_fit():
    m = _model()
    acts = {u.name: u for u in act_units(m)}
    one = need_bytes(tuple(acts.values()), {})
    from offloadpp.planner.spec import ActivationSettings

    keep = ActivationSettings(policy="keep", budget_bytes=int(one * 1.5))
    r = _resolve(m, activations=keep)
    assert not r.plan.vertical and "do not fit" in r.vertical_why_not
    assert any("vertical is impossible" in n for n in r.plan.notes)
    with pytest.raises(PlanError, match='accumulation "vertical": the activations of its 4 micro-batches'):
        _resolve(m, activations=keep, accumulation="vertical")


def test_plan_prints_both_schedules_and_what_train_batch_gains(tmp_path, capsys):
    import argparse

    from offloadpp.cli.plan import add_arguments, run

    m = _model()
    prof, hw, cfg = tmp_path / "model.json", tmp_path / "hw.json", tmp_path / "ds.json"
    m.to_json(str(prof))
    _slow_ssd().to_json(str(hw))
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                               "bf16": {"enabled": True},
                               "offloadpp": {"enabled": True, "plan": "auto", "nvme_paths": [str(tmp_path)]}}))  # fmt: skip
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = [
        "--config",
        str(cfg),
        "--model-profile",
        str(prof),
        "--hardware",
        str(hw),
        "--machine-from-hardware",
    ]
    assert run(p.parse_args(base + ["--grad-accum", str(G), "--top", "0"])) == 0
    out = capsys.readouterr().out
    assert f"a window of {G} micro-batches" in out
    assert (
        "| vertical (the plan's) |" in out and "| horizontal (a per-micro-batch loop with the plan) |" in out
    )
    assert (
        "train_batch (and the Trainer's window) runs it vertically" in out
        and "x faster than a per-micro-batch loop" in out
    )
    assert "grads=fp32 (a window's: bf16)" in out  # (Plan.window_grad_dtype)
    assert (
        run(p.parse_args(base + ["--grad-accum", str(G), "--accumulation", "horizontal", "--top", "0"])) == 0
    )
    out = capsys.readouterr().out
    assert (
        "both train_batch and a per-micro-batch loop run it horizontally" in out and "| vertical" not in out
    )
    assert run(p.parse_args(base + ["--top", "0"])) == 0
    assert "a window of" not in capsys.readouterr().out  # one micro-batch a step: no window


def _block(units) -> str:
    return next(u.name for u in units if u.name.split(".")[-1].isdigit())


def test_the_replay_copies_a_window_units_micro_batches_out_one_at_a_time():
    from types import SimpleNamespace

    from offloadpp.planner.simulate_act import ActReplay

    w = window_profile(_model(), G)
    units = {u.name: u for u in act_units(w)}
    saved = {u.name: u.activation_bytes for u in w.units}
    block = _block(w.units)
    sim = SimpleNamespace(sched=SimpleNamespace(visits=()))
    parts = ActReplay(sim, {block: "host"}, saved, 2, units=units).forward_parts(block)
    assert len(parts) == G and sum(b for _, b in parts) == saved[block]
    assert all(share == pytest.approx(1 / G) for share, _ in parts)
    # a kept unit's bytes never leave: one part; one micro-batch's step: one part
    assert len(ActReplay(sim, {block: "keep"}, saved, 2, units=units).forward_parts(block)) == 1
    one = {u.name: u for u in act_units(_model())}
    assert len(ActReplay(sim, {block: "host"}, saved, 2, units=one).forward_parts(block)) == 1


def test_a_vertical_plan_also_holds_a_per_micro_batch_loop_or_says_why_not():
    from offloadpp.planner import Budgets, Tier
    from offloadpp.planner.peaks import peak_bytes
    from offloadpp.planner.vertical import fits_per_micro_batch

    units = _model().unit_specs()
    kw = dict(device="cuda", compute_dtype="bf16", prefetch_depth=1, optim_prefetch_depth=1, micro_batches=G)
    # the window's budgets (planned for its own peaks) less than a loop with its gradients
    # accumulated in host memory needs
    window = streaming_plan(units, **kw)
    window = replace(window, placements=tuple(replace(p, grads=Tier.HOST) for p in window.placements))
    need_dev, need_host = peak_bytes(as_vertical(window, G))
    plan = as_vertical(replace(window, budgets=Budgets(need_dev, need_host - 1, activation_bytes=1 << 20)), G)
    fitted, why = fits_per_micro_batch(plan, Settings())
    assert why is None and fitted.budgets.host_bytes >= need_host and fitted.budgets.buffer_bytes >= need_dev
    _, why = fits_per_micro_batch(plan, Settings(host_budget_bytes=need_host - 1))
    assert "per-micro-batch loop" in why and "host_budget_bytes" in why


def test_a_vertical_plan_file_runs_as_it_was_made_for_its_window(tmp_path):
    from offloadpp.planner import save_plan
    from offloadpp.planner.resolve import load_saved_plan

    m = _model()
    r = _resolve(m)
    assert r.plan.vertical
    path = str(tmp_path / "plan.json")
    save_plan(path, r.plan, r.estimate)

    def again(g: int):
        s = Settings(compute_dtype="bf16", plan=path, gradient_accumulation_steps=g, micro_batch=1)
        return resolve(
            s, m.unit_specs(), _cuda_machine(8), hardware=_slow_ssd(), model=m, saved=load_saved_plan(s)
        )

    back = again(G)
    assert back.plan.vertical and back.plan.vertical_activations == r.plan.vertical_activations
    assert back.plan.placements == r.plan.placements and back.plan.micro_batches == G
    with pytest.raises(PlanError, match="plan.micro_batches is 4 but the settings need 8"):
        again(8)


def test_the_replay_copies_a_fetched_unit_up_within_the_window_visit_its_read_ends_in():
    """A vertical window's visit runs G micro-batches one at a time, and each reaching the unit
    pumps the held weights (runtime/executor.py): the next unit's host-to-device copy starts
    within the visit its read ends in, so a compute-bound window's forward waits for the first
    unit's copy, not for every unit's (as it would where only a visit's entry started them)."""
    from offloadpp.planner.cost import compute_times

    m = _model(batch=8)
    hw = replace(cuda_hw(ssd_read_gbps=50.0, ssd_write_gbps=50.0), h2d_gbps=4.0, d2h_gbps=4.0,
                 device_flops_per_s={"fp32": 5e12, "bf16": 20e12})  # fmt: skip
    units = m.unit_specs()
    kw = dict(device="cuda", compute_dtype="bf16", prefetch_depth=1, optim_prefetch_depth=1)
    plan = window_plan(as_vertical(streaming_plan(units, micro_batches=G, **kw), G))
    model = window_profile(m, G)
    fwd, _ = compute_times(plan, hw, model)
    copy_s = max(u.weights_bytes("bf16") for u in units) / (hw.h2d_gbps * 1e9)
    assert min(t for t in fwd.values() if t) > copy_s  # (a block's compute hides the next unit's copy)
    e = estimate(plan, hw, model)
    assert e.forward_s - sum(fwd.values()) < 2.5 * copy_s  # (len(units) copies waited for: 6)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_cpu_windows_backward_visit_holds_each_micro_batchs_gradients_and_their_sum(dtype):
    """On the CPU device a 16-bit vertical window keeps each micro-batch's gradient of the unit in
    backward until the unit's are complete and sums them once (runtime/window_grads.py): its
    backward visits hold G 16-bit gradients and the rounded sum, and the tied head's G gradients
    of the embeddings from its visit to theirs; the peak counts them; fp32
    (autograd's own sum), a per-micro-batch loop and one step hold one gradient. Fails if the
    window's visits are counted as one step's."""
    from offloadpp.planner.holds import holds
    from offloadpp.planner.peaks import peak_bytes
    from offloadpp.planner.schedule import build_schedule, structure

    units = _model().unit_specs()
    kw = dict(device="cpu", compute_dtype=dtype, prefetch_depth=1, optim_prefetch_depth=1)
    one = streaming_plan(units, **kw)
    vplan = as_vertical(streaming_plan(units, micro_batches=G, **kw), G)
    window = window_plan(vplan)
    size = {u.name: u.padded_numel for u in units}

    def grads(plan):
        return {h.visit: h.grads for h in holds(plan, structure(plan)) if h.grads}

    per = 4 if dtype == "fp32" else 2 * G + 2  # (bytes a parameter)
    backward = [v for v in structure(window).visits if v.backward]
    # the head's tied gradients of the embeddings (one per micro-batch, 16-bit) are held from the
    # head's visit until the embeddings' own, where they are summed with theirs
    (head,) = [u for u in units if u.borrows]
    (owner,) = head.borrows
    names = [v.unit for v in backward]
    between = set(names[names.index(head.name) : names.index(owner)])
    tied = {v.index: size[owner] * 2 * G if dtype == "bf16" and v.unit in between else 0 for v in backward}
    assert tied and any(tied.values()) == (dtype == "bf16")
    assert grads(window) == {v.index: size[v.unit] * per + tied[v.index] for v in backward}
    assert grads(one) == {v.index: size[v.unit] * (4 if dtype == "fp32" else 2) for v in backward}
    assert grads(vplan) == grads(one)  # (a per-micro-batch loop: one micro-batch's gradients at a time)
    more = peak_bytes(window)[0] - peak_bytes(one)[0]
    assert more == 0 if dtype == "fp32" else more >= min(size[v.unit] for v in backward) * 2 * G
    assert peak_bytes(window)[0] == build_schedule(window).peak_device_bytes


def test_a_cpu_windows_default_plan_keeps_only_what_fits_beside_its_kept_gradients():
    """No profiles (the default plan): a bf16 window of 8 on the CPU device gets a device budget
    sized for its step's peaks (each micro-batch's gradients of the unit in backward, the tied
    head's of the embeddings: holds.visit_grad_bytes, tied_partial_bytes), and the default
    plan keeps arrays only in what that leaves beside them: the window's peak plus the arrays
    kept on the device stay within the budget. Failed when the default plan was made for one
    micro-batch: it took the room the window's gradients need for 20 blocks' weights (GPT-2
    1.31B: a 2.69 GiB budget and 1.98 GiB kept)."""
    from offloadpp.planner import Machine
    from offloadpp.planner.peaks import peak_bytes

    units = analytic_profile(GPT2_CUDA, micro_batch=1, seq_len=64, compute_dtype="bf16").unit_specs()
    s = Settings(
        compute_dtype="bf16", gradient_accumulation_steps=8, accumulation="vertical", gradient_clipping=1.0
    )
    r = resolve(s, units, Machine(device="cpu", host_available_bytes=64 << 30, cores=2))
    plan = r.plan
    assert plan.vertical and plan.micro_batches == 8
    window = window_plan(plan)
    assert peak_bytes(window)[0] + plan.resident_device_bytes() <= plan.budgets.buffer_bytes
    assert peak_bytes(window)[0] > peak_bytes(plan)[0]  # (the window's gradients: more than the loop's)
