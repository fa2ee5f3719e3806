"""The swap directory belongs to one run: a live holder refuses a second engine (naming its pid),
a dead holder's lock is taken over with a message, stale swap files are removed and reported,
and an engine dropped without close() leaves no thread, descriptor or lock behind."""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

from offloadpp.io import SwapDirBusyError, SwapDirLock, TensorStore
from offloadpp.io.lock import LOCK_NAME, holder_of

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _engine(path):
    from offloadpp.assemble import assemble_engine
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    rc = RuntimeConfig(
        nvme_paths=[str(path)], settings=Settings(), device="cpu", ssd_read_gbps=1.0, ssd_write_gbps=1.0
    )
    return assemble_engine(transformers.GPT2LMHeadModel(cfg), rc)


def _step(eng):
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    eng.backward(eng(input_ids=x, labels=x).loss)
    eng.step()


def test_second_engine_on_the_same_directory_is_refused(tmp_path):
    with _engine(tmp_path) as first:
        _step(first)
        with pytest.raises(
            SwapDirBusyError, match=rf"in use by process {os.getpid()}.*one run per swap directory"
        ):
            _engine(tmp_path)
        _step(first)  # the refused one touched nothing
    with _engine(tmp_path) as again:  # closed: free again
        _step(again)


def test_live_holder_in_another_process_is_named(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from offloadpp.io import SwapDirLock
        lock = SwapDirLock([{str(tmp_path)!r}])
        print("locked", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert holder_of(str(tmp_path))["pid"] == proc.pid
        with pytest.raises(SwapDirBusyError, match=f"process {proc.pid}"):
            SwapDirLock([str(tmp_path)])
        proc.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the flock
        proc.wait()
        assert holder_of(str(tmp_path)) is None
        with SwapDirLock([str(tmp_path)]) as lock:
            assert any(f"process {proc.pid}" in m and "no longer running" in m for m in lock.taken_over)
    finally:
        proc.kill()
        proc.wait()


def test_stale_swap_files_are_removed_and_reported(tmp_path, caplog):
    with TensorStore([str(tmp_path)]) as s:  # an earlier run's state, left behind
        s.put("unit3.exp_avg", torch.ones(1 << 20)).wait()
    (tmp_path / "notes.txt").write_text("not ours")
    with caplog.at_level(logging.WARNING, logger="offloadpp.runtime"):
        with _engine(tmp_path) as eng:
            assert "unit3.exp_avg" not in eng.store.keys()  # never read as state
            _step(eng)
    assert any("removed 1 stale swap files" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "notes.txt").read_text() == "not ours"  # only swap files go


def test_engine_dropped_without_close_leaks_nothing(tmp_path):
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def run(i: int) -> weakref.ref:
        eng = _engine(tmp_path / str(i))
        _step(eng)
        return weakref.ref(eng)

    (tmp_path / "0").mkdir()
    ref = run(0)  # warm-up: torch and the I/O engine open what they keep for the process
    gc.collect()
    assert ref() is None
    threads, files = threading.active_count(), fds()
    for i in range(1, 4):
        (tmp_path / str(i)).mkdir()
        ref = run(i)
        gc.collect()
        assert ref() is None, "the engine is still reachable after it was dropped"
        assert holder_of(str(tmp_path / str(i))) is None  # its lock was released
    # executor threads exit asynchronously once shut down: poll for them against a deadline
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= threads and fds() <= files


def test_lock_file_is_in_the_swap_directory(tmp_path):
    with SwapDirLock([str(tmp_path)]):
        assert (tmp_path / LOCK_NAME).exists()


def test_init_train_close_cycles_leave_the_process_and_the_folders_as_they_were(tmp_path):
    """scripts/init_close_cycles.py (the 20-cycle bar) with fewer cycles: after each close()
    no descriptor is left open, no swap file on disk, nothing new in /dev/shm (the run sets
    LOCAL_SIZE as the deepspeed launcher does), threads and RSS as after the first cycle."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "init_close_cycles.py")
    # (a fresh plain-python process: not the launch variables this suite's own process group set,
    # whose port that group's store still holds)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    r = subprocess.run([sys.executable, script, "--cycles", "4", "--dir", str(tmp_path / "nvme"),
                        "--rss-tolerance", "0.04"], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0 and "cycles: ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("keep", [False, True])
def test_close_removes_the_swap_files_unless_keep_swap(tmp_path, keep):
    from test_deepspeed_integration import batches, ds_config, tiny_gpt2

    import offloadpp

    cfg = ds_config(tmp_path / "nvme")
    if keep:
        cfg["offloadpp"]["keep_swap"] = True
    eng, *_ = offloadpp.initialize(model=tiny_gpt2(), config=cfg)
    b = batches(1)[0]
    eng.backward(eng(b, labels=b).loss)
    eng.step()
    swap = tmp_path / "nvme" / "offloadpp"
    files = sorted(swap.glob("*.oswp"))
    assert files
    eng.close()
    left = sorted(swap.glob("*.oswp"))
    assert bool(left) == keep and all(p.name.endswith(".oswp") for p in left)
    assert holder_of(str(swap)) is None
