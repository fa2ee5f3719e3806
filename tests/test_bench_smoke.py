"""Every benchmark that runs the engine, on a toy size: it runs through the resolve stage, writes
its JSON and prints its table. The numbers are the benchmarks' business (docs/performance.md);
this only keeps the commands working."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("transformers")


def _run(module, argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return module.run(p.parse_args(argv))


def test_bench_step_smoke(tmp_path, capsys):
    from offloadpp.bench import step

    out = tmp_path / "step.json"
    _run(step, ["--model", "gpt2-tiny", "--steps", "2", "--warmup", "1", "--block", "1", "--threads", "1",
                "--dir", str(tmp_path / "swap"), "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["offloadpp"]["ssd_read_bytes"] > 0 and report["ratio_vs_torch"] > 0
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
    assert "peak RSS" in capsys.readouterr().out
