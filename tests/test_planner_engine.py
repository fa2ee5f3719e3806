"""The planner through the resolve stage into the engine: Settings(plan="auto") and a saved plan
file, the predicted step time in the StepReport and its log line."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from offloadpp.assemble import assemble_engine, resolve_for_model  # noqa: E402
from offloadpp.optim import AdamHyper  # noqa: E402
from offloadpp.planner import PlanError, Settings, save_plan  # noqa: E402
from offloadpp.planner.hardware import HardwareProfile  # noqa: E402
from offloadpp.runtime import RuntimeConfig  # noqa: E402

transformers.logging.set_verbosity_error()


def tiny():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture
def hw_path(tmp_path):
    # (measured for the device the test's "cpu" engine runs on: the stand-in and CUDA under
    # OFFLOADPP_DEVICE plan for "cuda", conftest.on_device)
    from offloadpp.runtime.accel.select import plan_device

    hw = HardwareProfile(
        device=plan_device("cpu"), device_name="t", cpu_cores=2, ssd_read_gbps=2.0, ssd_write_gbps=2.0, h2d_gbps=10.0,
        d2h_gbps=10.0, memcpy_gbps=10.0, device_flops_per_s={"fp32": 50e9}, adam_params_per_s={1: 1e9},
        host_memory_bytes=8 << 30, device_memory_bytes=8 << 30,
    )  # fmt: skip
    path = str(tmp_path / "hw.json")
    hw.to_json(path)
    return path


def _config(tmp_path, **settings) -> RuntimeConfig:
    (tmp_path / "nvme").mkdir(exist_ok=True)
    base = dict(device_budget_bytes=6 << 20, host_budget_bytes=8 << 20)
    base.update(settings)
    return RuntimeConfig(nvme_paths=[str(tmp_path / "nvme")], settings=Settings(**base), device="cpu",
                         ssd_read_gbps=2.0, ssd_write_gbps=2.0)  # fmt: skip


def _train(engine, steps=3):
    g = torch.Generator().manual_seed(1)
    reports = []
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        reports.append(engine.step())
    return reports


def test_auto_plan_runs_and_reports_the_prediction(tmp_path, hw_path, caplog):
    cfg = _config(tmp_path, plan="auto", hardware_profile=hw_path, micro_batch=2, seq_len=16)
    with caplog.at_level(logging.INFO, logger="offloadpp.runtime"):
        with assemble_engine(tiny(), cfg, hyper=AdamHyper(lr=1e-3)) as e:
            assert e.predicted is not None and e.predicted.step_s > 0
            assert any("auto plan" in n for n in e.plan.notes)
            reports = _train(e)
    assert all(r.predicted_s == pytest.approx(e.predicted.step_s) for r in reports)
    assert any("predicted" in rec.getMessage() for rec in caplog.records)


def test_a_step_that_clips_is_set_beside_the_deferred_estimate(tmp_path, hw_path):
    # the streaming plan (every array on SSD), estimated with the profiles: a speculative plan's
    # estimate is of a step that validates; these steps clip (a fresh tiny
    # model's norms are far above 1e-3), so each report carries the plan's deferred estimate
    cfg = _config(tmp_path, hardware_profile=hw_path, micro_batch=2, seq_len=16, gradient_clipping=1e-3,
                  optim_prefetch_depth=0, device_budget_bytes=None, host_budget_bytes=None)  # fmt: skip
    with assemble_engine(tiny(), cfg, hyper=AdamHyper(lr=1e-3)) as e:
        assert e.plan.speculative and e.predicted_deferred is not None
        reports = _train(e)
    assert {r.updates for r in reports} == {"deferred"}
    assert all(r.predicted_s == pytest.approx(e.predicted_deferred.step_s) for r in reports)
    assert reports[-1].predicted_ssd_by_kind == e.predicted_deferred.ssd_by_kind
    assert e.predicted_deferred.ssd_by_kind != e.predicted.ssd_by_kind  # (the gradients' round trip)
    assert reports[-1].ssd_by_kind == e.predicted_deferred.ssd_by_kind


def test_saved_plan_file_runs(tmp_path, hw_path):
    r = resolve_for_model(
        tiny(), _config(tmp_path, plan="auto", hardware_profile=hw_path, seq_len=16).settings
    )
    plan, est = r.plan, r.estimate
    path = str(tmp_path / "plan.json")
    save_plan(path, plan, est)
    with assemble_engine(tiny(), _config(tmp_path, plan=path), hyper=AdamHyper(lr=1e-3)) as e:
        assert e.plan.placements == plan.placements and e.predicted == est
        assert _train(e, 2)[-1].predicted_s == pytest.approx(est.step_s)


def test_infeasible_auto_plan_fails_before_training(tmp_path, hw_path):
    cfg = _config(
        tmp_path, plan="auto", hardware_profile=hw_path, device_budget_bytes=4096, host_budget_bytes=4096
    )
    with pytest.raises(PlanError, match="short by"):
        assemble_engine(tiny(), cfg)
    with pytest.raises(PlanError, match="offloadpp profile"):
        assemble_engine(
            tiny(), _config(tmp_path, plan="auto", hardware_profile=str(tmp_path / "missing.json"))
        )


def test_a_vertical_plan_sets_each_step_beside_the_way_it_ran(tmp_path, hw_path):
    """A vertical plan's estimate is of its window run whole (train_batch): a per-micro-batch
    loop's steps (and the window that records the RNG tapes) run horizontally and are set beside
    the loop's estimate (Resolved.loop_estimate), the vertical windows beside the window's."""
    cfg = _config(tmp_path, plan="auto", hardware_profile=hw_path, micro_batch=2, seq_len=16,
                  gradient_accumulation_steps=2, accumulation="vertical",
                  device_budget_bytes=None, host_budget_bytes=None)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with assemble_engine(tiny(), cfg, hyper=AdamHyper(lr=1e-3)) as e:
        assert e.plan.vertical and e.predicted_loop is not None
        assert e.predicted_loop.step_s != pytest.approx(e.predicted.step_s)
        loop = _train(e, 2)[-1]  # (a window of two micro-batches: its second step() reports)
        windows = [e.train_window([{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (2, 2, 16), generator=g)])
                   for _ in range(2)]  # fmt: skip
    assert loop.predicted_s == pytest.approx(e.predicted_loop.step_s)
    assert [w.vertical for w in windows] == [False, True]
    assert windows[0].report.predicted_s == pytest.approx(e.predicted_loop.step_s)
    assert windows[1].report.predicted_s == pytest.approx(e.predicted.step_s)


def test_a_deferred_vertical_windows_bytes_are_the_estimates(tmp_path, hw_path):
    """bf16, clipping with the deferred step, every array on SSD: a vertical window's gradients
    wait for their update in their home in bf16 (Plan.window_grad_dtype: its fp32 sum rounded
    once), and the window moves, kind by kind, the bytes its estimate counts; a per-micro-batch
    loop's window keeps fp32 sums there, run after the vertical windows too (the slots retyped
    back: its bytes are its estimate's, Resolved.loop_estimate). Fails if the runtime keeps the
    window's sums in fp32 (twice the gradients' bytes)."""
    cfg = _config(tmp_path, hardware_profile=hw_path, micro_batch=2, seq_len=16, gradient_clipping=1e-3,
                  speculate="off", compute_dtype="bf16", gradient_accumulation_steps=2, accumulation="vertical",
                  optim_prefetch_depth=0, device_budget_bytes=None, host_budget_bytes=None)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with assemble_engine(tiny(), cfg, hyper=AdamHyper(lr=1e-3)) as e:
        assert e.plan.vertical and e.plan.deferred_update and not e.plan.speculative
        windows = [e.train_window([{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (2, 2, 16), generator=g)])
                   for _ in range(3)]  # fmt: skip
        n = sum(u.padded_numel for u in e.plan.units)
        loop = _train(e, 4)  # (two windows of a per-micro-batch loop after them: fp32 sums again)
    assert loop[-1].ssd_by_kind == e.predicted_loop.ssd_by_kind
    assert [w.vertical for w in windows] == [False, True, True]
    assert {w.report.updates for w in windows} == {"deferred"}
    got = {k: (r, w) for k, r, w in windows[-1].report.ssd_by_kind}
    # bf16, each unit's written once for its deferred update but the first one's (kept in memory
    # for the next forward's first visit: pending.py) and read back for it
    assert 0 < got["gradients"][1] < 2 * n and got["gradients"][0] == got["gradients"][1]
    assert windows[-1].report.ssd_by_kind == e.predicted.ssd_by_kind
    loop_grads = {k: (r, w) for k, r, w in e.predicted_loop.ssd_by_kind}["gradients"]
    assert loop_grads[1] >= 4 * n  # (fp32 sums accumulated in their home)


def test_one_step_of_g1_with_a_windows_plan_moves_its_state_as_the_window_does(tmp_path, hw_path):
    """`bench ab`'s G = 1 line (issue 33: a window's SSD bytes at most 1.3x one step of G = 1's):
    harness.modelled_ssd_by_kind(one_step=True) replays one micro-batch's step with the vertical
    window's plan. Weights and optimizer state move as in the window (each read once for forward
    and once for backward, the state once); activations swapped to SSD are one micro-batch's,
    the window's at least G times them."""
    from offloadpp.bench.harness import modelled_ssd_by_kind
    from offloadpp.planner import ActivationSettings

    cfg = _config(tmp_path, hardware_profile=hw_path, micro_batch=2, seq_len=16, compute_dtype="bf16",
                  gradient_accumulation_steps=4, accumulation="vertical", activations=ActivationSettings(policy="ssd"),
                  device_budget_bytes=None, host_budget_bytes=None)  # fmt: skip
    model = tiny()
    with assemble_engine(model, cfg, hyper=AdamHyper(lr=1e-3)) as e:
        assert e.plan.vertical
        window, _ = modelled_ssd_by_kind(e, model.config.to_dict(), window=True)
        one, src = modelled_ssd_by_kind(e, model.config.to_dict(), one_step=True)
    w, o = ({k: (r, wr) for k, r, wr in b} for b in (window, one))
    assert "one step of G = 1" in src
    assert w["weights"] == o["weights"] and w["optimizer_state"] == o["optimizer_state"]
    assert o["activations"][1] > 0 and w["activations"][1] >= 4 * o["activations"][1]
