"""scripts/lora_scale.py at a toy size: both sides (offloadpp and ZeRO-Infinity) train LoRA in
child processes, and the memory guard kills a side past its limit and says where it was."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = ["--layers", "2", "--hidden", "1024", "--inter", "2048", "--heads", "4", "--vocab", "512"]


def _run(tmp_path, *extra):
    out = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "lora_scale.py"), "--dir", str(tmp_path / "w")]
    proc = subprocess.run([*cmd, *TOY, "--json", str(out), *extra], cwd=ROOT, capture_output=True, text=True)
    assert out.exists(), proc.stderr[-3000:]
    return proc.returncode, {o["side"]: o for o in json.loads(out.read_text())}


@pytest.mark.slow
def test_both_sides_train_three_steps(tmp_path):
    rc, r = _run(tmp_path, "--zero")
    assert rc == 0
    for side in ("offloadpp", "zero"):
        assert r[side]["phase"] == "done" and "failed" not in r[side]
        assert len(r[side]["steps"]) == 3 and 0 < r[side]["peak_rss_gib"] < 4
    assert r["offloadpp"]["adapters_reloaded_equal"]
    assert r["zero"]["disk_bytes"] > 0  # the base went to ZeRO's NVMe swap
    assert not (tmp_path / "w").exists()


def test_guard_kills_a_side_and_says_where(tmp_path):
    rc, r = _run(tmp_path, "--only-zero", "--max-rss-gib", "0.3")
    z = r["zero"]
    assert rc == 0 and z["exit_status"] != 0 and "steps" in z and not z["steps"]
    assert z["failed"].startswith("killed at ") and " during " in z["failed"]
