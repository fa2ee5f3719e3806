"""runtime/accel/: the accelerator interface, its selection, and the stand-in's guarantees; and
the tree read for device branches outside it (as tests/test_layers.py reads imports)."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest
import torch

from offloadpp.runtime.accel import (
    StandinAccelerator,
    StandinRaceError,
    accelerator,
    effective_spec,
    plan_device,
)
from offloadpp.runtime.accel.cpu import CpuAccelerator
from offloadpp.runtime.accel.standin_stream import Item, StandinUseAfterFreeError

ROOT = Path(__file__).resolve().parent.parent / "offloadpp"
ACCEL = ROOT / "runtime" / "accel"


def _device_branches(path: Path) -> list[str]:
    """`is_cuda`, `torch.cuda` (also as `x._torch.cuda`), and imports of torch.cuda in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            if node.attr == "is_cuda":
                out.append(f"{path.name}:{node.lineno}: is_cuda")
            elif node.attr == "cuda" and isinstance(node.value, (ast.Name, ast.Attribute)):
                base = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
                if base in ("torch", "_torch"):
                    out.append(f"{path.name}:{node.lineno}: {base}.cuda")
        elif isinstance(node, ast.Import):
            out += [
                f"{path.name}:{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith("torch.cuda")
            ]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("torch.cuda") or (
                node.module == "torch" and any(a.name == "cuda" for a in node.names)
            ):
                out.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "torch.cuda." in node.value:
            out.append(f"{path.name}:{node.lineno}: a string calling torch.cuda")
    return out


def test_no_device_branch_outside_the_accelerators():
    found = [hit for p in sorted(ROOT.rglob("*.py")) if ACCEL not in p.parents for hit in _device_branches(p)]
    assert found == [], (
        "name the device through runtime/accel/ (its properties), not torch.cuda/is_cuda:\n"
        + "\n".join(found)
    )


def test_the_tree_reader_sees_each_spelling(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(
        "import torch\nimport torch.cuda\nfrom torch import cuda\nx = t.is_cuda\ntorch.cuda.synchronize()\n"
        "self._torch.cuda.synchronize()\n"
    )
    assert len(_device_branches(p)) == 5


# ---- selection ---------------------------------------------------------------------------------
def test_env_selects_the_standin_for_none_and_cpu_never_for_cuda(monkeypatch):
    monkeypatch.setenv("OFFLOADPP_DEVICE", "standin")
    assert effective_spec(None) == effective_spec("cpu") == "standin"
    assert effective_spec("cuda:1") == "cuda:1"
    monkeypatch.setenv("OFFLOADPP_DEVICE", "cuda")  # (the CPU device's tests on a GPU: on_device)
    assert effective_spec("cpu") == effective_spec(None) == "cuda" and plan_device("cpu") == "cuda"
    assert plan_device("cpu") == "cuda"  # (memory of its own: planned as a device's)
    monkeypatch.setenv("OFFLOADPP_DEVICE", "tpu")
    with pytest.raises(ValueError, match="OFFLOADPP_DEVICE must be"):
        effective_spec(None)
    monkeypatch.delenv("OFFLOADPP_DEVICE")
    assert effective_spec("cpu") == "cpu" and plan_device("cpu") == "cpu"


def test_standin_says_so_with_its_seed(monkeypatch, capsys):
    monkeypatch.setenv("OFFLOADPP_DEVICE", "standin")
    monkeypatch.setenv("OFFLOADPP_STANDIN_SEED", "77")
    a = accelerator("cpu")
    try:
        assert isinstance(a, StandinAccelerator) and a.copies and a.seed == 77
        assert "device=standin seed=77" in capsys.readouterr().err
    finally:
        a.close()


def test_cpu_device_copies_nothing():
    a = CpuAccelerator()
    assert not a.copies and a.plan_device == "cpu"
    s = a.new_stream()
    dst, src = torch.zeros(4), torch.arange(4.0)
    a.copy(dst, src, s)
    assert torch.equal(dst, src) and a.record(s).done()  # done when issued


# ---- the stand-in's guarantees -------------------------------------------------------------------
@pytest.fixture
def standin():
    a = StandinAccelerator(seed=5, delay_ms=20.0, capacity_bytes=1 << 16, skip="")
    yield a
    a.close()


def test_copies_are_real_late_and_ordered_by_events(standin):
    a = standin
    h2d = a.new_stream()
    host = torch.arange(16.0)
    dev = a.empty(16, torch.float32, h2d)
    assert dev.data_ptr() != host.data_ptr() and torch.isnan(dev).all()  # fresh device memory: NaN
    a.copy(dev, host, h2d)
    ev = a.record(h2d)
    assert not ev.done() and torch.isnan(dev).all()  # queued, not run: a missing wait reads NaN
    a.wait_event(a.compute_stream(), ev, site="test.use")
    assert ev.done() and torch.equal(dev, host)
    host.zero_()
    assert torch.equal(dev, torch.arange(16.0))  # its own memory


def test_a_stream_runs_in_order_and_waits_for_another(standin):
    a = standin
    s1, s2 = a.new_stream(), a.new_stream()
    x = a.empty(4, torch.float32, s1)
    y = a.empty(4, torch.float32, s2)
    ones, twos = torch.ones(4), torch.full((4,), 2.0)  # (the host keeps what a queued copy reads)
    a.copy(x, ones, s1)
    a.copy(x, twos, s1)
    a.wait_stream(s2, s1, site="test.s2_after_s1")
    a.copy(y, x, s2)  # reads x only after s1's two copies
    a.synchronize(a.record(s2), site="test.sync")
    assert torch.equal(y, torch.full((4,), 2.0))


def test_freed_memory_is_reused_only_after_its_streams_pass(standin):
    a = standin
    h2d = a.new_stream()
    dev, ones = a.empty(8, torch.float32, h2d), torch.ones(8)
    a.copy(dev, ones, h2d)
    a.record_use(dev, h2d, site="test.keep")
    a.free(dev, site="test.free")
    again = a.empty(8, torch.float32)
    assert again.data_ptr() != dev.data_ptr()  # the copy still writes it: not handed out
    a.synchronize(a.record(h2d), site="test.sync")
    a.free(again, site="test.free")
    reused = a.empty(8, torch.float32)
    assert reused.data_ptr() in (dev.data_ptr(), again.data_ptr()) and torch.isnan(reused).all()


def test_a_skipped_free_reclaims_at_once():
    a = StandinAccelerator(seed=5, delay_ms=20.0, skip="test.free")
    try:
        h2d = a.new_stream()
        dev, ones = a.empty(8, torch.float32, h2d), torch.ones(8)
        a.copy(dev, ones, h2d)
        a.record_use(dev, h2d, site="test.keep")
        a.free(dev, site="test.free")
        assert a.empty(8, torch.float32).data_ptr() == dev.data_ptr() and a.skipped == {"test.free": 1}
    finally:
        a.close()


def test_capacity_raises_like_cuda_oom(standin):
    held = standin.empty(1 << 13, torch.float32)  # 32 KiB of 64
    with pytest.raises(torch.OutOfMemoryError, match="stand-in device out of memory"):
        standin.empty((1 << 13) + 1, torch.float32)
    del held  # (dropped: its memory is free again)
    standin.empty((1 << 13) + 1, torch.float32)


def test_a_copy_overtaking_compute_is_a_race(standin):
    a = standin
    h2d, compute = a.new_stream(), a.compute_stream()
    dev = a.empty(4, torch.float32, h2d)
    a.record_use(dev, compute)  # compute reads it
    ones = torch.ones(4)
    with pytest.raises(StandinRaceError, match="missing wait_stream"):
        a.copy(dev, ones, h2d)  # a refresh in place, without waiting for compute
    a.wait_stream(h2d, compute, site="test.after_compute")
    a.copy(dev, ones, h2d)


def test_a_device_to_host_copy_waits_for_compute(standin):
    a = standin
    d2h = a.new_stream()
    produced = torch.randn(4)  # compute's output
    a.empty(1, torch.float32)  # compute goes on
    with pytest.raises(StandinRaceError):
        a.copy(torch.empty(4), produced, d2h)


def test_memory_freed_before_its_stream_gets_there_is_caught(standin):
    a = standin
    d2h, h2d = a.new_stream(), a.new_stream()
    a.wait_stream(d2h, a.compute_stream(), site="test.after_compute")
    host = torch.zeros(1 << 10)
    a.copy(host, torch.randn(1 << 10), d2h)  # nothing keeps the source (no record_use)
    a.synchronize(a.record(d2h), site="test.sync")
    assert torch.isnan(host).all()  # someone else's bytes
    a.copy(a.empty(1 << 10, torch.float32, h2d), host, h2d)  # nor the destination
    with pytest.raises(RuntimeError, match="work on a stream failed") as e:
        a.synchronize(a.record(h2d), site="test.sync")
    assert isinstance(e.value.__cause__, StandinUseAfterFreeError)


def test_the_delays_are_seeded():
    def trace(seed):
        a = StandinAccelerator(seed=seed, delay_ms=5.0, skip="")
        s = a.new_stream()
        out = s.rng.random()
        a.close()
        return out

    assert trace(3) == trace(3) != trace(4)


def test_compute_waits_block_the_caller_until_the_stream_gets_there(standin):
    a = standin
    s = a.new_stream()
    gate = threading.Event()
    out = torch.zeros(1)
    a.run_on(s, lambda: None, out=out)
    s.submit(Item(lambda _: gate.wait()))
    ev = a.record(s)
    threading.Timer(0.1, gate.set).start()
    t0 = time.perf_counter()
    a.wait_event(a.compute_stream(), ev, site="test.use")
    assert time.perf_counter() - t0 >= 0.09 and ev.done()


@pytest.mark.parametrize("host_waited", [False, True])
def test_a_skipped_host_wait_the_host_did_not_know_done_spoils_the_copy(host_waited):
    """Compute waiting for a copy blocks the stand-in's caller, yet teaches the host nothing (on
    a GPU it would not have waited): a host wait skipped there (a pool's `after`) lets the host
    reuse the copy's source before the copy has read it, taken at its worst: the copy delivers
    NaN. Had the host waited for the copy before, nothing is spoiled."""
    a = StandinAccelerator(seed=5, delay_ms=5.0, skip="test.reuse")
    try:
        h2d = a.new_stream()
        host = torch.ones(8)
        dev = a.empty(8, torch.float32, h2d)
        a.copy(dev, host, h2d)
        ev = a.record(h2d)
        a.wait_event(a.compute_stream(), ev, site="test.use")
        assert torch.equal(dev, host)  # compute reads the copy
        if host_waited:
            a.synchronize(ev, site="test.sync")
        assert a.after(ev, site="test.reuse").done() and a.skipped == {"test.reuse": 1}
        assert torch.isnan(dev).all() != host_waited
    finally:
        a.close()


def test_a_collectives_result_lands_in_stream_order(standin):
    a = standin
    s = a.new_stream()
    out = a.empty(4, torch.float32, s)
    a.run_on(s, lambda: out.fill_(3.0), out=out)  # (on the caller, as gloo's are)
    assert torch.isnan(out).all()  # not there before the stream gets to it
    a.synchronize(a.record(s), site="test.sync")
    assert torch.equal(out, torch.full((4,), 3.0))
