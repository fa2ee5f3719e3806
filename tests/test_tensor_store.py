"""TensorStore: round trips (dtypes, sizes, layouts, backends, directories), overwrite in place,
the file format's defences (stale, truncated, corrupted, foreign, failed writes), errors."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import pytest
import torch

from offloadpp.io import ALIGNMENT, IOConfig, SwapIOError, TensorStore, aligned_empty

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def _files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".oswp"))


@pytest.fixture
def store(tmp_path):
    s = TensorStore([str(tmp_path / "a")], IOConfig(block_size_bytes=64 << 10))
    yield s
    s.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_every_dtype(store, dtype):
    shapes = [(1000, 77), (5,), (), (0, 3)]  # 308000-byte-ish (not a block multiple), tiny, scalar, empty
    for i, shape in enumerate(shapes):
        t = _rand(shape, dtype, i)
        assert store.put(f"k{i}", t).wait() == t.numel() * t.element_size()
        r = store.get(f"k{i}").result()
        assert r.dtype == dtype and r.shape == t.shape and torch.equal(r, t)
        assert r.data_ptr() % ALIGNMENT == 0
        assert store.nbytes(f"k{i}") == t.numel() * t.element_size()


def test_roundtrip_every_backend_and_two_dirs(io_backend, tmp_path):
    cfg = IOConfig(backend=io_backend, block_size_bytes=64 << 10, queue_depth=4, stripe_min_bytes=256 << 10)
    dirs = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    with TensorStore(dirs, cfg) as s:
        assert s.backends == [io_backend, io_backend]
        big = _rand((300_001,), torch.float32, 1)  # striped over both directories, unaligned end
        small = [_rand((1000 + i,), torch.float16, i) for i in range(6)]  # balanced over the two
        futs = [s.put("big", big)] + [s.put(f"s{i}", t) for i, t in enumerate(small)]
        for f in futs:
            f.wait()
        assert all(_files(d) for d in dirs)
        assert len([f for d in dirs for f in _files(d) if f.startswith("big")]) == 2
        out = aligned_empty(300_001)
        assert s.get("big", out=out).result() is out and torch.equal(out, big)
        for i, t in enumerate(small):
            assert torch.equal(s.get(f"s{i}").result(), t)
        st = s.stats
        assert st.bytes_written == st.bytes_read == sum(t.numel() * t.element_size() for t in [big, *small])
        assert st.read_seconds > 0 and st.write_seconds > 0
        assert s.disk_bytes() >= st.bytes_written


def test_unaligned_noncontiguous_sources_and_outputs(store):
    base = _rand((4097,), torch.float32)
    t = base[1:]  # misaligned start
    store.put("mis", t).wait()
    out = torch.empty(4097)[1:]
    assert torch.equal(store.get("mis", out=out).result(), t)
    m = _rand((64, 96), torch.bfloat16).t()  # non-contiguous
    store.put("nc", m).wait()
    out2 = torch.empty(96, 64, dtype=torch.bfloat16)
    assert torch.equal(store.get("nc", out=out2).result(), m)
    assert torch.equal(store.get("nc").result(), m)
    out3 = torch.empty(64, 96, dtype=torch.bfloat16).t()  # non-contiguous destination
    assert torch.equal(store.get("nc", out=out3).result(), m)


def test_out_must_match(store):
    store.put("k", torch.zeros(100)).wait()
    for bad in (torch.zeros(99), torch.zeros(100, dtype=torch.float64)):
        with pytest.raises(SwapIOError) as ei:
            store.get("k", out=bad)
        assert ei.value.errno == errno.EINVAL and "stored: torch.float32 x 100" in str(ei.value)
    assert torch.equal(store.get("k", out=torch.ones(10, 10)).result(), torch.zeros(10, 10))
    with pytest.raises(KeyError):
        store.get("missing")


def test_overwrite_in_place_and_layout_change(store, tmp_path):
    d = str(tmp_path / "a")
    store.put("k", _rand((50_000,), torch.float32, 1)).wait()
    (name,) = _files(d)
    ino = os.stat(os.path.join(d, name)).st_ino
    t2 = _rand((50_000,), torch.float32, 2)
    store.put("k", t2).wait()
    assert os.stat(os.path.join(d, name)).st_ino == ino  # same file, overwritten
    assert torch.equal(store.get("k").result(), t2)
    t3 = _rand((7,), torch.int64, 3)  # a new size re-lays the key out
    store.put("k", t3).wait()
    assert torch.equal(store.get("k").result(), t3) and len(_files(d)) == 1
    store.delete("k")
    assert "k" not in store and _files(d) == [] and store.keys() == []


def test_many_futures_in_flight_and_threads(store):
    tensors = {f"u{i}": _rand((10_000 + 4099 * i,), torch.float32, i) for i in range(16)}
    puts = [store.put(k, t) for k, t in tensors.items()]  # nothing waited yet
    gets = {k: store.get(k) for k in tensors}  # each waits only for its own key's put
    for k, f in gets.items():
        assert torch.equal(f.result(), tensors[k])
    assert all(p.done() for p in puts)
    # put from a worker thread, wait in this one
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("f", store.put("thr", tensors["u3"])))
    th.start()
    th.join()
    assert box["f"].wait() > 0
    g = store.get("thr")
    th = threading.Thread(target=g.wait)
    th.start()
    th.join()
    assert g.done() and torch.equal(g.result(), tensors["u3"])
    store.wait_all()


def test_reopen_finds_keys(tmp_path):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    t = _rand((200_000,), torch.float32)
    with TensorStore(dirs, IOConfig(stripe_min_bytes=1 << 16, block_size_bytes=1 << 16)) as s:
        s.put("w", t).wait()
        s.put("x", torch.arange(10)).wait()
    with TensorStore(dirs, create=False) as s:
        assert sorted(s.keys()) == ["w", "x"]
        assert torch.equal(s.get("w").result(), t)
        s.put("w", t + 1).wait()  # generations continue after the highest found
        assert torch.equal(s.get("w").result(), t + 1)


def _only_file(tmp_path):
    d = str(tmp_path / "a")
    (name,) = _files(d)
    return os.path.join(d, name)


def test_stale_file_detected(store, tmp_path):
    store.put("k", _rand((3000,), torch.float32, 1)).wait()
    path = _only_file(tmp_path)
    shutil.copy(path, str(tmp_path / "old"))
    store.put("k", _rand((3000,), torch.float32, 2)).wait()
    with open(str(tmp_path / "old"), "rb") as src, open(path, "r+b") as dst:  # restore in place
        dst.write(src.read())
    with pytest.raises(SwapIOError) as ei:
        store.get("k").wait()
    assert ei.value.errno == errno.ESTALE and "stale" in str(ei.value) and ei.value.filename == path


def test_truncated_file_detected(store, tmp_path):
    store.put("k", _rand((3000,), torch.float32)).wait()
    path = _only_file(tmp_path)
    os.truncate(path, 8192)
    with pytest.raises(SwapIOError) as ei:
        store.get("k").wait()
    assert ei.value.errno == errno.EIO and "truncated" in str(ei.value) and path in str(ei.value)


@pytest.mark.parametrize("where,expect", [(100, "corrupted"), (0, "bad magic")])
def test_corrupted_or_foreign_header_detected(store, tmp_path, where, expect):
    store.put("k", _rand((3000,), torch.float32)).wait()
    path = _only_file(tmp_path)
    with open(path, "r+b") as f:
        f.seek(where)
        f.write(b"\xff\x00\xfe")
    with pytest.raises(SwapIOError) as ei:
        store.get("k").wait()
    assert ei.value.errno == errno.EBADMSG and expect in str(ei.value)


def test_a_key_whose_file_reopens_corrupted_or_incomplete_names_the_file(tmp_path):
    d = str(tmp_path / "a")
    with TensorStore([d]) as s:
        s.put("k", torch.arange(3000.0)).wait()
        s.put("j", torch.arange(10.0)).wait()
    path = next(os.path.join(d, f) for f in _files(d) if f.startswith("k."))
    with open(path, "r+b") as f:  # one bit of the header block
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with TensorStore([d], create=False) as s:
        assert "k" not in s and s.why_missing("j") is None and s.why_missing("nothing") is None
        with pytest.raises(SwapIOError, match=r"header checksum mismatch.* at offset 0") as ei:
            s.get("k")
        assert ei.value.errno == errno.EBADMSG and ei.value.filename == path
        assert s.why_missing("k") is ei.value


def test_a_removed_swap_directory_is_named_not_a_missing_key(tmp_path):
    d = str(tmp_path / "a")
    with TensorStore([d]) as s:
        s.put("k", torch.arange(10.0)).wait()
        shutil.rmtree(d)
        for call in (lambda: s.put("new", torch.arange(10.0)).wait(), lambda: s.get("gone")):
            with pytest.raises(SwapIOError, match=rf"swap directory '{d}' was removed while this run used it "
                               r"\(missing swap file '.*\.oswp'\)") as ei:  # fmt: skip
                call()
            assert ei.value.errno == errno.ENOENT


def test_checksum_catches_payload_corruption(tmp_path):
    with TensorStore(str(tmp_path / "a"), IOConfig(checksum=True)) as s:
        t = _rand((3001,), torch.float32)
        s.put("k", t).wait()
        assert torch.equal(s.get("k").result(), t)
        with open(_only_file(tmp_path), "r+b") as f:
            f.seek(4096 + 12000)  # inside the payload's unaligned tail
            f.write(b"\x01")
        with pytest.raises(SwapIOError) as ei:
            s.get("k").wait()
        assert ei.value.errno == errno.EBADMSG and "checksum" in str(ei.value)


def test_failed_write_never_reads_as_valid(tmp_path):
    d = str(tmp_path / "a")
    s = TensorStore(d, IOConfig(block_size_bytes=64 << 10, backend="threadpool"))
    s.put("k", _rand((100_000,), torch.float32, 1)).wait()  # a valid old version on disk
    s._engines[0]._inject_fault(2, errno.EIO)  # a payload block of the overwrite fails
    with pytest.raises(SwapIOError) as ei:
        s.put("k", _rand((100_000,), torch.float32, 2)).wait()
    assert ei.value.errno == errno.EIO
    with pytest.raises(SwapIOError) as ei:
        s.get("k").wait()  # neither the old nor a half-new version is served: the write's own cause
    assert ei.value.errno == errno.EIO and "writing key 'k' failed earlier" in str(ei.value)
    with pytest.raises(SwapIOError, match="failed earlier"):
        s.check_writes()
    s.close()
    with TensorStore(d) as s2:
        assert "k" not in s2  # the incomplete file is not indexed on reopen
    with pytest.raises(SwapIOError):
        s.put("x", torch.zeros(3))  # closed


def test_enospc_is_reported_and_leaves_nothing_valid(small_fs):
    with TensorStore(small_fs, IOConfig(block_size_bytes=64 << 10)) as s:
        with pytest.raises(SwapIOError) as ei:
            s.put("big", torch.zeros(2 << 20, dtype=torch.uint8)).wait()
        assert ei.value.errno == errno.ENOSPC and small_fs in str(ei.value)
        assert "big" not in s and os.listdir(small_fs) == []  # a failed first put leaves no trace
        s.put("ok", torch.ones(1000)).wait()  # still usable
        assert torch.equal(s.get("ok").result(), torch.ones(1000))
    with TensorStore(small_fs) as s:
        assert s.keys() == ["ok"]


def test_missing_directory_and_permissions(tmp_path):
    with pytest.raises(SwapIOError) as ei:
        TensorStore(str(tmp_path / "nope"), create=False)
    assert ei.value.errno == errno.ENOENT and "nope" in str(ei.value)
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user (root bypasses permissions)")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    os.seteuid(65534)
    try:
        with pytest.raises(SwapIOError) as ei:
            TensorStore(str(locked / "swap"))
    finally:
        os.seteuid(0)
    assert ei.value.errno == errno.EACCES and "locked" in str(ei.value)


def test_config_is_validated():
    with pytest.raises(ValueError, match="block_size_bytes=1000"):
        IOConfig(block_size_bytes=1000)
    with pytest.raises(ValueError, match="extra"):
        IOConfig(blocksize=4096)
    with pytest.raises(ValueError):
        IOConfig(backend="spdk")
    cfg = IOConfig()
    with pytest.raises(ValueError):
        cfg.queue_depth = 3  # frozen


def test_buffered_mode(tmp_path):
    with TensorStore(str(tmp_path / "a"), IOConfig(o_direct=False)) as s:
        t = _rand((12345,), torch.int16)
        s.put("k", t).wait()
        assert torch.equal(s.get("k").result(), t)


def test_weighted_striping_gives_each_directory_its_share(tmp_path):
    """With weights (the drives' measured rates) a striped tensor's parts follow them, block-aligned,
    so every SSD finishes its part at once; the layout is found again on reopening."""
    cfg = IOConfig(block_size_bytes=64 << 10, stripe_min_bytes=256 << 10)
    dirs = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    big = _rand((1 << 20,), torch.float32, 3)  # 4 MiB
    with TensorStore(dirs, cfg, weights=[3.0, 1.0]) as s:
        s.put("big", big).wait()
        parts = {p.dir_index: p.nbytes for p in s._index["big"].parts}
        assert sum(parts.values()) == big.numel() * 4
        assert parts[0] == 3 * parts[1] and parts[0] % (64 << 10) == 0
        assert torch.equal(s.get("big").result(), big)
    with TensorStore(dirs, cfg) as s:  # equal weights by default; the file layout says what it is
        assert torch.equal(s.get("big").result(), big)
        s.put("even", big).wait()
        assert [p.nbytes for p in s._index["even"].parts] == [2 << 20, 2 << 20]
    with pytest.raises(OSError, match="weights"):
        TensorStore(dirs, cfg, weights=[1.0])


@pytest.mark.parametrize("numel", [3 << 20, 3001])  # block-aligned payload; one with a tail
def test_checksums_are_the_engines_not_the_calling_threads(tmp_path, monkeypatch, numel):
    """Checksums on the I/O side: a put's thread makes none, and the thread that waits for a get
    checksums at most the unaligned tail it copies (under a block), not the payload (issue 21:
    3-7% of a step on the compute thread)."""
    from offloadpp import _C

    with TensorStore(str(tmp_path / "a"), IOConfig(checksum=True)) as s:
        t = _rand((numel,), torch.float32)
        seen = []
        real = _C.crc32c
        monkeypatch.setattr(_C, "crc32c", lambda ptr, n, seed=0: seen.append(n) or real(ptr, n, seed))
        s.put("k", t).wait()
        assert seen == []  # the engine seals the header (engine.h, the checksum Note)
        assert torch.equal(s.get("k").result(), t)
        assert sum(seen) == numel * 4 % ALIGNMENT
        monkeypatch.undo()
        with open(_only_file(tmp_path), "r+b") as f:  # a flipped bit in the body: still caught
            f.seek(4096 + 100)
            old = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([old[0] ^ 1]))
        with pytest.raises(SwapIOError) as ei:
            s.get("k").wait()
        assert ei.value.errno == errno.EBADMSG and "checksum" in str(ei.value)


def test_close_closes_every_swap_file_while_the_store_is_still_referenced(tmp_path):
    def open_swap_files():
        fd_dir = "/proc/self/fd"
        return [p for p in (os.path.realpath(os.path.join(fd_dir, f)) for f in os.listdir(fd_dir))
                if p.startswith(str(tmp_path))]  # fmt: skip

    s = TensorStore([str(tmp_path / "a")])
    futures = []  # a caller's futures (the engine's slots keep theirs) reach the files they used
    for k in ("x", "y"):
        futures += [s.put(k, torch.arange(4096.0)), s.get(k)]
        futures[-2].wait()
        assert torch.equal(futures[-1].result(), torch.arange(4096.0))
    assert len(open_swap_files()) == 2
    s.close()
    assert open_swap_files() == []


def test_a_read_only_store_reads_and_never_writes(tmp_path):
    """readonly=True: the keys are read, put and delete refuse with EROFS, and nothing is created
    in the directory (no backend probe file: a read-only mount or a full disk opens)."""
    t = _rand((3, 1000), torch.float32)
    with TensorStore([tmp_path], config=IOConfig(checksum=True)) as st:
        st.put("k", t).wait()
    before = sorted(os.listdir(tmp_path))
    with TensorStore([tmp_path], config=IOConfig(checksum=True), create=False, readonly=True) as ro:
        assert torch.equal(ro.get("k").result(), t)
        with pytest.raises(SwapIOError) as e:
            ro.put("k2", t)
        assert e.value.errno == errno.EROFS
        with pytest.raises(SwapIOError):
            ro.delete("k")
    assert sorted(os.listdir(tmp_path)) == before


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 1]))


def test_a_put_sealed_with_the_callers_crc(tmp_path):
    """put(crc=): the header carries the caller's CRC-32C (the Adam pass's) and the store makes
    no pass of its own; a get checks the payload against it as against its own."""
    from offloadpp import _C

    with TensorStore(str(tmp_path / "a"), IOConfig(checksum=True)) as s:
        t = _rand((3001,), torch.float32)
        s.put("k", t, crc=_C.crc32c(t.data_ptr(), t.numel() * 4)).wait()
        assert torch.equal(s.get("k").result(), t)
        s.put("k", t, crc=12345).wait()  # a wrong CRC is what the header says: the get refuses
        with pytest.raises(SwapIOError, match="checksum mismatch"):
            s.get("k").wait()


@pytest.mark.parametrize("numel", [3 << 20, 3001])
def test_a_deferred_check_never_lets_bad_bytes_pass(tmp_path, numel):
    """get(defer_check=True): the store does not checksum the payload; its DeferredCheck carries
    the header's CRC to the first user: the Adam pass claims and settles it with its own CRC, any
    other user verifies it by a pass first. A corrupted payload fails either way, and for good."""
    from offloadpp import _C

    with TensorStore(str(tmp_path / "a"), IOConfig(checksum=True)) as s:
        t = _rand((numel,), torch.float32)
        s.put("k", t).wait()
        good = s.get("k", defer_check=True)
        out = good.result()
        crc = _C.crc32c(out.data_ptr(), out.numel() * 4)
        assert good.check.claim() and good.check.expected() == crc
        good.check.settle(crc)
        good.check.verify(out.data_ptr())  # settled: nothing left to do
        assert not good.check.claim()
        _flip(_only_file(tmp_path), 4096 + 100)
        for claimant in (True, False):
            bad = s.get("k", defer_check=True)
            out = bad.result()  # the read itself completes: the check is the user's
            if claimant:
                assert bad.check.claim()
                with pytest.raises(SwapIOError, match="checksum mismatch, found by the Adam pass"):
                    bad.check.settle(_C.crc32c(out.data_ptr(), out.numel() * 4))
            with pytest.raises(SwapIOError) as ei:
                bad.check.verify(out.data_ptr())
            assert ei.value.errno == errno.EBADMSG and "checksum mismatch" in str(ei.value)
            with pytest.raises(SwapIOError):
                bad.check.claim()
        with pytest.raises(SwapIOError, match="checksum mismatch"):
            s.get("k").wait()  # without deferring: the store's own check, as before
