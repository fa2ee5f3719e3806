"""The causal-LM loss that saves the logits only (offloadpp/runtime/activations/loss.py): the
gradients of Hugging Face's own loss bit for bit, in one chunk or several, fp32 and 16-bit, and
the saved bytes of the logits (not of their fp32 log-softmax)."""

from __future__ import annotations

import copy

import pytest
import torch

from offloadpp.runtime.activations import loss as lossmod

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _gpt2(dtype=torch.float32):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def _grads(model, x, labels, **kw):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = model(input_ids=x, labels=labels, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 5 * VOCAB])  # one chunk; 5 rows a chunk (13 chunks, the last short)
@pytest.mark.parametrize("items", [None, 37])  # mean; a sum over a given number of items (the Trainer's)
def test_gradients_are_hugging_faces_bit_for_bit(monkeypatch, dtype, chunk, items):
    ref = _gpt2(dtype)
    model = copy.deepcopy(ref)
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = x.clone()
    labels[0, :5] = -100  # ignored positions
    kw = {"num_items_in_batch": torch.tensor(items)} if items else {}
    want_loss, want = _grads(ref, x, labels, **kw)
    if chunk is not None:
        monkeypatch.setattr(lossmod, "CHUNK_ELEMS", chunk)
    r = lossmod.substitute_loss(model)
    assert r is not None and model.loss_function is lossmod.causal_lm_loss
    got_loss, got = _grads(model, x, labels, **kw)
    lossmod.restore_loss(r)
    assert model.loss_function is not lossmod.causal_lm_loss
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    if chunk is None:  # one chunk: the very same call
        assert torch.equal(got_loss, want_loss)
    else:
        assert torch.allclose(got_loss, want_loss, rtol=1e-6, atol=0)


def test_saves_the_logits_not_their_fp32_log_softmax():
    """16-bit logits: Hugging Face's loss saves the fp32 log-softmax (4 bytes a logit); this one
    the logits themselves (2 bytes: the analytic profile's count)."""
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    saved = {}
    for sub in (False, True):
        model = _gpt2(torch.bfloat16)
        r = lossmod.substitute_loss(model) if sub else None
        out = model.transformer(input_ids=x).last_hidden_state
        logits = model.lm_head(out)
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.loss_function(logits, x, VOCAB)
        saved[sub] = max(sizes)
        lossmod.restore_loss(r)
    logits_bytes = x.numel() * VOCAB * 2
    assert saved == {False: 2 * logits_bytes, True: logits_bytes}, saved


def test_other_losses_are_left_alone():
    model = _gpt2()
    model.loss_function = lambda *a, **k: None  # a user's own
    assert lossmod.substitute_loss(model) is None
    assert lossmod.substitute_loss(None) is None
