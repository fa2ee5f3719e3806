"""The C++ engine through offloadpp._C and offloadpp.io: round trips on every backend, splitting,
short transfers, errors (alignment, EOF, ENOSPC, EIO, permissions), probing, GIL release."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch

from offloadpp import _C
from offloadpp.io import (
    ALIGNMENT,
    IOConfig,
    SwapIOError,
    aligned_empty,
    build_info,
    is_managed,
    probe_backends,
    resolve_backend,
)

MiB = 1 << 20


def _buf(nbytes: int, seed: int = 0) -> tuple[_C.AlignedBuffer, np.ndarray]:
    b = _C.AlignedBuffer(nbytes)
    a = np.frombuffer(b, dtype=np.uint8)[:nbytes]
    a[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return b, a


def _open(path, direct=True):
    return _C.File(str(path), read=True, write=True, create=True, direct=direct)


def test_build_info_and_constants():
    info = build_info()
    assert info["threadpool"] is True
    assert info["alignment"] == ALIGNMENT == _C.ALIGNMENT == 4096
    assert set(info["backends"]) == {"libaio", "io_uring", "threadpool"}


def test_crc32c_known_value():
    b = _C.AlignedBuffer(9)
    np.frombuffer(b, dtype=np.uint8)[:9] = np.frombuffer(b"123456789", dtype=np.uint8)
    assert _C.crc32c(b.ptr, 9) == 0xE3069283
    # chaining: crc(a + b) == crc(b, seed=crc(a))
    assert _C.crc32c(b.ptr + 4, 5, _C.crc32c(b.ptr, 4)) == 0xE3069283


@pytest.mark.parametrize("n", [3 * 4096, 3 * 4096 + 5, 1 << 20, (1 << 20) + 4093])
def test_crc32c_of_a_large_buffer_equals_its_pieces_chained(n):
    """A large buffer's CRC runs as three interleaved streams joined after (aligned_buffer.cpp);
    it must equal the CRC of the same bytes fed in pieces below that size, one stream each."""
    b = _C.AlignedBuffer(n)
    np.frombuffer(b, dtype=np.uint8)[:n] = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    crc, off = 0, 0
    while off < n:
        piece = min(4093, n - off)  # odd sizes: every tail path too
        crc = _C.crc32c(b.ptr + off, piece, crc)
        off += piece
    assert _C.crc32c(b.ptr, n) == crc
    assert _C.crc32c(b.ptr + 1, n - 1) == _C.crc32c(
        b.ptr + 1 + 4096, n - 1 - 4096, _C.crc32c(b.ptr + 1, 4096)
    )


def test_probe_backends(tmp_path):
    probes = probe_backends(str(tmp_path))
    assert [p.name for p in probes] == ["libaio", "io_uring", "threadpool"]
    tp = probes[-1]
    assert tp.available and tp.works, tp.detail
    assert "O_DIRECT" in tp.detail
    assert not [f for f in os.listdir(tmp_path)]  # the probe file is removed
    missing = probe_backends(str(tmp_path / "nope"))
    assert not any(p.works for p in missing)
    assert all(p.errno == errno.ENOENT for p in missing if p.available)
    with pytest.raises(SwapIOError) as ei:
        resolve_backend(IOConfig(), str(tmp_path / "nope"))
    assert ei.value.errno == errno.ENOENT and "nope" in str(ei.value)
    assert resolve_backend(IOConfig(), str(tmp_path)) in ("libaio", "io_uring", "threadpool")


@pytest.mark.parametrize(
    "nbytes,block,qd", [(4096, MiB, 8), (3 * MiB + 8192, MiB, 8), (5 * MiB, 256 << 10, 3)]
)
def test_roundtrip(io_backend, tmp_path, nbytes, block, qd):
    eng = _C.Engine(io_backend, block, qd, 1)
    f = _open(tmp_path / "x.bin")
    src, a = _buf(nbytes, 1)
    dst, b = _buf(nbytes, 2)
    h = eng.write(f, src.ptr, nbytes, 0)
    assert h.wait() == nbytes and h.done() and h.is_write
    assert f.size() == nbytes
    h = eng.read(f, dst.ptr, nbytes, 0)
    assert h.wait() == nbytes
    assert np.array_equal(a, b)
    s = eng.stats()
    assert s["bytes_read"] == s["bytes_written"] == nbytes and s["write_seconds"] > 0
    eng.close()


def test_reads_overtake_queued_writes(io_backend, tmp_path):
    """A read submitted behind a long queue of writes is served next, not after them: the
    runtime's fetches must not wait for the state written at the end of a step."""
    eng = _C.Engine(io_backend, MiB, 1, 1)  # one block in flight: the order is the engine's alone
    small = _open(tmp_path / "small.bin")
    src, a = _buf(MiB, 1)
    eng.write(small, src.ptr, MiB, 0).wait()
    big = _open(tmp_path / "big.bin")
    wsrc, _ = _buf(128 * MiB, 2)
    w = eng.write(big, wsrc.ptr, 128 * MiB, 0)
    dst, b = _buf(MiB, 3)
    r = eng.read(small, dst.ptr, MiB, 0)
    assert r.wait() == MiB and np.array_equal(a, b)
    assert not w.done(), "the read waited for all 128 queued write blocks"
    assert w.wait() == 128 * MiB
    eng.close()


def test_many_in_flight_and_threads(io_backend, tmp_path):
    eng = _C.Engine(io_backend, 64 << 10, 4, 2)  # 2 workers, each with its own kernel queue
    files = [_open(tmp_path / f"f{i}.bin") for i in range(4)]
    bufs = [_buf((i % 5 + 1) * 12288 + 4096 * (i % 3), i) for i in range(24)]
    handles, offset = [], [0] * 4
    for i, (b, a) in enumerate(bufs):
        handles.append(eng.write(files[i % 4], b.ptr, a.size, offset[i % 4]))
        offset[i % 4] += a.size
    assert eng.outstanding <= 24
    eng.wait_all()
    assert all(h.done() for h in handles) and eng.outstanding == 0
    offset = [0] * 4
    outs = []
    for i, (_, a) in enumerate(bufs):
        o, arr = _buf(a.size, 99)
        outs.append((o, arr))
        handles.append(eng.read(files[i % 4], o.ptr, a.size, offset[i % 4]))
        offset[i % 4] += a.size
    for h in handles:
        h.wait()
    for (_, a), (_, arr) in zip(bufs, outs):
        assert np.array_equal(a, arr)


def test_alignment_checked_at_the_boundary(tmp_path):
    eng = _C.Engine("threadpool", MiB, 8, 1)
    f = _open(tmp_path / "x.bin")
    b, _ = _buf(3 * ALIGNMENT)
    cases = [(b.ptr + 512, 4096, 0, "address"), (b.ptr, 4000, 0, "length"), (b.ptr, 4096, 512, "offset")]
    for ptr, n, off, what in cases:
        with pytest.raises(SwapIOError) as ei:
            eng.write(f, ptr, n, off)
        e = ei.value
        assert e.errno == errno.EINVAL and e.filename == str(tmp_path / "x.bin") and e.offset == off
        assert what in str(e) and "4096" in str(e) and "errno 22" in str(e)
    # a buffered file takes anything
    g = _open(tmp_path / "y.bin", direct=False)
    assert eng.write(g, b.ptr + 3, 1001, 7).wait() == 1001


def test_read_past_end(io_backend, tmp_path):
    eng = _C.Engine(io_backend, 8192, 4, 1)
    f = _open(tmp_path / "x.bin")
    src, a = _buf(3 * 8192)
    eng.write(f, src.ptr, 3 * 8192, 0).wait()
    dst, b = _buf(5 * 8192, 3)
    # the end of file after the required bytes is fine (a padded read of an unpadded file)...
    assert eng.read(f, dst.ptr, 5 * 8192, 0, required=3 * 8192).wait() == 3 * 8192
    assert np.array_equal(a, b[: 3 * 8192])
    # ...before them it is an error naming the offset where the data ran out, whichever of the
    # blocks past the end completes first (a threadpool's fourth block once finished before its
    # third, in about 1 of 3000 reads, and the error named the fourth's offset: Engine::
    # fail_request_locked keeps a request's first failed block in the file)
    for _ in range(300):
        with pytest.raises(SwapIOError) as ei:
            eng.read(f, dst.ptr, 5 * 8192, 0).wait()
        assert ei.value.errno == errno.EIO and "end of file" in str(ei.value) and ei.value.offset == 3 * 8192


def test_injected_error_names_path_offset_errno(io_backend, tmp_path):
    eng = _C.Engine(io_backend, 64 << 10, 4, 1)
    f = _open(tmp_path / "x.bin")
    src, _ = _buf(MiB)
    eng._inject_fault(0, errno.EIO)
    with pytest.raises(SwapIOError) as ei:
        eng.write(f, src.ptr, MiB, 4 * MiB).wait()
    e = ei.value
    assert isinstance(e, OSError) and e.errno == errno.EIO
    assert e.filename == str(tmp_path / "x.bin") and e.offset is not None and e.offset >= 4 * MiB
    assert str(tmp_path / "x.bin") in str(e) and f"offset {e.offset}" in str(e) and "errno 5" in str(e)
    assert eng.outstanding == 0  # every other block drained before the handle completed
    assert eng.write(f, src.ptr, MiB, 0).wait() == MiB  # the engine keeps working


def test_short_transfers_are_resubmitted(io_backend, tmp_path):
    eng = _C.Engine(io_backend, 64 << 10, 4, 1)
    f = _open(tmp_path / "x.bin")
    src, a = _buf(MiB)
    eng._inject_fault(2, 0, 8192)  # block 3 transfers only 8 KiB: the rest is resubmitted
    assert eng.write(f, src.ptr, MiB, 0).wait() == MiB
    dst, b = _buf(MiB, 5)
    eng._inject_fault(5, 0, 4096)
    assert eng.read(f, dst.ptr, MiB, 0).wait() == MiB
    assert np.array_equal(a, b)
    # a short O_DIRECT write that stops at an unaligned byte cannot be resumed: reported
    eng._inject_fault(0, 0, 100)
    with pytest.raises(SwapIOError) as ei:
        eng.write(f, src.ptr, MiB, 0).wait()
    assert ei.value.errno == errno.EIO and "short write of 100 bytes" in str(ei.value)


def test_enospc(io_backend, small_fs):
    eng = _C.Engine(io_backend, 256 << 10, 4, 1)
    f = _open(os.path.join(small_fs, "big.bin"))
    src, _ = _buf(2 * MiB)
    with pytest.raises(SwapIOError) as ei:
        eng.write(f, src.ptr, 2 * MiB, 0).wait()
    assert ei.value.errno == errno.ENOSPC and "big.bin" in str(ei.value) and ei.value.offset is not None
    with pytest.raises(SwapIOError) as ei:
        f.allocate(4 * MiB)
    assert ei.value.errno == errno.ENOSPC


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SwapIOError) as ei:
        _C.File(str(tmp_path / "missing.bin"), read=True, write=False, create=False, direct=True)
    assert ei.value.errno == errno.ENOENT and ei.value.filename == str(tmp_path / "missing.bin")
    with pytest.raises(SwapIOError) as ei:
        _C.File(str(tmp_path / "no" / "dir.bin"), read=True, write=True, create=True, direct=True)
    assert ei.value.errno == errno.ENOENT and "no/dir.bin" in str(ei.value)


def test_permission_denied(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user (root bypasses permissions)")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    os.seteuid(65534)  # nobody; the saved uid stays 0 so we can switch back
    try:
        with pytest.raises(SwapIOError) as ei:
            _C.File(str(locked / "x.bin"), read=True, write=True, create=True, direct=True)
    finally:
        os.seteuid(0)
    assert ei.value.errno == errno.EACCES and "locked/x.bin" in str(ei.value)


def test_bad_engine_arguments():
    with pytest.raises(SwapIOError, match="block size"):
        _C.Engine("threadpool", 1000, 8, 1)
    with pytest.raises(SwapIOError, match="queue depth"):
        _C.Engine("threadpool", MiB, 0, 1)
    with pytest.raises(ValueError, match="unknown I/O backend"):
        _C.Engine("spdk", MiB, 8, 1)


def test_gil_released_while_waiting(tmp_path):
    """A second Python thread keeps running while one waits for a slow transfer."""
    eng = _C.Engine("threadpool", 4096, 1, 1)  # 4 KiB at queue depth 1: slow on purpose
    f = _open(tmp_path / "x.bin")
    n = 8 * MiB
    src, _ = _buf(n)
    inside = threading.Event()
    finished = threading.Event()

    def waiter():
        h = eng.write(f, src.ptr, n, 0)
        inside.set()
        h.wait()
        finished.set()

    t = threading.Thread(target=waiter)
    t.start()
    inside.wait()
    ticks = 0
    t0 = time.perf_counter()
    while not finished.is_set():
        ticks += 1
    elapsed = time.perf_counter() - t0
    t.join()
    assert elapsed > 0.01, "the transfer was too fast to tell"
    assert ticks > 10_000, f"the main thread ran only {ticks} iterations in {elapsed:.3f} s"


def test_aligned_empty():
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.int64):
        t = aligned_empty((3, 1001), dtype=dtype)
        assert t.shape == (3, 1001) and t.dtype == dtype and t.data_ptr() % ALIGNMENT == 0
        assert t.untyped_storage().nbytes() % ALIGNMENT == 0 and t.is_contiguous()
        assert is_managed(t) and is_managed(t[1:]) and is_managed(t.view(-1)[5:9])
    assert aligned_empty(0).numel() == 0
    assert not is_managed(torch.empty(10))
    with pytest.raises(SwapIOError):
        aligned_empty(10, pin=True) if not torch.cuda.is_available() else (_ for _ in ()).throw(SwapIOError())


def test_reads_are_checksummed_on_the_engines_side(io_backend, tmp_path):
    """A read that asks for a CRC gets it computed by the engine's verifier thread before its
    handle completes (engine.h, the checksum Note), over exactly crc_len bytes."""
    n = 3 * MiB + 8192
    eng = _C.Engine(io_backend, MiB, 4, 1)
    f = _open(tmp_path / "x.bin")
    src, _ = _buf(n, 3)
    eng.write(f, src.ptr, n, 0).wait()
    dst, _ = _buf(n, 4)
    h = eng.submit([[[(False, f, dst.ptr, n, 0, n, n - 100), (False, f, dst.ptr, 4096, 0, 4096)]]], False, n)
    h.wait()
    assert h.crcs == [_C.crc32c(src.ptr, n - 100)]
    with pytest.raises(SwapIOError) as ei:  # a write, or more bytes than the request reads
        eng.submit([[[(True, f, src.ptr, 4096, 0, 0, 4096)]]], True, 4096)
    assert ei.value.errno == errno.EINVAL
    with pytest.raises(SwapIOError):
        eng.submit([[[(False, f, dst.ptr, 4096, 0, 4096, 8192)]]], False, 4096)
    eng._inject_fault(0, errno.EIO)  # a failed read has no CRCs to read
    h = eng.submit([[[(False, f, dst.ptr, 4096, 0, 4096, 4096)]]], False, 4096)
    with pytest.raises(SwapIOError):
        h.wait()
    with pytest.raises(ValueError, match="failed"):
        _ = h.crcs
    eng.close()


def test_a_header_is_sealed_by_the_engine_before_it_is_written(io_backend, tmp_path):
    """A write that seals (RequestSpec.seal_*) gets its payload's CRC-32C and its own CRC-32
    filled in by the engine (TensorStore's final header), so the thread that puts does no pass."""
    import zlib

    eng = _C.Engine(io_backend, MiB, 4, 1)
    f = _open(tmp_path / "h.bin")
    payload, _ = _buf(MiB + 100, 5)
    hdr, h = _buf(4096, 6)
    h[:] = 0
    eng.submit([[[(True, f, hdr.ptr, 4096, 0, 0, 0, payload.ptr, MiB + 100, 72)]]], True, 4096).wait()
    back, b = _buf(4096, 7)
    eng.read(f, back.ptr, 4096, 0).wait()
    assert int.from_bytes(bytes(b[72:76]), "little") == _C.crc32c(payload.ptr, MiB + 100)
    assert int.from_bytes(bytes(b[4092:]), "little") == zlib.crc32(bytes(b[:4092]))
    with pytest.raises(SwapIOError) as ei:  # the checksum must lie inside the header, before its CRC
        eng.submit([[[(True, f, hdr.ptr, 4096, 0, 0, 0, payload.ptr, 8, 4090)]]], True, 4096)
    assert ei.value.errno == errno.EINVAL
    eng.close()


@pytest.mark.parametrize("err, hinted", [(errno.EINVAL, True), (errno.ENOSPC, False), (errno.EROFS, False)])
def test_auto_suggests_dropping_o_direct_only_where_o_direct_was_refused(tmp_path, monkeypatch, err, hinted):
    """A filesystem that refuses O_DIRECT (EINVAL) is helped by o_direct=False; a full or
    read-only disk is not, and the message must not send the user there."""
    from offloadpp.io import engine as io_engine

    probes = [io_engine.BackendProbe(name=n, available=True, works=False, detail=os.strerror(err), errno=err)
              for n in io_engine.BACKENDS]  # fmt: skip
    monkeypatch.setattr(io_engine, "probe_backends", lambda directory, o_direct=True: probes)
    monkeypatch.setattr(io_engine, "_auto_cache", {})
    with pytest.raises(OSError) as ei:
        io_engine.resolve_backend(IOConfig(backend="auto"), str(tmp_path))
    assert ei.value.errno == err
    assert ("o_direct=False" in str(ei.value)) is hinted
