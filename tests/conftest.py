"""Shared fixtures. Keep this file small: fixtures used by one test module live in that module."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Note: DeepSpeed's ops (async_io, cpu_adam) are JIT-built by torch into TORCH_EXTENSIONS_DIR,
# guarded by a `lock` file that a killed build leaves behind; the next build then waits on it
# forever. ~/.cache is shared by every clone on a machine (CI's included), so one killed build
# anywhere hung CI once. The suite builds into this clone's own .venv instead (the Makefile
# exports the same path for the benchmarks), and clears locks whose builder is gone
# (offloadpp/integrations/deepspeed/op_locks.py, the one helper the demo and benches use too).
_REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_REPO / ".venv" / "torch_extensions"))

from offloadpp.integrations.deepspeed.op_locks import clear_stale_build_locks  # noqa: E402

# Under pytest-xdist (`make test` runs -n 2) the controller clears them once, before any worker
# starts: a worker clearing them later could take another worker's finished build for a stale one.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER is None:
    clear_stale_build_locks(
        os.environ["TORCH_EXTENSIONS_DIR"], report=lambda msg: print(msg, file=sys.stderr)
    )
else:
    # Note: each worker is a process of its own with torch's default of one intra-op thread per
    # core; two workers on two cores would each run two and fight for the cores, and OpenMP's
    # spinning threads then slow both several-fold (docs/performance.md, "Test suite time"). The
    # cores are shared out instead, to the worker and (OMP_NUM_THREADS) to the processes its tests
    # start; one set by hand is kept. Tests that set their own count (test_crash.py) still do.
    _share = len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))

    import torch

    _THREADS = int(os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(_THREADS)

    @pytest.fixture(autouse=True)
    def _threads_share_after_each_test():
        """A test may set torch's thread count for itself (the benchmarks run in-process take
        --threads, bench activations 2 by default): the worker's next test gets the share back."""
        yield
        if torch.get_num_threads() != _THREADS:
            torch.set_num_threads(_THREADS)


_PROBED: dict[str, tuple[bool, bool, str]] = {}


def _probe(name: str) -> tuple[bool, bool, str]:
    """(built, works, detail) of an I/O backend, probed once per session in a real temp dir."""
    if name not in _PROBED:
        from offloadpp import _C

        with tempfile.TemporaryDirectory() as d:
            _, built, works, _, detail = _C.probe_backend(name, d, True)
        _PROBED[name] = (built, works, detail)
    return _PROBED[name]


@pytest.fixture(params=["libaio", "io_uring", "threadpool"])
def io_backend(request) -> str:
    """Each I/O backend in turn; skipped where it is not built or does not work here."""
    built, works, detail = _probe(request.param)
    if not built:
        pytest.skip(f"{request.param} not built: {detail}")
    if not works:
        pytest.skip(f"{request.param} does not work here: {detail}")
    return request.param


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (O_DIRECT works on tmpfs since Linux 6.6) for ENOSPC tests; needs root."""
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        from offloadpp import _C

        _, _, works, _, detail = _C.probe_backend("threadpool", str(mnt), True)
        if not works:
            pytest.skip(f"O_DIRECT does not work on tmpfs here: {detail}")
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _cuda_available() -> bool:
    from offloadpp.runtime.accel.cuda import available

    return available()


@pytest.fixture(
    params=[
        "cpu",
        "standin",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")],
        ),
    ]
)
def on_device(request, monkeypatch) -> str:
    """The test on the CPU acting as the device, then on the stand-in accelerator
    (runtime/accel/standin.py: OFFLOADPP_DEVICE=standin turns every "cpu" engine and activation
    manager of the test into one taking the GPU's copy path, with its streams' asynchrony), and
    where a GPU is, on CUDA (OFFLOADPP_DEVICE=cuda: `-m cuda`, scripts/gpu_check.sh).
    scripts/standin_mutations.py runs the `standin` cases."""
    set_device(monkeypatch, request.param)
    return request.param


def set_device(monkeypatch, device: str) -> None:
    """The test's "cpu" engines and managers on `device`: "cpu", "standin" or "cuda"
    (on_device's Note); for tests that take the stand-in in a few of their parametrized cases only."""
    if device == "cpu":
        monkeypatch.delenv("OFFLOADPP_DEVICE", raising=False)
    else:
        monkeypatch.setenv("OFFLOADPP_DEVICE", device)
