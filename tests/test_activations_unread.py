"""A partial unit's kept outputs that backward never reads (runtime/activations/partial.py, Note
on outputs backward never reads): a block's last projections (GPT-2's two c_proj, a Llama's
o_proj and down) flow only into the piece's output, so they are neither held nor moved, and the
recompute is handed zeros in their place. Gradients equal the keep policy's bit for bit, dropout
on, on the CPU and the stand-in."""

from __future__ import annotations

import copy

import pytest
import torch
from test_activations import data, run_step, store, tiny_gpt2, tiny_llama
from test_activations_pieces import _equal, _keep_gradients

from offloadpp.planner import ActivationSettings
from offloadpp.runtime.activations import partial
from offloadpp.runtime.activations.manager import ActivationManager

pytest.importorskip("transformers")

__all__ = ["data", "store"]  # (the fixtures, shared with test_activations.py)


def _keeping_every_output(monkeypatch) -> None:
    """The Recorder as before the Note: every kept operator's output made a record."""
    check = partial.Recorder.check

    def keep_all(self):
        self._wanted(self.log.kept)
        check(self)

    monkeypatch.setattr(partial.Recorder, "check", keep_all)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["partial", "partial_host", "partial_ssd"])
def test_partial_keeps_no_output_backward_never_reads(store, data, monkeypatch, on_device, kind, policy):
    """Each block saves two width-sized tensors fewer (its two last projections' outputs) than
    with every kept output made a record, and its gradients equal keep's bit for bit (dropout
    on), two steps, nothing fetched late."""
    ref = tiny_gpt2() if kind == "gpt2" else tiny_llama()
    blocks = ref.config.num_hidden_layers
    want = _keep_gradients(ref, data, store)
    saved = {}
    for every in (False, True):
        if every:
            _keeping_every_output(monkeypatch)
        model = copy.deepcopy(ref)
        cfg = ActivationSettings(policy=policy, min_swap_bytes=0, overrides={"head": "keep"})
        with ActivationManager.for_model(model, cfg, store=store) as mgr:
            for _ in range(2):
                _, got = run_step(model, data, mgr)
                assert _equal(got, want), (policy, every)
                s = mgr.stats()
                assert s.fetch_misses == 0
                saved[every] = s.saved_bytes
                mgr.reset_stats()
    x = data.numel() * 64 * 4  # one fp32 width-sized tensor
    assert saved[True] - saved[False] == 2 * x * blocks, saved


def test_an_output_read_as_a_value_is_kept(store):
    """A kept output the piece's forward reads a number from (`.item()`: it may branch on it) is
    kept, though autograd saves nothing made from it: handed zeros, the recompute would take the
    other branch and save other values. The gradients are the plain run's."""

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.a(x)  # (reaches the output through a sum only: no saved tensor)
            y = self.b(x).relu() if h.sum().item() != 0 else self.b(x).sigmoid()
            return y + h

    class Root(torch.nn.Module):  # (its child is the piece: recompute.py, Note on release)
        def __init__(self):
            super().__init__()
            self.piece = Branchy()

        def forward(self, x):
            return self.piece(x)

    torch.manual_seed(0)
    ref, x = Root(), torch.randn(8, 16)
    ref(x).square().sum().backward()
    kept = {}
    for every in (False, True):
        model = copy.deepcopy(ref)
        with pytest.MonkeyPatch.context() as mp:
            if every:
                _keeping_every_output(mp)
            cfg = ActivationSettings(policy="partial", min_swap_bytes=0)
            mgr = ActivationManager([("blk", [model])], cfg, store=store)
            mgr.install()
            with mgr.forward():
                loss = model(x).square().sum()
            mgr.backward(loss)
            kept[every] = mgr.stats().saved_bytes
            mgr.close()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad), (n, every)
    assert kept[False] == kept[True] > 0, kept
