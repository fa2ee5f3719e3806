"""offloadpp.profiling: the model profile from one profiling iteration (against the analytic one
and the runtime's units), the hardware profile (quick settings), the CLI commands."""

from __future__ import annotations

import argparse
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from offloadpp.planner.hardware import HardwareProfile  # noqa: E402
from offloadpp.planner.model_profile import ModelProfile, analytic_profile  # noqa: E402
from offloadpp.profiling.model import profile_model  # noqa: E402

transformers.logging.set_verbosity_error()
GPT2 = dict(model_type="gpt2", n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64)
LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)  # fmt: skip


def _model(cfg: dict):
    c = transformers.AutoConfig.for_model(**cfg)
    if cfg["model_type"] == "gpt2":
        c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = 0.0
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(c)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_measured_profile_matches_runtime_units_and_analytic(cfg):
    from offloadpp.runtime import find_units, layout_units

    model = _model(cfg)
    ids = torch.randint(0, 512, (2, 32))
    prof = profile_model(model, {"input_ids": ids, "labels": ids}, repeats=1)
    specs = [lay.spec() for lay in layout_units(model, find_units(model))]
    assert list(prof.unit_specs()) == specs  # names, sizes, borrows: a plan from it runs on the model
    ana = analytic_profile(cfg, micro_batch=2, seq_len=32)
    assert list(ana.unit_specs()) == specs
    for m, a in zip(prof.units, ana.units):
        assert m.forward_s > 0 and m.backward_s > 0
        if a.forward_flops:
            assert m.forward_flops == pytest.approx(a.forward_flops, rel=0.1), m.name
            assert m.backward_flops == pytest.approx(a.backward_flops, rel=0.15), m.name
        if m.name not in ("embed",):
            assert m.activation_bytes == pytest.approx(a.activation_bytes, rel=0.2), m.name
    assert prof.has_times("cpu") and prof.source == "measured"
    assert prof.gemms and all(g[0] == 64 for g in prof.gemms)
    back = ModelProfile.from_json(prof.to_json())
    assert back == prof


def test_hardware_profile_quick(tmp_path):
    from offloadpp.profiling.hardware import profile_hardware

    hw = profile_hardware([str(tmp_path)], total_bytes=16 << 20, io_grid=False, quick=True)
    assert hw.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert hw.ssd_read_gbps > 0 and hw.ssd_write_gbps > 0 and hw.ssd_mixed_gbps > 0
    assert hw.flops_per_s("fp32") > 1e8 and hw.adam_rate(1) > 1e6
    assert hw.compute_slowdown_under_adam >= 1.0 and hw.host_memory_bytes > 0
    assert hw.compute_slowdown_under_io >= 1.0
    assert hw.ssds and hw.ssds[0].path == str(tmp_path)
    path = tmp_path / "hw.json"
    hw.to_json(str(path))
    assert HardwareProfile.from_json(str(path)) == hw
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".offloadpp")]  # probe files removed


def test_missing_profile_dir_is_named(tmp_path):
    from offloadpp.profiling.hardware import profile_hardware

    with pytest.raises(FileNotFoundError, match="nope"):
        profile_hardware([str(tmp_path / "nope")], quick=True)


def _cli(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return module.run(p.parse_args(argv))


def _hw_json(tmp_path) -> str:
    hw = HardwareProfile(
        device="cpu", device_name="t", cpu_cores=2, ssd_read_gbps=2.0, ssd_write_gbps=2.0, h2d_gbps=10.0, d2h_gbps=10.0,
        memcpy_gbps=10.0, device_flops_per_s={"fp32": 100e9}, adam_params_per_s={1: 1e9},
        host_memory_bytes=8 << 30, device_memory_bytes=8 << 30,
    )  # fmt: skip
    path = str(tmp_path / "hw.json")
    hw.to_json(path)
    return path


def _ds(tmp_path, **block) -> dict:
    (tmp_path / "nvme").mkdir(exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme},
            "offloadpp": {"enabled": True, **block}}  # fmt: skip


def test_plan_cli(tmp_path, capsys):
    from offloadpp.cli import plan as plan_cli
    from offloadpp.planner.planfile import load_plan

    ds = _ds(tmp_path, device_budget_bytes="200MB", host_budget_bytes="300MB", plan="auto")
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds))
    out = str(tmp_path / "plan.json")
    rc = _cli(
        plan_cli,
        ["--config", str(cfg), "--model", "gpt2-tiny", "--hardware", _hw_json(tmp_path), "--json", out],
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "step (estimate)" in text and "bound by" in text and "transformer.h.1" in text
    plan, est = load_plan(out)
    assert plan.deferred_update and est is not None and est.step_s > 0
    assert plan.budgets.device_bytes == 200 * 10**6 and plan.budgets.host_bytes == 300 * 10**6
    ds["offloadpp"]["host_budget_bytes"] = "1MB"
    cfg.write_text(json.dumps(ds))
    rc = _cli(plan_cli, ["--config", str(cfg), "--model", "gpt2-tiny", "--hardware", _hw_json(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "infeasible" in err and "host budget is short by" in err


def test_plan_cli_with_model_dir_and_missing_profile(tmp_path, capsys):
    from offloadpp.cli import plan as plan_cli

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(LLAMA))
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(_ds(tmp_path, device_budget_bytes="1GB", host_budget_bytes="1GB")))
    rc = _cli(plan_cli, ["--config", str(cfg), "--model", str(tmp_path / "m"), "--seq-len", "64",
                         "--hardware", _hw_json(tmp_path)])  # fmt: skip
    assert rc == 0 and "model.layers.1" in capsys.readouterr().out
    rc = _cli(
        plan_cli, ["--config", str(cfg), "--model", "gpt2-tiny", "--hardware", str(tmp_path / "none.json")]
    )
    assert rc == 2 and "offloadpp profile" in capsys.readouterr().err


def test_profile_cli(tmp_path, capsys):
    from offloadpp.cli import profile as cli_profile

    out = str(tmp_path / "hw.json")
    rc = _cli(
        cli_profile, ["--dir", str(tmp_path), "--json", out, "--size-mb", "16", "--no-io-grid", "--quick"]
    )
    assert rc == 0
    assert HardwareProfile.from_json(out).ssd_read_gbps > 0
    assert "hardware: " in capsys.readouterr().out


def test_resolve_auto_and_saved_plans(tmp_path):
    from offloadpp.assemble import resolve_for_model
    from offloadpp.planner import Machine, PlanError, Settings, save_plan
    from offloadpp.runtime import unit_specs

    model = _model(GPT2)
    specs = unit_specs(model)
    hw = _hw_json(tmp_path)
    auto = Settings(
        device_budget_bytes=1 << 30, host_budget_bytes=1 << 30, plan="auto", hardware_profile=hw, seq_len=32
    )
    r = resolve_for_model(model, auto, device="cpu")
    assert list(r.plan.units) == specs and r.estimate is not None and r.estimate.ssd_read_bytes == 0
    path = str(tmp_path / "plan.json")
    save_plan(path, r.plan, r.estimate)
    saved = resolve_for_model(model, auto.model_copy(update={"plan": path}), device="cpu")
    assert (saved.plan, saved.estimate) == (r.plan, r.estimate)
    with pytest.raises(PlanError, match="offloadpp profile"):
        resolve_for_model(
            model, auto.model_copy(update={"hardware_profile": str(tmp_path / "no.json")}), device="cpu"
        )
    cuda = Machine("cuda", host_available_bytes=8 << 30, device_free_bytes=8 << 30)
    with pytest.raises(PlanError, match="measured for device 'cpu'"):
        resolve_for_model(model, auto, machine=cuda)
    with pytest.raises(PlanError, match="model without a Hugging Face config"):
        blocks = torch.nn.Module()
        blocks.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
        resolve_for_model(blocks, auto, device="cpu")


def test_hardware_profile_several_dirs(tmp_path):
    """Each directory alone (with its free space), then all at once striped by their rates: the
    aggregate is measured, and the cost model charges at most the drives' sum."""
    from offloadpp.profiling.hardware import profile_hardware

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    hw = profile_hardware([str(d) for d in dirs], total_bytes=16 << 20, io_grid=False, quick=True)
    assert [s.path for s in hw.ssds] == [str(d) for d in dirs]
    assert all(s.read_gbps > 0 and s.free_bytes > 0 for s in hw.ssds)
    assert abs(sum(w for _, w in hw.stripe_weights()) - 1.0) < 1e-9
    r, w = hw.ssd_rates()
    assert 0 < r <= sum(s.read_gbps for s in hw.ssds) and 0 < w <= sum(s.write_gbps for s in hw.ssds)
    assert "at once" in hw.describe()
