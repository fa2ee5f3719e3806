"""Activation swapping under the OffloadEngine (every array of every unit on SSD, the CPU as the
device): a GPT-2-style model trained with an activation budget of 25% of what keeping everything
needs gives the losses and weights of keeping everything, with the accounted activation peak
within the budget; the policy per unit is recorded in the Plan.
"""

from __future__ import annotations

import copy

import pytest
import torch

from offloadpp.assemble import assemble_engine
from offloadpp.optim import AdamHyper
from offloadpp.planner import ActivationSettings, PlanError, Settings
from offloadpp.runtime import RuntimeConfig

transformers = pytest.importorskip("transformers")

VOCAB = 128


def gpt2(n_layer: int = 8, seed: int = 0):
    cfg = transformers.GPT2Config(
        n_layer=n_layer, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def config(path, **activations) -> RuntimeConfig:
    """Default settings (every array on SSD, budgets the streaming minimum) with these
    activation settings."""
    path.mkdir(parents=True, exist_ok=True)
    settings = Settings(activations=ActivationSettings(**activations))
    return RuntimeConfig(
        nvme_paths=[str(path)], settings=settings, device="cpu", ssd_read_gbps=2.0, ssd_write_gbps=2.0
    )


def train(engine, data) -> tuple[list[float], int]:
    """(losses, the largest accounted activation peak of the steps)."""
    losses, peak = [], 0
    for x in data:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        report = engine.step()
        losses.append(loss.item())
        peak = max(peak, report.budget("activations").peak_bytes)
    return losses, peak


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, 64), generator=g) for _ in range(3)]  # tensors above min_swap_bytes


def test_quarter_budget_trains_like_keep_within_the_peak(tmp_path, data, on_device):
    ref = gpt2()
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    with assemble_engine(copy.deepcopy(ref), config(tmp_path / "keep"), hyper=hyper) as keep:
        want, keep_peak = train(keep, data)
        want_sd = {k: v.clone() for k, v in keep.module.state_dict().items()}
    assert keep.plan.activations == () or set(keep.plan.activations) == {"keep"}
    budget = keep_peak // 4
    for policy in ("auto", "ssd", "recompute"):
        cfg = config(tmp_path / policy, policy=policy, budget_bytes=budget)
        with assemble_engine(copy.deepcopy(ref), cfg, hyper=hyper) as eng:
            assert eng.plan.budgets.activation_bytes == budget
            assert len(eng.plan.activations) == len(eng.plan.units)
            got, peak = train(eng, data)
            assert got == want, policy
            for k, v in eng.module.state_dict().items():
                assert torch.equal(v, want_sd[k]), (policy, k)
            assert 0 < peak <= budget, (policy, peak, budget)
            if policy == "recompute":  # the embeddings' backward fetches no weights: kept
                assert eng.activations.policies()["embed"] == "keep"


def test_per_unit_overrides_and_plan_validation(tmp_path, data):
    ref = gpt2(n_layer=2)
    overrides = {"transformer.h.0": "ssd", "transformer.h.1": "recompute", "head": "host"}
    cfg = config(tmp_path, policy="keep", overrides=overrides)
    with assemble_engine(copy.deepcopy(ref), cfg) as eng:
        assert dict(zip([u.name for u in eng.plan.units], eng.plan.activations)) == {
            "embed": "keep",
            **overrides,
        }
        train(eng, data[:1])
    with pytest.raises(ValueError, match="overrides names units the model does not have.*nope"):
        assemble_engine(copy.deepcopy(ref), config(tmp_path / "x", overrides={"nope": "ssd"}))
    from dataclasses import replace

    with assemble_engine(copy.deepcopy(ref), config(tmp_path / "y")) as eng:
        with pytest.raises(PlanError, match="activations"):
            replace(eng.plan, activations=("keep",))


def _tiny(kind: str):
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=3, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, attention_dropout=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _torch_adamw(ref, data, lr: float) -> list[float]:
    """The reference: `ref` trained in memory by torch's AdamW (weight decay 0.01), one step a
    batch, dropout seeded as the engine's runs seed it; its losses."""
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    want = []
    for i, x in enumerate(data):
        torch.manual_seed(100 + i)
        loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    return want


@pytest.mark.parametrize("kind,device", [("gpt2", "cpu"), ("llama", "cpu"), ("gpt2", "standin")])
@pytest.mark.parametrize(
    "policy",
    [
        "recompute_host",
        "recompute_ssd",
        "partial",
        "partial_host",
        "partial_ssd",
        "recompute_nested_ssd",
        "partial_refetch_ssd",
    ],
)
def test_swapped_checkpoints_train_like_torch_adamw(tmp_path, data, monkeypatch, kind, device, policy):
    """Recompute with the checkpoint swapped to host / to SSD, and partial (selective) recompute
    with the matmuls' and attention's outputs kept, sent to host or to SSD, under the engine,
    dropout on: the weights after three AdamW steps equal torch's AdamW in memory (the recompute
    replays the RNG, each dropout from its own state under partial; what was kept or swapped
    comes back byte for byte), and the bytes did move where the policy says."""
    from conftest import set_device
    from numerics import compare_weights

    set_device(monkeypatch, device)
    lr = 1e-3
    ref = _tiny(kind)
    model = copy.deepcopy(ref)
    want = _torch_adamw(ref, data, lr)
    with assemble_engine(
        model, config(tmp_path, policy=policy), hyper=AdamHyper(lr=lr, weight_decay=0.01)
    ) as eng:
        pol = eng.activations.policies()
        assert pol["embed"] == "keep" and {p for u, p in pol.items() if u != "embed"} == {policy}
        got, stats = [], []
        for i, x in enumerate(data):
            torch.manual_seed(100 + i)
            loss = eng(input_ids=x, labels=x).loss
            eng.backward(loss)
            stats.append(eng.activations.stats())  # (the step's report resets them)
            report = eng.step()
            got.append(loss.item())
            assert report.recompute_s > 0 and report.budget("activations").peak_bytes > 0
        # (partial_refetch_*: a block's two norm checkpoints come back twice, runtime/activations/
        # saves.py `_evict_source`; fp32 activations)
        width, blocks = ref.config.hidden_size, ref.config.num_hidden_layers
        again = [2 * blocks * x.numel() * width * 4 if "refetch" in policy else 0 for x in data]
        for s, more in zip(stats, again):
            assert (
                (s.d2h_bytes > 0) == (policy != "partial")
                and s.h2d_bytes == s.d2h_bytes + more
                and s.fetch_misses == 0
            )
            # (a record whose SSD write has not ended when backward wants it comes back from its
            # host buffer: on a loaded machine a step may read nothing back from the SSD)
            assert (s.ssd_write_bytes > 0) == policy.endswith("_ssd")
            assert s.ssd_read_bytes <= s.ssd_write_bytes
        assert got == pytest.approx(want, rel=1e-5)
        assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=lr, steps=len(data)) < 1e-5


@pytest.mark.parametrize("kind,device", [("gpt2", "cpu"), ("llama", "cpu"), ("gpt2", "standin")])
@pytest.mark.parametrize("head", ["keep", "host", "ssd", "recompute", "recompute_ssd", "grad_in_forward"])
def test_fused_head_trains_like_torch_adamw(tmp_path, data, monkeypatch, kind, device, head):
    """The fused head (runtime/activations/head.py) under the engine, the head unit's policy
    `head`, dropout on, GPT-2's lm_head tied to the embeddings and Llama's not, in chunks of
    48 rows (6 a batch): the weights after three AdamW steps equal torch's AdamW on the plain
    model with Hugging Face's own head and loss; the logits are a placeholder; the head kept
    its logits, only their input, or (grad_in_forward) the gradients, as its policy says."""
    from conftest import set_device
    from numerics import compare_weights

    from offloadpp.runtime.activations import head as headmod

    set_device(monkeypatch, device)
    monkeypatch.setattr(headmod, "LOSS_CHUNK_ELEMS", 48 * VOCAB)
    lr = 1e-3
    ref = _tiny(kind)
    model = copy.deepcopy(ref)
    want = _torch_adamw(ref, data, lr)
    cfg = config(tmp_path, policy="keep", overrides={"head": head})
    with assemble_engine(model, cfg, hyper=AdamHyper(lr=lr, weight_decay=0.01)) as eng:
        got = []
        for i, x in enumerate(data):
            torch.manual_seed(100 + i)
            out = eng(input_ids=x, labels=x)
            assert isinstance(out.logits, headmod.LazyLogits)
            saved = {u.name: u.saved_bytes for u in eng.activations.units}["head"]
            eng.backward(out.loss)
            eng.step()
            got.append(out.loss.item())
            h, logits = x.numel() * model.config.hidden_size * 4, x.numel() * VOCAB * 4
            if head in ("keep", "host", "ssd"):  # the norm's saves (its input at least), h, the logits
                assert saved >= h + h + logits, saved
            elif head == "grad_in_forward":  # the norm's, grad_h and grad_W (fp32): tests/test_head_grad.py
                assert saved >= h + h + VOCAB * model.config.hidden_size * 4, saved
            else:  # h only, and the norm's input where recompute_ssd swaps it (a checkpoint record)
                assert saved == (2 * h if head == "recompute_ssd" else h), saved
        assert got == pytest.approx(want, rel=1e-5)
        assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=lr, steps=len(data)) < 1e-5


def test_fused_head_backward_starts_in_the_heads_backward_visit(tmp_path, data, monkeypatch):
    """The head's backward visit (weights of the next units fetched ahead, the head's records
    fetched) is entered when backward reaches the fused loss, before its matmuls run, as it was
    at the logits' gradient before the head was fused; not only once h got its gradient."""
    from offloadpp.runtime.activations import head as headmod

    fused = headmod.FusedLinearCrossEntropy
    seen = []

    def backward(ctx, g):
        seen.append((eng.executor.cursor, eng.activations._bw_unit.name))
        return original(ctx, g)

    original = fused.backward
    monkeypatch.setattr(fused, "backward", staticmethod(backward))
    with assemble_engine(gpt2(n_layer=2), config(tmp_path, policy="keep")) as eng:
        train(eng, data[:1])
        assert seen == [(eng.executor.schedule.backward_index["head"], "head")]


def test_fused_loss_false_under_the_engine_gives_the_logits(tmp_path, data):
    """`activations.fused_loss: false` reaches the runtime through the settings: Hugging Face's
    own head, outputs.logits the logits."""
    ref = gpt2(n_layer=2)
    with assemble_engine(copy.deepcopy(ref), config(tmp_path, policy="keep", fused_loss=False)) as eng:
        out = eng(input_ids=data[0], labels=data[0])
        assert type(out.logits) is torch.Tensor and eng.activations._fused is None
        with torch.no_grad():
            assert torch.equal(out.logits, ref(input_ids=data[0]).logits)
        eng.backward(out.loss)
        eng.step()
