"""A build lock of DeepSpeed's JIT-built ops that its builder left (killed mid-build) is found
and removed with what that build wrote; a live build's lock is named, never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from offloadpp.integrations.deepspeed.op_locks import build_locks, clear_stale_build_locks

# The way torch's FileBaton takes the lock: O_CREAT|O_EXCL, the descriptor held while it builds.
_BUILDER = "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('locked', flush=True); time.sleep(600)"


def _builder(lock):
    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _op_folder(root):
    op = root / "py311_cpu" / "async_io"
    op.mkdir(parents=True)
    (op / "async_io.so").write_bytes(b"an earlier, complete build")
    past = time.time() - 3600
    os.utime(op / "async_io.so", (past, past))
    return op


def test_a_lock_whose_builder_was_killed_is_removed_with_what_it_built(tmp_path):
    op = _op_folder(tmp_path)
    proc = _builder(op / "lock")
    (op / "deepspeed_py_aio.o").write_bytes(b"half written")
    proc.kill()
    proc.wait()
    (lock,) = build_locks(str(tmp_path))
    assert lock.op == "async_io" and lock.holders == () and lock.stale
    said = []
    assert [x.path for x in clear_stale_build_locks(str(tmp_path), report=said.append)] == [str(op / "lock")]
    assert sorted(os.listdir(op)) == ["async_io.so"]  # the earlier build's output stays
    assert "stale build lock of DeepSpeed's async_io op" in said[0] and "interrupted" in said[0]
    assert build_locks(str(tmp_path)) == []


def test_a_live_build_is_named_and_left_alone(tmp_path):
    op = _op_folder(tmp_path)
    proc = _builder(op / "lock")
    try:
        said = []
        assert clear_stale_build_locks(str(tmp_path), report=said.append) == []
        assert (op / "lock").exists() and f"being built by process {proc.pid}" in said[0]
    finally:
        proc.kill()
        proc.wait()


def test_build_ops_clears_stale_locks_then_loads_each_op_as_its_first_use(tmp_path, monkeypatch):
    """build_ops (`make setup`): a lock left by a killed build is cleared before any op is loaded
    (else the load would wait on it forever), each op goes through DeepSpeed's own builder, and a
    build that fails is raised with what it printed."""
    from deepspeed.ops import op_builder

    from offloadpp.integrations.deepspeed.op_locks import build_ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    op = _op_folder(tmp_path)
    proc = _builder(op / "lock")
    proc.kill()
    proc.wait()
    loaded = []

    def builder(name, fails=False):
        class Builder:
            def load(self, verbose=False):
                assert not (op / "lock").exists()  # cleared first
                print(f"compiling {name}")
                if fails:
                    raise RuntimeError(f"Error building extension '{name}'")
                loaded.append(name)

        return Builder

    monkeypatch.setattr(op_builder, "CPUAdamBuilder", builder("cpu_adam"))
    monkeypatch.setattr(op_builder, "AsyncIOBuilder", builder("async_io"))
    said = []
    assert set(build_ops(("cpu_adam", "async_io"), report=said.append)) == {"cpu_adam", "async_io"}
    assert loaded == ["cpu_adam", "async_io"]
    assert "stale build lock" in said[0] and f"async_io op ready in {tmp_path}" in said[-1]
    assert not any("compiling" in s for s in said)  # quiet when it works

    monkeypatch.setattr(op_builder, "AsyncIOBuilder", builder("async_io", fails=True))
    said.clear()
    with pytest.raises(RuntimeError, match="Error building extension 'async_io'"):
        build_ops(("async_io",), report=said.append)
    assert said == ["compiling async_io\n"]
