"""peft's LoRA on offloadpp (docs/frozen.md): a `get_peft_model` model through
`offloadpp.initialize` with a ZeRO-Infinity config and the offloadpp block trains as plain torch
with peft does; its adapters save with `save_pretrained` and load with `PeftModel.from_pretrained`;
a checkpoint resumes bit-identically; the frozen base is never written."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("deepspeed")

from test_export import VOCAB, tiny  # noqa: E402  (the same tiny bases)

import offloadpp  # noqa: E402
from offloadpp.planner.plan import flat_numel  # noqa: E402

LR = 1e-3
TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # attention and MLP projections (Conv1D: fan_in_fan_out)
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def lora_model(kind: str, seed: int = 0):
    """LoRA r=8 on the attention and MLP projections; lora_B drawn non-zero so the adapters'
    gradients and updates are not trivially zero from the first step."""
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS[kind], lora_dropout=0.0,
                          fan_in_fan_out=kind == "gpt2")  # fmt: skip
    m = peft.get_peft_model(tiny(kind, seed), cfg)
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return m


def ds_config(nvme) -> dict:
    os.makedirs(nvme, exist_ok=True)
    off = {"device": "nvme", "nvme_path": str(nvme)}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": off},
        "offloadpp": {"enabled": True},
    }


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(n)]


def trainable(m):
    return [p for p in m.parameters() if p.requires_grad]


def reference(model, data) -> list[float]:
    opt = torch.optim.AdamW(trainable(model), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(engine, data) -> list[float]:
    losses = []
    for x in data:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def frozen_files(path) -> dict[str, bytes]:
    out = {}
    for f in sorted(glob.glob(os.path.join(str(path), "**", "*.frozen.*"), recursive=True)):
        with open(f, "rb") as fh:
            out[os.path.basename(f)] = fh.read()
    return out


def rel(got: dict, want: dict) -> float:
    return max(((got[k].float() - want[k].float()).abs().max() / want[k].float().abs().max().clamp_min(1e-12)).item()
               for k in want)  # fmt: skip


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_lora_through_initialize_trains_as_plain_peft(tmp_path, kind):
    ref = lora_model(kind)
    model = copy.deepcopy(ref)
    engine, *_ = offloadpp.initialize(
        model=model, model_parameters=trainable(model), config=ds_config(tmp_path / "nvme")
    )
    try:
        rt = engine.runtime
        assert sum(u.frozen_numel for u in rt.units) == sum(
            p.numel() for p in ref.parameters() if not p.requires_grad
        )
        assert sum(u.numel for u in rt.units) == sum(p.numel() for p in trainable(ref))
        before = frozen_files(tmp_path / "nvme")
        assert before
        data = batches(20)
        want_losses = reference(ref, data)
        losses = train(engine, data)
        assert losses == pytest.approx(want_losses, rel=1e-5)
        # SSD bytes written by a step: the adapters' master and moments, nothing of the base
        r = engine.last_report
        # (by kind, counted at the calls: the I/O engine's own total moves with when writes land)
        assert sum(w for _, _, w in r.ssd_by_kind) == 12 * sum(flat_numel(u.numel) for u in rt.units)
        assert dict((k, rd) for k, rd, _ in r.ssd_by_kind)["weights"] >= rt.plan.frozen_ssd_bytes()
        got, want = engine.module.state_dict(), ref.state_dict()
        assert rel(got, want) < 1e-5
        assert frozen_files(tmp_path / "nvme") == before  # the base's swap files byte-identical
        # the adapters, as peft writes them, load into a fresh base with PeftModel.from_pretrained
        engine.module.save_pretrained(str(tmp_path / "adapters"))
        loaded = peft.PeftModel.from_pretrained(tiny(kind), str(tmp_path / "adapters"))
        lsd = loaded.state_dict()
        lora = [k for k in got if "lora_" in k]
        assert lora and all(torch.equal(lsd[k], got[k]) for k in lora)
        x = data[0]
        with torch.no_grad():
            torch.testing.assert_close(
                loaded(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-4, atol=1e-5
            )
    finally:
        engine.close()


def test_lora_checkpoint_resumes_bit_identically(tmp_path):
    data = batches(6)
    a_model = lora_model("llama")
    a, *_ = offloadpp.initialize(
        model=a_model, model_parameters=trainable(a_model), config=ds_config(tmp_path / "a")
    )
    b_model = lora_model("llama")
    b, *_ = offloadpp.initialize(
        model=b_model, model_parameters=trainable(b_model), config=ds_config(tmp_path / "b")
    )
    try:
        train(a, data[:3])
        a.save_checkpoint(str(tmp_path / "ckpt"))
        b.load_checkpoint(str(tmp_path / "ckpt"))
        train(a, data[3:])
        train(b, data[3:])
        sa, sb = a.module.state_dict(), b.module.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "reentrant, policy",
    [(None, None), (True, None), (False, None), (None, "recompute"), (False, "partial_host")],
)
def test_gradient_checkpointing_enable_trains_as_plain_peft(tmp_path, reentrant, policy):
    """Hugging Face's gradient checkpointing (the model runs each block's forward again in
    backward) on a LoRA model: the engine follows the recompute (executor._recompute), with the
    default activation policy and beside one of its own that recomputes too."""
    ref = lora_model("llama")
    kw = {} if reentrant is None else {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    ref.gradient_checkpointing_enable(**kw)
    init = {k: v.clone() for k, v in ref.state_dict().items() if "lora_" in k}
    model = copy.deepcopy(ref)
    cfg = ds_config(tmp_path / "nvme")
    if policy is not None:
        cfg["offloadpp"]["activations"] = {"policy": policy}
    engine, *_ = offloadpp.initialize(model=model, model_parameters=trainable(model), config=cfg)
    try:
        data = batches(4)
        ref.train()
        want_losses = reference(ref, data)
        losses = train(engine, data)
        assert losses == pytest.approx(want_losses, rel=1e-5)
        got = engine.module.state_dict()
        assert rel(got, ref.state_dict()) < 1e-5
        # every adapter trained (peft makes the embeddings' output require grad, so reentrant
        # checkpointing reaches the blocks' adapters too)
        assert all(not torch.equal(got[k], init[k]) for k in init)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_merged_export_streams_the_base_with_its_adapters_folded_in(tmp_path, kind):
    """engine.save_merged writes the base model's own folder with each LoRA layer's delta added,
    unit by unit: from_pretrained of the plain model class gives peft's merge_and_unload."""
    ref = lora_model(kind)
    model = copy.deepcopy(ref)
    engine, *_ = offloadpp.initialize(
        model=model, model_parameters=trainable(model), config=ds_config(tmp_path / "nvme")
    )
    try:
        data = batches(3)
        reference(ref, data)
        train(engine, data)
        engine.save_merged(str(tmp_path / "merged"))
    finally:
        engine.close()
    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    loaded = cls.from_pretrained(str(tmp_path / "merged"), local_files_only=True).eval()
    want = ref.merge_and_unload().eval()
    assert set(loaded.state_dict()) == set(want.state_dict())
    assert rel(loaded.state_dict(), want.state_dict()) < 1e-5
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=data[0]).logits, want(input_ids=data[0]).logits, rtol=1e-4, atol=1e-5
        )


def test_lora_over_a_base_streamed_under_init_starts_as_the_base(tmp_path):
    """get_peft_model over a model built under offloadpp.Init with from_pretrained: the base's
    weights come from its safetensors unit by unit, the adapters get peft's init (lora_B zero),
    so the first loss is the base model's; training moves only the adapters."""
    base = tiny("llama")
    base.save_pretrained(str(tmp_path / "base"))
    x = batches(1)[0]
    with torch.no_grad():
        want = base(input_ids=x, labels=x).loss.item()
    cfg = ds_config(tmp_path / "nvme")
    with offloadpp.Init(config=cfg):
        empty = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
        model = peft.get_peft_model(empty, peft.LoraConfig(r=8, target_modules=TARGETS["llama"]))
    assert any(p.is_meta for p in model.parameters())
    engine, *_ = offloadpp.initialize(model=model, model_parameters=trainable(model), config=cfg)
    try:
        sd = engine.module.state_dict()
        assert all(not sd[k].any() for k in sd if "lora_B" in k)
        assert all(sd[k].abs().max() > 0 for k in sd if "lora_A" in k)
        base_sd = base.state_dict()
        for k, v in sd.items():
            name = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
            if "lora_" not in k:
                assert torch.equal(v, base_sd[name]), k
        losses = train(engine, [x, x])
        assert losses[0] == pytest.approx(want, rel=1e-6) and losses[1] < losses[0]
    finally:
        engine.close()


def swap_dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(str(path)) for f in fs)


@pytest.mark.parametrize("clip, speculate", [(0.0, "auto"), (1.0, "auto"), (1.0, "on")])
def test_lora_swap_dir_is_the_base_and_16_bytes_per_trainable_parameter(tmp_path, clip, speculate):
    """Issue 22's disk bar on a LoRA run whose adapters are about 2% of its base (width 512): the
    swap directory holds the frozen base once and at most 16 B per trainable parameter (master,
    two moments, gradients), because speculate "auto" runs its updates after backward, in
    place (decide.overlap_pays), clipping or not, and trains as plain peft. speculate "on" keeps
    the overlap and its second generation of the state: more than 16 B, which this bound sees."""
    cfg_model = transformers.GPT2Config(n_layer=2, n_embd=512, n_head=4, n_positions=32, vocab_size=VOCAB,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS["gpt2"], lora_dropout=0.0, fan_in_fan_out=True
    )
    ref = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg_model), lora)
    with torch.no_grad():  # (as lora_model: lora_B non-zero, so lora_A's first gradients are not)
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model = copy.deepcopy(ref)
    cfg = ds_config(tmp_path / "nvme")
    cfg["gradient_clipping"] = clip
    cfg["offloadpp"]["speculate"] = speculate
    engine, *_ = offloadpp.initialize(model=model, model_parameters=trainable(model), config=cfg)
    try:
        rt = engine.runtime
        assert rt.plan.speculative == (speculate == "on") and rt.plan.deferred_update
        data = batches(3)
        opt = torch.optim.AdamW(trainable(ref), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        want = []
        for x in data:
            loss = ref(input_ids=x, labels=x).loss
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(trainable(ref), clip)
            opt.step()
            opt.zero_grad()
            want.append(loss.item())
        assert train(engine, data) == pytest.approx(want, rel=1e-5)
        assert rel(engine.module.state_dict(), ref.state_dict()) < 1e-5
        base = rt.plan.frozen_ssd_bytes()
        n = sum(flat_numel(u.numel) for u in rt.units)
        assert base == sum(flat_numel(u.frozen_numel) * 4 for u in rt.units) and n < base / 4 / 40
        headers = 4096 * 8 * len(rt.units)  # a header block per key and file, at most 8 keys a unit
        on_disk = swap_dir_bytes(tmp_path / "nvme")
        assert on_disk >= rt.disk_bytes() >= base
        if speculate == "auto":
            assert rt.plan.ssd_footprint_bytes() <= base + 16 * n
            assert on_disk <= base + 16 * n + headers
        else:  # two generations of master and moments: 24 B, and gradients
            assert on_disk > base + 16 * n + headers and rt.plan.ssd_footprint_bytes() >= base + 24 * n
    finally:
        engine.close()


@pytest.mark.parametrize("plan", [None, "auto"])
def test_lora_over_a_bf16_base_with_fp32_compute_keeps_the_base_bf16(tmp_path, plan):
    """A bf16 base (peft's adapters fp32) trained with fp32 compute: the frozen segments are
    stored bf16 (2 B per parameter on disk) and upcast at each fetch, so the run equals plain
    peft on the same model with its base upcast to fp32, and the base comes back bf16 bit for bit.
    plan "auto": the analytic model profile carries the frozen dtype to the search."""
    model = lora_model("llama")
    for n, p in model.named_parameters():
        if "lora_" not in n:
            p.data = p.data.to(torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in trainable(model))
    ref = copy.deepcopy(model).float()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = ds_config(tmp_path / "nvme")
    if plan is not None:
        from test_cost import hw

        hw(device_flops_per_s={"fp32": 100e9}).to_json(str(tmp_path / "hw.json"))
        cfg["offloadpp"].update(plan=plan, hardware_profile=str(tmp_path / "hw.json"))
    engine, *_ = offloadpp.initialize(model=model, model_parameters=trainable(model), config=cfg)
    try:
        rt = engine.runtime
        assert rt.plan.compute_dtype == "fp32"
        assert all(u.frozen_dtype == "bf16" for u in rt.plan.units if u.frozen_numel)
        assert all(u.frozen_slot.dtype == torch.bfloat16 for u in rt.units if u.frozen_slot is not None)
        if plan is None:  # (the search keeps this tiny model in memory)
            assert rt.plan.frozen_ssd_bytes() == sum(flat_numel(u.frozen_numel) * 2 for u in rt.units)
        data = batches(5)
        assert train(engine, data) == pytest.approx(reference(ref, data), rel=1e-5)
        got = engine.module.state_dict()
        assert rel(got, ref.state_dict()) < 1e-5
        base = [k for k in init if "lora_" not in k]
        assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], init[k]) for k in base)
    finally:
        engine.close()
