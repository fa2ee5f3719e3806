"""Every benchmark that runs the engine, on a toy size: it runs through the resolve stage, writes
its JSON and prints its table. The numbers are the benchmarks' business (docs/performance.md);
this only keeps the commands working."""

from __future__ import annotations

import argparse
import json
import os

import pytest

pytest.importorskip("transformers")


def _run(module, argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return module.run(p.parse_args(argv))


@pytest.mark.parametrize("clip", ["0", "1000"])
def test_bench_step_smoke(tmp_path, capsys, clip):
    from offloadpp.bench import step

    out = tmp_path / "step.json"
    # (2 warm-up steps: with clipping, "auto" speculates once two steps stayed within the limit)
    _run(step, ["--model", "gpt2-tiny", "--steps", "2", "--warmup", "2", "--block", "1", "--threads", "1",
                "--dir", str(tmp_path / "swap"), "--json", str(out), "--clip", clip, "--vs-unclipped"])  # fmt: skip
    report = json.loads(out.read_text())
    o = report["offloadpp"]
    assert o["ssd_read_bytes"] > 0 and report["ratio_vs_torch"] > 0 and o["optimizer_exposed_s"] > 0
    if clip == "0":
        assert o["updates"] == {"in-backward": 2} and "unclipped" not in report
    else:  # a limit the norms stay within: every update speculative and validated
        assert o["updates"] == {"speculative": 2} and o["redone_steps"] == 0 and o["grad_norm_max"] < 1000
        u = report["unclipped"]  # (--vs-unclipped: the same run without clipping, side by side)
        assert len(u["steps"]) == 2 and u["step_ratio"] > 0 and u["exposed_ratio"] > 0
    assert "| offloadpp (all state on SSD) |" in capsys.readouterr().out


def test_bench_capacity_smoke(tmp_path, capsys):
    from offloadpp.bench import capacity

    out = tmp_path / "cap.json"
    rc = _run(capacity, ["--layers", "2", "--width", "64", "--heads", "2", "--steps", "2", "--threads", "1",
                         "--checkpoint", "--dir", str(tmp_path / "work"), "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    o = report["offloadpp"]
    assert rc == 0 and report["pass"] and len(o["step_s"]) == 2 and o["peak_rss_bytes"] > 0
    assert o["checkpoint"]["bit_identical"] and o["checkpoint"]["save_s"] > 0
    assert (
        set(o["phase_peak_rss"]) >= {"steps", "save", "load", "export"} and o["accounted_peaks"]["device"] > 0
    )
    assert o["peak_rss_bytes"] >= max(o["phase_peak_rss"].values())  # the phases' resets do not hide a peak
    assert "peak RSS by phase" in capsys.readouterr().out


def test_bench_capacity_export_smoke(tmp_path, capsys):
    """--export: save_16bit_model (default name) and a Trainer's save_model of the trained engine;
    --export-checkpoint: `offloadpp export` of a checkpoint in a process of its own after the run;
    each loaded back with from_pretrained in a process of their own, their logits compared."""
    from offloadpp.bench import capacity

    out = tmp_path / "cap.json"
    rc = _run(capacity, ["--layers", "2", "--width", "64", "--heads", "2", "--steps", "1", "--threads", "1",
                         "--export", "--export-checkpoint", "--dir", str(tmp_path / "work"), "--json", str(out)])  # fmt: skip
    cli = json.loads(out.read_text())["cli_export"]
    assert cli["exit_status"] == 0 and 0 < cli["peak_rss_bytes"] < 8 << 30
    assert cli["files"] == ["config.json", "model.safetensors"]
    assert json.loads(out.read_text())["verify"]["offloadpp_export"]["close"]
    report = json.loads(out.read_text())
    e, v = report["offloadpp"]["export"], report["verify"]
    assert rc == 0 and report["pass"]
    assert (
        "pytorch_model.bin" in e["save_16bit_model"]["files"]
        and "config.json" in e["trainer_save_model"]["files"]
    )
    assert v["save_16bit_model"]["close"] and v["trainer_save_model"]["close"] and e["page_cache"]["s"] > 0
    assert {"save_16bit_model", "trainer save_model"} <= set(report["offloadpp"]["phase_peak_rss"])
    text = capsys.readouterr().out
    assert "give the engine's logits: PASS" in text and "`offloadpp export` peak RSS" in text


def test_bench_planner_scale_smoke(tmp_path, capsys):
    """The paper-scale planning benchmark: 175B plans at batch 8, 16 and 32 (the paper's system
    runs out of memory at 32; here a partial block's backward holds one piece, its GELU saving
    only its input) and is refused at 64 with the largest micro-batch that would fit."""
    from offloadpp.bench import planner_scale

    out = tmp_path / "scale.json"
    assert _run(planner_scale, ["--only", "175b", "--dtype", "bf16", "--json", str(out)]) == 0
    rows = {r["micro_batch"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[8]["step_s"] > 0 and rows[16]["step_s"] > 0 and rows[32]["step_s"] > 0
    assert "refused" in rows[64] and 32 <= rows[64]["largest_micro_batch"] < 64
    assert "| GPT-3 175B | 64 | bf16 | refused" in capsys.readouterr().out


def test_bench_planner_scale_counts_every_micro_batch_of_a_window(tmp_path):
    """With gradient_accumulation_steps 4 the estimate is a window's time: its model TFLOPS count
    the four micro-batches' FLOPs (they counted one, and showed a quarter of the throughput)."""
    from offloadpp.bench import planner_scale

    rows = {}
    for cfg in ("ds_config.json", "ds_config_g4.json"):
        out = tmp_path / f"{cfg}.out.json"
        args = ["--only", "13b", "--dtype", "fp16", "--batches", "8", "--json", str(out),
                "--config", os.path.join("docs", "paper", cfg)]  # fmt: skip
        assert _run(planner_scale, args) == 0
        rows[cfg] = json.loads(out.read_text())["rows"][0]
    one, four = rows["ds_config.json"], rows["ds_config_g4.json"]
    assert (one["micro_batches_per_step"], four["micro_batches_per_step"]) == (1, 4)
    flops_one, flops_four = one["tflops"] * one["step_s"], four["tflops"] * four["step_s"]
    assert flops_four == pytest.approx(4 * flops_one, rel=1e-9)
