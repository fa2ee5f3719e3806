"""io/torch_stream.py: a torch.save file written tensor by tensor loads as torch.save's does."""

from __future__ import annotations

import pytest
import torch

from offloadpp.io.torch_stream import TorchSaveWriter


def tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(100, generator=g)
    return {
        "view.of.a.larger.buffer": base[10:22].view(3, 4),  # only its own 48 bytes are written
        "half": torch.randn(2, 3, generator=g).half(),
        "bf16": torch.randn(5, generator=g).bfloat16(),
        "ids": torch.arange(7),
        "mask": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "transposed": torch.randn(3, 2, generator=g).t(),  # written contiguous
    }


@pytest.mark.parametrize("mmap", [False, True])
def test_file_loads_as_torch_saves_does(tmp_path, mmap):
    sd = tensors()
    path = tmp_path / "w.bin"
    w = TorchSaveWriter(str(path), [(k, v.dtype, v.shape) for k, v in sd.items()])
    for k, v in sd.items():
        w.write(k, v)
    w.close()
    got = torch.load(str(path), weights_only=True, mmap=mmap)
    assert list(got) == list(sd)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
        assert got[k].untyped_storage().nbytes() == v.numel() * v.element_size()  # a storage of its own
    ref = tmp_path / "ref.bin"
    torch.save({k: v.contiguous().clone() for k, v in sd.items()}, str(ref))
    assert path.stat().st_size == pytest.approx(
        ref.stat().st_size, abs=4096
    )  # the same archive, give or take names


def test_order_sizes_and_completeness_are_checked(tmp_path):
    decl = [("a", torch.float32, (2,)), ("b", torch.float32, (3,))]
    w = TorchSaveWriter(str(tmp_path / "x.bin"), decl)
    with pytest.raises(ValueError, match="'b' written where 'a' was declared"):
        w.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="has 12 bytes, declared 8"):
        w.write("a", torch.zeros(3))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="1 declared tensors were not written"):
        w.close()
    w.abort()
    assert not (tmp_path / "x.bin").exists()
    with pytest.raises(ValueError, match="complex64"):
        TorchSaveWriter(str(tmp_path / "y.bin"), [("c", torch.complex64, (1,))])
