"""io/direct_writer.py: a file written front to back in staged O_DIRECT chunks holds exactly the
bytes written, in order, whatever their sizes; the page-cache fallback does too."""

from __future__ import annotations

import os

import pytest
import torch

from offloadpp.io import direct_writer
from offloadpp.io.direct_writer import DirectFileWriter


def pieces() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    sizes = [1, 4095, 4096, 8192, 3, 20000, 0, 12289, 7]  # across the 8 KiB staging chunks, unaligned
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes() for n in sizes]


@pytest.mark.parametrize("direct", [True, False])
def test_the_file_holds_what_was_written(tmp_path, monkeypatch, direct):
    if not direct:
        monkeypatch.setattr(direct_writer, "direct_supported", lambda path: open(path, "wb").close() or False)
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100_000)  # an older, longer file: replaced, not overwritten in part
    w = DirectFileWriter(str(path), chunk_bytes=8192)
    if direct and not w.direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    assert w.direct is direct
    want = b""
    for i, p in enumerate(pieces()):
        # bytes, and a tensor's memoryview (what the safetensors and torch writers pass)
        w.write(p if i % 2 else memoryview(torch.tensor(list(p), dtype=torch.uint8).numpy()))
        want += p
    w.close()
    assert path.read_bytes() == want and w.bytes_written == len(want)


def test_abort_removes_the_file(tmp_path):
    path = tmp_path / "f.bin"
    w = DirectFileWriter(str(path), chunk_bytes=8192)
    w.write(b"y" * 20000)
    w.abort()
    assert not os.path.exists(path)
