"""partial_refetch_host / partial_refetch_ssd: a derived argument's source (runtime/activations/
saves.py `_evict_source`; planner/activations.py, Note on the derived argument's source). A swapped
piece whose argument is made again from the previous piece's checkpoint (a block's attention and
MLP, from the norms') sends that checkpoint back to host memory once the argument is made, and it
comes back for the norm's own recompute. So a piece's recompute holds no checkpoint beside what
it makes: the measured device peak is lower by one width-sized tensor than partial_host's /
partial_ssd's, each such checkpoint is copied up twice (once under those), and the gradients equal
the keep policy's bit for bit (dropout on), on the CPU and the stand-in."""

from __future__ import annotations

import pytest
import torch
from test_activations import VOCAB, run_step, store, tiny_gpt2, tiny_llama
from test_activations_pieces import _equal
from test_activations_staging import _run

pytest.importorskip("transformers")

__all__ = ["store"]  # (the fixture, shared with test_activations.py)


def _backward_stats(ref, x, store, policy: str, budget: int, monkeypatch):
    """(gradients, stats of backward alone): one step of ref's copy, the blocks under `policy`
    (the embedding and head kept), the forward's copies drained."""
    got, stats, _ = _run(ref, x, store, budget, policy, monkeypatch, overrides={"embed": "keep", "head": "keep"},
                         backward_only=True)  # fmt: skip
    return got, stats


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize(
    "of, tier",
    [("partial", "host"), ("partial", "ssd"), ("recompute_pieces", "host"), ("partial_last", "ssd")],
)
def test_a_refetching_piece_holds_no_checkpoint_beside_its_derived_argument(store, monkeypatch, on_device, kind, tier,
                                                                              of):  # fmt: skip
    """Short sequences (the MLP's recompute is a block's largest piece, as a 13B block's at b64):
    under a budget that fetches nothing ahead (1 byte) backward's peak is one width-sized tensor
    (the norm's checkpoint) lower under partial_refetch_* than under partial_*; under a budget
    half that tensor below partial_*'s peak, partial_refetch_*'s stays within it (the fetches
    ahead filling it). Each block's two norm checkpoints are copied up twice; gradients equal keep's."""
    ref = tiny_gpt2(n_embd=128) if kind == "gpt2" else tiny_llama()
    x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    width, blocks = ref.config.hidden_size, ref.config.num_hidden_layers
    w = x.numel() * width * 4  # one fp32 width-sized tensor: a norm's checkpoint
    _, want = run_step(ref, x)
    got, held = _backward_stats(ref, x, store, f"{of}_{tier}", 1, monkeypatch)
    assert _equal(got, want)
    # nothing fetched ahead (a 1-byte budget): the peak lower by the checkpoint sent back, exactly
    got, least = _backward_stats(ref, x, store, f"{of}_refetch_{tier}", 1, monkeypatch)
    assert _equal(got, want)
    assert held.peak_device_bytes - least.peak_device_bytes == w
    room = held.peak_device_bytes - w // 2
    got, sent = _backward_stats(ref, x, store, f"{of}_refetch_{tier}", room, monkeypatch)
    assert _equal(got, want)
    assert sent.peak_device_bytes <= room < held.peak_device_bytes, (sent.peak_device_bytes, room)
    assert sent.h2d_bytes - held.h2d_bytes == 2 * blocks * w  # (copied up again, never out again)
    assert sent.d2h_bytes == held.d2h_bytes == 0  # (drained before backward: counted from there)
    assert sent.ssd_read_bytes == held.ssd_read_bytes
