"""Units on models beyond a plain stack of blocks: activation checkpointing by the model itself
(Hugging Face gradient checkpointing, torch.utils.checkpoint around whole blocks, reentrant or
not), encoder-decoder models (T5: a clear error, or an explicit split that trains exactly), and a
module called twice in one forward (a clear error). Each trained against torch AdamW in memory,
with strict streaming (every unit's weights dropped after use) so recomputes must fetch."""

from __future__ import annotations

import copy

import pytest
import torch
from numerics import compare_weights
from test_runtime import VOCAB, batches, streaming_config, tiny_gpt2, tiny_llama

from offloadpp.assemble import assemble_engine
from offloadpp.optim import AdamHyper
from offloadpp.runtime import UnitDiscoveryError, find_units

transformers = pytest.importorskip("transformers")
LR = 1e-3
STRICT = dict(fill_gaps=False, prefetch_depth=0)


def train_both(ref, eng, data, loss_fn, *, clip: float = 0.0):
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    for x in data:
        loss_fn(ref, x).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        eng.backward(loss_fn(eng, x))
        eng.step()


def lm_loss(m, x):
    return m(input_ids=x, labels=x).loss


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
def test_hugging_face_gradient_checkpointing_trains_exactly(tmp_path, make, reentrant):
    ref = make()
    ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    ref.train()
    eng = assemble_engine(copy.deepcopy(ref), streaming_config(tmp_path, gradient_clipping=1.0, **STRICT),
                          hyper=AdamHyper(lr=LR, weight_decay=0.01))  # fmt: skip
    train_both(ref, eng, batches(3), lm_loss, clip=1.0)
    assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=LR, steps=3) < 1e-5
    eng.close()


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, h):
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h))))


class CheckpointedLM(torch.nn.Module):
    """Blocks run under torch.utils.checkpoint as whole modules: their forward hooks run again
    in backward, where the runtime sees a unit's forward during backward."""

    def __init__(self, reentrant: bool, width: int = 32, layers: int = 4, checkpoint: bool = True):
        super().__init__()
        self.reentrant, self.checkpoint = reentrant, checkpoint
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = (
                torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.reentrant)
                if self.checkpoint
                else b(h)
            )
        return self.head(h)


def ce_loss(m, x):
    return torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())


@pytest.mark.parametrize("reentrant", [False, True])
def test_blocks_recomputed_as_modules_in_backward(tmp_path, reentrant):
    torch.manual_seed(0)
    ref = CheckpointedLM(reentrant)
    eng = assemble_engine(
        copy.deepcopy(ref), streaming_config(tmp_path, **STRICT), hyper=AdamHyper(lr=LR, weight_decay=0.01)
    )
    train_both(ref, eng, batches(3), ce_loss)
    assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=LR, steps=3) < 1e-5
    eng.close()
    # The recompute is part of the unit's backward visit: the walk goes on as planned, and the
    # step reads from SSD exactly what the same model without checkpointing reads.
    reads = {}
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = CheckpointedLM(reentrant, checkpoint=checkpoint)
        (tmp_path / str(checkpoint)).mkdir()
        with assemble_engine(model, streaming_config(tmp_path / str(checkpoint), fill_gaps=False)) as eng:
            reads[checkpoint] = []
            for x in batches(3):
                eng.backward(ce_loss(eng, x))
                r = eng.step()
                assert r.fetch_misses == 0
                reads[checkpoint].append(r.ssd_read_bytes)
    assert reads[True] == reads[False]


def tiny_t5():
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                dropout_rate=0.0, decoder_start_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


def test_encoder_decoder_models_need_an_explicit_split(tmp_path):
    with pytest.raises(
        UnitDiscoveryError, match=r"two stacks of blocks \('encoder.block' besides 'decoder.block'\)"
    ):
        find_units(tiny_t5())
    ref = tiny_t5()
    units = (
        ("shared", "encoder"),
        ("decoder.block.0",),
        ("decoder.block.1",),
        ("decoder.final_layer_norm", "lm_head"),
    )
    eng = assemble_engine(
        copy.deepcopy(ref), streaming_config(tmp_path, units=units, **STRICT), hyper=AdamHyper(lr=LR)
    )
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(1, 64, (2, 8), generator=g), torch.randint(1, 64, (2, 6), generator=g))
        for _ in range(3)
    ]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    for x, y in data:
        ref(input_ids=x, labels=y).loss.backward()
        opt.step()
        opt.zero_grad()
        eng.backward(eng(input_ids=x, labels=y).loss)
        eng.step()
    want = ref.state_dict()
    got = eng.module.state_dict()
    assert max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want) < 1e-5
    eng.close()


class TwiceLM(CheckpointedLM):
    """Calls its embedding again after the blocks (as an encoder-decoder's shared embedding)."""

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h + self.embed(x))


def test_a_unit_run_twice_in_one_forward_is_a_clear_error(tmp_path):
    torch.manual_seed(0)
    eng = assemble_engine(TwiceLM(False), streaming_config(tmp_path), hyper=AdamHyper(lr=LR))
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"unit 'embed' .* ran a second time in one forward pass"):
        ce_loss(eng, x)
    eng.close()
