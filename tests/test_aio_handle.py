"""AsyncIOHandle: DeepSpeed aio_handle semantics, DeepSpeed's own swappers running on it, and file
compatibility with DeepSpeed's real aio_handle (when its JIT-built op is already on disk)."""

from __future__ import annotations

import errno
import os
import threading
import time
import types

import pytest
import torch

from offloadpp.io import ALIGNMENT, AsyncIOHandle, SwapIOError


@pytest.fixture
def handle(io_backend):
    h = AsyncIOHandle(
        block_size=256 << 10,
        queue_depth=8,
        single_submit=False,
        overlap_events=True,
        intra_op_parallelism=1,
        backend=io_backend,
    )
    yield h
    h.close()


def test_constructor_and_getters():
    h = AsyncIOHandle(
        block_size=1 << 20, queue_depth=4, single_submit=True, overlap_events=True, intra_op_parallelism=2
    )
    assert h.get_block_size() == 1 << 20 and h.get_queue_depth() == 4
    assert h.get_single_submit() is True and h.get_overlap_events() is True
    assert h.get_intra_op_parallelism() == 2 and h.get_alignment() == ALIGNMENT
    assert h.wait() == 0
    h.close()
    d = AsyncIOHandle()  # DeepSpeed's defaults
    assert (d.get_block_size(), d.get_queue_depth(), d.get_intra_op_parallelism()) == (1 << 20, 128, 1)
    d.close()


@pytest.mark.parametrize("numel", [1024 * 256, 1000, 4096 + 17])  # aligned, sub-block, aligned body + tail
def test_sync_roundtrip_exact_file_size(handle, tmp_path, numel):
    src = handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=torch.float32))
    src.copy_(torch.randn(numel))
    path = str(tmp_path / "t.swp")
    assert handle.sync_pwrite(src, path) == 1
    assert os.path.getsize(path) == numel * 4  # never padded
    dst = torch.zeros(numel)
    assert handle.sync_pread(dst, path) == 1
    assert torch.equal(src, dst)
    assert handle.pwrite(src, path, True, False) == 1  # validate=True, async=False
    assert handle.pread(dst, path, True, False, 0) == 1
    assert handle.read(dst, path, False) == 0 and handle.write(src, path, False) == 0


def test_async_pattern_of_deepspeed_swap_utils(handle, tmp_path):
    from deepspeed.runtime.swap_tensor.utils import swap_in_tensors, swap_out_tensors

    # DeepSpeed's swappers carve swap tensors out of one locked buffer at 1 KiB-aligned offsets
    big = handle.new_cpu_locked_tensor(6 * 70_000, torch.empty(0, dtype=torch.float16))
    tensors = [big.narrow(0, i * 70_000, 65_536 + 512 * i) for i in range(6)]
    for i, t in enumerate(tensors):
        t.copy_(torch.randn(t.numel()).half() + i)
    assert all(handle.is_pinned(t) for t in tensors)
    paths = [str(tmp_path / f"{i}.tensor.swp") for i in range(6)]
    swap_out_tensors(handle, tensors, paths)  # asserts async_pwrite(...) == 0
    assert handle.wait() == len(tensors)
    outs = [torch.empty_like(t) for t in tensors]  # plain (unaligned) tensors work too
    swap_in_tensors(handle, outs, paths)
    assert handle.wait() == len(outs)
    assert all(torch.equal(a, b) for a, b in zip(tensors, outs))


def test_file_offsets_and_fd_overload(handle, tmp_path):
    path = str(tmp_path / "packed.swp")
    a, b = torch.arange(2048, dtype=torch.int32), torch.arange(1000, dtype=torch.int64)
    handle.sync_pwrite(a, path, 0)
    handle.sync_pwrite(b, path, 8192)
    c = torch.arange(5, dtype=torch.int8)
    fd = os.open(path, os.O_WRONLY)
    try:
        assert handle.async_pwrite(c, fd, 3) == 0  # DeepSpeed's (buffer, fd, file_offset) overload
        assert handle.wait() == 1
    finally:
        os.close(fd)
    ra, rb, rc = torch.empty_like(a), torch.empty_like(b), torch.empty_like(c)
    assert handle.async_pread(ra, path, 0) == 0 and handle.async_pread(rb, path, 8192) == 0
    assert handle.async_pread(rc, path, 3) == 0
    assert handle.wait() == 3
    expect_a = a.clone()
    expect_a.view(torch.int8)[3:8] = c
    assert torch.equal(ra, expect_a) and torch.equal(rb, b) and torch.equal(rc, c)


def test_errors(handle, tmp_path):
    t = torch.zeros(1024)
    with pytest.raises(SwapIOError) as ei:
        handle.sync_pread(t, str(tmp_path / "missing.swp"))
    assert ei.value.errno == errno.ENOENT and "missing.swp" in str(ei.value)
    path = str(tmp_path / "short.swp")
    handle.sync_pwrite(torch.zeros(100), path)
    with pytest.raises(SwapIOError) as ei:
        handle.async_pread(t, path)
    assert ei.value.errno == errno.EINVAL and "only 400 bytes" in str(ei.value)
    with pytest.raises(SwapIOError) as ei:
        handle.sync_pwrite(t, str(tmp_path / "no" / "dir.swp"))
    assert ei.value.errno == errno.ENOENT
    assert handle.wait() == 0


def test_locked_tensors():
    h = AsyncIOHandle()
    t = h.new_cpu_locked_tensor(10_000, torch.empty(0, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.numel() == 10_000 and t.data_ptr() % ALIGNMENT == 0
    assert h.is_pinned(t) and h.is_pinned(t.narrow(0, 100, 50)) and not h.is_pinned(torch.empty(10))
    assert h.free_cpu_locked_tensor(t) is True and h.free_cpu_locked_tensor(torch.empty(3)) is False
    h.close()


def test_gil_released_during_sync_pread(tmp_path):
    """DeepSpeed's test_aio_gil, in spirit: Python keeps running while a read blocks."""
    h = AsyncIOHandle(block_size=4096, queue_depth=1, backend="threadpool")  # slow on purpose
    path = str(tmp_path / "g.swp")
    buf = h.new_cpu_locked_tensor(2 << 20, torch.empty(0, dtype=torch.float32))
    h.sync_pwrite(buf, path)
    started, finished = threading.Event(), threading.Event()

    def reader():
        started.set()
        h.sync_pread(buf, path)
        finished.set()

    th = threading.Thread(target=reader)
    th.start()
    started.wait()
    ticks, t0 = 0, time.perf_counter()
    while not finished.is_set():
        ticks += 1
    elapsed = time.perf_counter() - t0
    th.join()
    h.close()
    assert elapsed > 0.01 and ticks > 10_000, f"{ticks} ticks in {elapsed:.3f} s"


def test_deepspeed_optimizer_swapper_runs_on_it(tmp_path, monkeypatch):
    """DeepSpeed's PartitionedOptimizerSwapper (and its AsyncTensorSwapper for gradients, its
    SwapBufferManager for locked buffers) with our handle in place of the JIT-built op."""
    import deepspeed.comm as dist
    from deepspeed.runtime.swap_tensor import constants as C
    from deepspeed.runtime.swap_tensor import partitioned_optimizer_swapper as pos

    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)

    class Builder:
        def load(self, verbose=False):
            return types.SimpleNamespace(aio_handle=AsyncIOHandle)

    monkeypatch.setattr(pos, "AsyncIOBuilder", Builder)
    aio = {
        C.AIO_BLOCK_SIZE: 1 << 20,
        C.AIO_QUEUE_DEPTH: 8,
        C.AIO_INTRA_OP_PARALLELISM: 1,
        C.AIO_SINGLE_SUBMIT: False,
        C.AIO_OVERLAP_EVENTS: True,
        C.AIO_USE_GDS: False,
    }
    n = 300_001  # not a multiple of DeepSpeed's 1 KiB alignment
    p = torch.nn.Parameter(torch.randn(n))
    p.ds_id = 0
    orig = p.detach().clone()
    opt = torch.optim.Adam([p])
    sw = pos.PartitionedOptimizerSwapper(
        types.SimpleNamespace(buffer_count=4), aio, str(tmp_path), opt, n, "cpu", torch.float32, None
    )
    assert isinstance(sw.aio_handle, AsyncIOHandle)
    sw.initialize_parameters(parameters=[p], src_tensors=[p.data])
    grad = torch.randn(n)
    sw.swap_out_gradients(p, gradient_offsets=[0], gradient_tensors=[grad])
    sw.swap_in_optimizer_state(p)
    state = sw._get_param_swap_info(p).get_compute_tensors()[0]
    assert torch.equal(state, orig) and torch.equal(p.grad, grad)
    state.data.add_(1.0)
    sw.swap_out_optimizer_state(p)
    sw.swap_in_optimizer_state(p)
    assert torch.equal(sw._get_param_swap_info(p).get_compute_tensors()[0], orig + 1)


def _deepspeed_aio_if_built():
    """DeepSpeed's real aio op, only if its JIT build is already on disk (building takes minutes)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        if not os.path.exists(os.path.join(_get_build_directory("async_io", False), "async_io.so")):
            return None
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return AsyncIOBuilder().load(verbose=False)
    except Exception:
        return None


def test_files_interchange_with_deepspeed_aio(tmp_path):
    ds = _deepspeed_aio_if_built()
    if ds is None:
        pytest.skip("DeepSpeed's async_io op is not built (`offloadpp bench io` builds it once)")
    theirs = ds.aio_handle(1 << 20, 8, False, True, 1)
    ours = AsyncIOHandle(1 << 20, 8, False, True, 1)
    numel = 3 * 65_536 + 256  # 1 KiB multiple, as DeepSpeed's swappers align
    a = ours.new_cpu_locked_tensor(numel, torch.empty(0))
    a.copy_(torch.randn(numel))
    ours.sync_pwrite(a, str(tmp_path / "ours.swp"))
    b = theirs.new_cpu_locked_tensor(numel, torch.empty(0))
    assert theirs.sync_pread(b, str(tmp_path / "ours.swp")) == 1 and torch.equal(a, b)
    b.mul_(2)
    theirs.sync_pwrite(b, str(tmp_path / "theirs.swp"))
    c = torch.empty(numel)
    assert ours.sync_pread(c, str(tmp_path / "theirs.swp")) == 1 and torch.equal(c, b)
    theirs.free_cpu_locked_tensor(b)
    ours.close()
