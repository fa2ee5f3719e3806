"""Frozen parameters (docs/frozen.md): per-parameter trainability inside a unit, on a plain torch
model with whole frozen units and units that mix frozen and trainable parameters."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
from numerics import worst_relative
from test_cost import hw
from torch import nn

from offloadpp.assemble import assemble_engine
from offloadpp.optim import AdamHyper
from offloadpp.planner import Settings
from offloadpp.planner.cost import estimate
from offloadpp.planner.model_profile import ModelProfile, UnitProfile
from offloadpp.planner.plan import flat_numel
from offloadpp.runtime import RuntimeConfig
from offloadpp.runtime.checkpoint import CheckpointError

LR, WD = 1e-3, 0.01
WIDTH = 96


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    """inp, blocks.0..3, out: the runtime finds the blocks and makes 6 units."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h).pow(2).mean()


def frozen_net(seed: int = 0) -> Net:
    """blocks.0 and blocks.2 wholly frozen; blocks.1 mixed (fc1, norm frozen; fc2 trainable, an
    adapter's place); inp's bias frozen; out trainable."""
    torch.manual_seed(seed)
    m = Net()
    for b in (m.blocks[0], m.blocks[2]):
        b.requires_grad_(False)
    m.blocks[1].fc1.requires_grad_(False)
    m.blocks[1].norm.requires_grad_(False)
    m.inp.bias.requires_grad_(False)
    return m


def config(path, **settings) -> RuntimeConfig:
    os.makedirs(path, exist_ok=True)
    return RuntimeConfig(nvme_paths=[str(path)], settings=Settings(**settings), device="cpu",
                         ssd_read_gbps=2.0, ssd_write_gbps=2.0)  # fmt: skip


def data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def frozen_files(path) -> dict[str, bytes]:
    out = {}
    for f in sorted(glob.glob(os.path.join(str(path), "**", "*.frozen.*"), recursive=True)):
        with open(f, "rb") as fh:
            out[os.path.basename(f)] = fh.read()
    return out


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def frozen_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def train(eng, xs):
    reports = []
    for x in xs:
        eng.backward(eng(x))
        reports.append(eng.step())
    return reports


def train_beside(ref, opt, eng, xs):
    """The same batches through torch (ref, opt) and the engine; the engine's step reports."""
    reports = []
    for x in xs:
        ref(x).backward()
        opt.step()
        opt.zero_grad()
        eng.backward(eng(x))
        reports.append(eng.step())
    return reports


def test_layout_splits_frozen_parameters_into_their_own_segment():
    from offloadpp.runtime.partition import find_units, layout_units

    m = frozen_net()
    lays = {lay.unit.name: lay for lay in layout_units(m, find_units(m))}
    assert lays["blocks.0"].numel == 0 and lays["blocks.0"].frozen_numel == sum(
        p.numel() for p in m.blocks[0].parameters()
    )
    mixed = lays["blocks.1"]
    assert [s.name for _, s in mixed.params] == ["blocks.1.fc2.weight", "blocks.1.fc2.bias"]
    assert [s.offset for _, s in mixed.params] == [0, 2 * WIDTH * WIDTH]  # back to back
    assert [s.name for _, s in mixed.frozen] == [
        "blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.norm.weight", "blocks.1.norm.bias"
    ]  # fmt: skip
    assert all(s.frozen and not s.requires_grad for _, s in mixed.frozen)
    assert [s.name for _, s in mixed.all_params][:2] == ["blocks.1.fc1.weight", "blocks.1.fc1.bias"]
    spec = mixed.spec()
    assert (spec.numel, spec.frozen_numel) == (mixed.numel, mixed.frozen_numel)
    # over several ranks every parameter stays in the flat buffer
    flat = {lay.unit.name: lay for lay in layout_units(m, find_units(m), split_frozen=False)}
    assert flat["blocks.0"].frozen == [] and flat["blocks.0"].numel == lays["blocks.0"].frozen_numel


@pytest.mark.parametrize("where", ["ssd", "memory"])
def test_frozen_parameters_train_like_adamw_and_are_never_written(tmp_path, where):
    """Only the trainable parameters change, as torch AdamW changes them; the frozen segments'
    swap files are byte-identical after training; the step writes only the trainable state."""
    ref = frozen_net()
    init = copy.deepcopy(ref.state_dict())
    settings = {} if where == "ssd" else {"offload_params": False, "offload_optimizer": False}
    eng = assemble_engine(
        copy.deepcopy(ref), config(tmp_path, **settings), hyper=AdamHyper(lr=LR, weight_decay=WD)
    )
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    try:
        before = frozen_files(tmp_path)
        if where == "ssd":
            assert len(before) == 4  # blocks.0, blocks.1, blocks.2, inp
        reports = train_beside(ref, opt, eng, data(6))
        sd, want = eng.module.state_dict(), ref.state_dict()
        assert worst_relative(sd, want) < 1e-5
        for name, p in ref.named_parameters():
            assert torch.equal(sd[name], init[name]) == (not p.requires_grad), name
        assert frozen_files(tmp_path) == before
        # SSD bytes written per step: the trainable state only (master and both moments, fp32)
        if where == "ssd":
            padded = sum(flat_numel(u.numel) for u in eng.units)
            for r in reports[1:]:
                written = dict((k, w) for k, _, w in r.ssd_by_kind)
                assert sum(written.values()) == 12 * padded, r.ssd_by_kind
                read = dict((k, rd) for k, rd, _ in r.ssd_by_kind)
                frozen_reads = sum(u.frozen_slot.nbytes for u in eng.units if u.frozen_slot is not None)
                assert read["weights"] >= frozen_reads  # read for forward (and backward), never written
            # the frozen parameters get no master, moments or gradients: the units that have no
            # trainable parameter have empty arrays
            assert all(s.numel == 0 for s in eng.units[1].slots if s is not eng.units[1].frozen_slot)
    finally:
        eng.close()


@pytest.mark.parametrize("where", ["ssd", "memory"])
def test_a_bf16_base_under_fp32_compute_stays_bf16_and_trains_exactly(tmp_path, where):
    """A 16-bit frozen base trained with fp32 compute is stored as the model gives it (2 B per
    parameter on disk, UnitSpec.frozen_dtype) and upcast at each fetch: exact, so the run equals
    torch on the same model with the base upcast to fp32 (within the 1e-5 of the fp32 runs);
    the frozen parameters come back bf16, bit for bit."""
    ref = frozen_net()
    for p in ref.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16).float()  # the values a bf16 base holds
    model = copy.deepcopy(ref)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    settings = {} if where == "ssd" else {"offload_params": False, "offload_optimizer": False}
    eng = assemble_engine(model, config(tmp_path, **settings), hyper=AdamHyper(lr=LR, weight_decay=WD))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    try:
        assert eng.plan.compute_dtype == "fp32"
        mixed = eng.plan.unit("blocks.1")
        assert (
            mixed.frozen_dtype == "bf16" and mixed.frozen_bytes("fp32") == flat_numel(mixed.frozen_numel) * 2
        )
        assert all(u.frozen_slot.dtype == torch.bfloat16 for u in eng.units if u.frozen_slot is not None)
        before = frozen_files(tmp_path)
        if where == "ssd":
            assert sum(len(b) for b in before.values()) <= eng.plan.frozen_ssd_bytes() + 4 * 4096
            assert eng.plan.frozen_ssd_bytes() == sum(flat_numel(u.frozen_numel) * 2 for u in eng.units)
        train_beside(ref, opt, eng, data(4))
        sd, want = eng.module.state_dict(), ref.state_dict()
        assert worst_relative(sd, want) < 1e-5
        for name, p in ref.named_parameters():
            if not p.requires_grad:
                assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], init[name]), name
        assert frozen_files(tmp_path) == before
    finally:
        eng.close()


def test_disk_footprint_is_the_frozen_base_and_the_trainable_state(tmp_path):
    m = frozen_net()
    eng = assemble_engine(m, config(tmp_path), hyper=AdamHyper(lr=LR))
    try:
        train(eng, data(2))
        frozen = sum(u.frozen_slot.nbytes for u in eng.units if u.frozen_slot is not None)
        trainable = sum(flat_numel(u.numel) for u in eng.units)
        assert frozen == sum(flat_numel(u.frozen_numel) * 4 for u in eng.units)
        # master and two moments per trainable parameter, each in two generations (updates run
        # during backward: runtime/slots.py), 4 KiB of header per key and file
        disk = eng.disk_bytes()
        assert eng.plan.ssd_footprint_bytes() == frozen + 2 * 12 * trainable
        assert frozen + 2 * 12 * trainable <= disk <= frozen + 2 * 12 * trainable + 64 * 4096
    finally:
        eng.close()


def test_checkpoint_resume_is_bit_identical_and_refuses_another_base(tmp_path):
    xs = data(6)
    hyper = AdamHyper(lr=LR, weight_decay=WD)
    a = assemble_engine(frozen_net(), config(tmp_path / "a"), hyper=hyper)
    try:
        train(a, xs[:3])
        a.save_state(str(tmp_path / "ckpt"))
        b = assemble_engine(frozen_net(), config(tmp_path / "b"), hyper=AdamHyper(lr=0.5))
        try:
            b.load_state(str(tmp_path / "ckpt"))
            train(a, xs[3:])
            train(b, xs[3:])
            sa, sb = a.module.state_dict(), b.module.state_dict()
            assert all(torch.equal(sa[k], sb[k]) for k in sa)
        finally:
            b.close()
        # the checkpoint holds no frozen segment, only its reference
        names = os.listdir(tmp_path / "ckpt" / "state")
        assert names and not any(".frozen." in n for n in names)
        other = frozen_net(seed=7)  # another base: its frozen values differ
        c = assemble_engine(other, config(tmp_path / "c"), hyper=hyper)
        try:
            with pytest.raises(CheckpointError, match="frozen parameters' values differ"):
                c.load_state(str(tmp_path / "ckpt"))
        finally:
            c.close()
        thawed = frozen_net()
        thawed.blocks[0].fc1.requires_grad_(True)
        d = assemble_engine(thawed, config(tmp_path / "d"), hyper=hyper)
        try:
            with pytest.raises(CheckpointError, match="frozen parameters differ|not in the checkpoint"):
                d.load_state(str(tmp_path / "ckpt"))
        finally:
            d.close()
    finally:
        a.close()


def test_meta_model_initialises_its_frozen_segment(tmp_path):
    """A model built on the meta device: the frozen parameters are initialised by the module's
    own init, unit by unit, into their segment."""
    torch.manual_seed(0)
    with torch.device("meta"):
        m = Net()
    m.blocks[0].requires_grad_(False)
    m.blocks[1].fc1.requires_grad_(False)

    def init(mod):
        if isinstance(mod, nn.Linear):
            nn.init.constant_(mod.weight, 0.01)
            nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.LayerNorm):
            nn.init.ones_(mod.weight)
            nn.init.zeros_(mod.bias)

    eng = assemble_engine(m, config(tmp_path), init_fn=init, hyper=AdamHyper(lr=LR))
    try:
        sd = eng.module.state_dict()
        assert torch.equal(sd["blocks.0.fc1.weight"], torch.full((2 * WIDTH, WIDTH), 0.01))
        assert torch.equal(sd["blocks.1.fc1.weight"], torch.full((2 * WIDTH, WIDTH), 0.01))
        assert torch.equal(sd["blocks.0.norm.weight"], torch.ones(WIDTH))
        train(eng, data(2))
        sd2 = eng.module.state_dict()
        assert torch.equal(sd2["blocks.1.fc1.weight"], sd["blocks.1.fc1.weight"])
        assert not torch.equal(sd2["blocks.1.fc2.weight"], sd["blocks.1.fc2.weight"])
    finally:
        eng.close()


def test_plan_shows_trainable_and_frozen_per_unit(tmp_path):
    eng = assemble_engine(frozen_net(), config(tmp_path), hyper=AdamHyper(lr=LR))
    try:
        text = eng.plan.describe()
        assert "trainable" in text and "frozen at" in text
        line = next(ln for ln in text.splitlines() if ln.strip().startswith("blocks.0 "))
        assert f"{sum(p.numel() for p in Block().parameters()):,}" in line and " ssd" in line
        m = frozen_net()
        assert f"frozen: {frozen_numel(m):,} parameters" in text
        assert f"trainable: {trainable_numel(m):,} parameters" in text
    finally:
        eng.close()


def test_cost_model_counts_frozen_reads_and_no_frozen_writes(tmp_path):
    """The replay's bytes by kind beside the run's: the frozen segments are weights read, not
    written, in both."""
    eng = assemble_engine(frozen_net(), config(tmp_path), hyper=AdamHyper(lr=LR))
    try:
        reports = train(eng, data(3))
        units = tuple(
            UnitProfile(u.name, u.numel, 1000, 2000, 0, frozen_numel=u.frozen_numel) for u in eng.plan.units
        )
        prof = ModelProfile("net", 8, 1, "fp32", units)
        est = estimate(eng.plan, hw(device_flops_per_s={"fp32": 100e9}), prof)
        got = {k: (r, w) for k, r, w in reports[-1].ssd_by_kind}
        want = {k: (r, w) for k, r, w in est.ssd_by_kind}
        assert got == want
        assert want["weights"][0] - want["weights"][1] >= eng.plan.frozen_ssd_bytes()  # read, not written
        assert eng.plan.frozen_ssd_bytes() == sum(u.frozen_slot.nbytes for u in eng.units if u.frozen_slot)
    finally:
        eng.close()


@pytest.mark.parametrize("auto", [False, True])
def test_offloadpp_plan_with_lora_shows_trainable_and_frozen_per_unit(tmp_path, auto):
    """`offloadpp plan --model gpt2-45m --lora 8`: each block's adapters trainable, its base and the
    embeddings frozen; with a hardware profile (an estimate, plan "auto") the analytic profile
    takes the model's split."""
    import json
    import re
    import subprocess
    import sys

    pytest.importorskip("peft")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    off = {"device": "nvme", "nvme_path": str(nvme)}
    ds = {"train_micro_batch_size_per_gpu": 2, "offloadpp": {"enabled": True, **({"plan": "auto"} if auto else {})},
          "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": off}}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    argv = [sys.executable, "-m", "offloadpp", "plan", "--config", str(tmp_path / "ds.json"), "--model", "gpt2-45m",
            "--lora", "8"]  # fmt: skip
    if auto:
        hw(device_flops_per_s={"fp32": 100e9}).to_json(str(tmp_path / "hw.json"))
        argv += ["--hardware", str(tmp_path / "hw.json")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [
        ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith(("embed", "base_model", "head"))
    ]
    rows = [row for row in rows if len(row) == 8]  # the plan's table (not the activations' lines)
    blocks = [row for row in rows if "transformer.h." in row[0]]
    assert len(blocks) == 6
    # r * (in + out) per adapted projection: c_attn 512->1536, attn c_proj 512->512, c_fc 512->2048, mlp c_proj 2048->512
    assert all(
        row[1] == f"{8 * (2048 + 1024 + 2560 + 2560):,}" and row[2] == f"{3_152_384:,}" for row in blocks
    )
    assert rows[0][0] == "embed" and rows[0][1] == "0"
    assert "frozen: 44,777,984 parameters" in r.stdout
    # the adapters' state has one generation on SSD, and the plan says why (decide.overlap_pays)
    per_param = float(
        re.search(r"the frozen base and ([0-9.]+) B per trainable parameter", r.stdout).group(1)
    )
    assert per_param <= 16
    assert 'speculate "auto": updates run after backward' in r.stdout
    assert "below the cost model's prediction error (15%)" in r.stdout
    if auto:
        assert "estimate" in r.stdout or "s/step" in r.stdout


def test_a_measured_profile_records_the_frozen_split():
    from offloadpp.profiling.model import profile_model

    m = frozen_net()
    prof = profile_model(m, {"x": data(1)[0]}, loss_fn=lambda out: out, repeats=1, runtime_layout=True)
    by = {u.name: u for u in prof.units}
    assert by["blocks.0"].numel == 0 and by["blocks.0"].frozen_numel > 0
    assert sum(u.frozen_numel for u in prof.units) == frozen_numel(m)
    assert sum(u.numel for u in prof.units) == trainable_numel(m)


@pytest.mark.parametrize("accum, clip", [(2, 0.0), (1, 0.05), (2, 0.05)])
def test_frozen_parameters_with_accumulation_and_clipping(tmp_path, accum, clip):
    """Accumulation and clipping by the global norm (of the trainable gradients only, as torch
    clips the parameters it is given): as torch AdamW, the frozen parameters untouched."""
    ref = frozen_net()
    init = copy.deepcopy(ref.state_dict())
    eng = assemble_engine(copy.deepcopy(ref), config(tmp_path, gradient_accumulation_steps=accum, gradient_clipping=clip),
                          hyper=AdamHyper(lr=LR, weight_decay=WD))  # fmt: skip
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    try:
        xs = data(4 * accum)
        for step in range(4):
            for m in range(accum):
                x = xs[step * accum + m]
                (ref(x) / accum).backward()
                eng.backward(eng(x))
                eng.step()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            opt.zero_grad()
        sd, want = eng.module.state_dict(), ref.state_dict()
        assert worst_relative(sd, want) < 1e-5
        for name, p in ref.named_parameters():
            assert torch.equal(sd[name], init[name]) == (not p.requires_grad), name
    finally:
        eng.close()
