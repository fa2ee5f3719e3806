"""The `offloadpp` command line: doctor's verdict and the lazy wiring of subcommands."""

import json
import os
import subprocess
import sys

import pytest

from offloadpp.cli.main import BENCHES, COMMANDS, main


def test_doctor_ok_on_a_writable_dir(tmp_path, capsys):
    out_json = tmp_path / "doctor.json"
    assert main(["doctor", "--dir", str(tmp_path / "swap"), "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    probes = report["dirs"][str(tmp_path / "swap")]
    assert any(p["works"] for p in probes)
    assert report["simd"]["active"] in ("scalar", "avx2", "avx512")
    assert "threadpool" in capsys.readouterr().out


def test_doctor_fails_plainly_when_the_dir_cannot_exist(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["doctor", "--dir", str(blocker / "swap")]) == 1
    assert "cannot use" in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a filesystem without O_DIRECT")
def test_doctor_fails_when_no_backend_works(tmp_path, capsys):
    # A read-only bind mount: the probe's write fails on every backend.
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts not permitted here")
    try:
        assert main(["doctor", "--dir", str(ro)]) == 1
        assert "no I/O backend works" in capsys.readouterr().out
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_every_command_module_exists_and_has_the_interface():
    import importlib

    for module, _ in list(COMMANDS.values()) + list(BENCHES.values()):
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.run), module


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "offloadpp", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "doctor" in r.stdout
